"""``kvcoord sim-engine`` as a real process, read by the relay over real ZMQ: mirror == pool."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvcoord.agent.relay import Relay
from tests.procs import free_port, kvcoord_cmd, running
from tests.test_relay import RecordingSink, wait_for


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


@pytest.mark.parametrize(("dp_rank", "form"), [(0, "map"), (2, "array")])
async def test_sim_engine_stream_mirrors_pool(tmp_path: Path, dp_rank: int, form: str) -> None:
    base_pub, base_replay = free_port(), free_port()
    while base_replay in range(base_pub, base_pub + 3):
        base_replay = free_port()
    state = tmp_path / "state.json"
    cmd = kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://*:{base_pub}",
                      "--replay-bind", f"tcp://*:{base_replay}",
                      "--dp-rank", str(dp_rank), "--form", form, "--requests", "120", "--rate", "400",
                      "--num-blocks", "96", "--block-size", "8", "--prefix-len", "40", "--suffix-len", "20",
                      "--output-len", "8", "--removal-events", "last_copy", "--hash-seed", "0",
                      "--state-file", str(state), "--linger")
    sink = RecordingSink()
    # vLLM's per-rank offsets: rank r publishes on base port + r.
    relay = Relay(f"tcp://127.0.0.1:{base_pub + dp_rank}", sink,
                  replay_endpoint=f"tcp://127.0.0.1:{base_replay + dp_rank}",
                  replay_timeout=0.5, idle_probe=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        with running(cmd, log=tmp_path / "engine.log") as proc:
            def finished() -> bool:
                st = _read_state(state)
                return st is not None and bool(st.get("finished")) and relay.expected_seq == st["next_seq"]

            await wait_for(lambda: finished() or proc.poll() is not None,
                           "engine finished and relay caught up", timeout=30)
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            st = _read_state(state)
            assert st is not None
            pool_blocks = sorted(tuple(e) for e in st["blocks"][str(dp_rank)])
            assert pool_blocks, "the workload cached nothing"
            assert sorted(relay.snapshot()[dp_rank]) == pool_blocks
            assert relay.stats.lost_batches == 0 and not relay.stats.malformed
            assert {dp for dp, _, _ in sink.batches} == {dp_rank}
            assert any(type(e).__name__ == "BlockRemoved" for _, evs, _ in sink.batches for e in evs), \
                "the pool never evicted: the test is too gentle"
        assert proc.returncode == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)
