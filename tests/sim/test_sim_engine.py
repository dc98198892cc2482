"""``kvcoord sim-engine`` as a real process: read by the relay over real ZMQ (mirror == pool), and
looking up each prompt on a real ``kvcoord serve`` as a router would (``--lookup-coordinator``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvcoord.engine.relay import REPLAY_ONLY_PROBES_WARN, Relay
from kvcoord.router.client import CoordinatorClient
from kvcoord.sim.engine import PromptSource
from tests.engine.test_relay import RecordingSink, wait_for
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port


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
    # Host endpoints as the README writes them: --zmq-bind always binds (vLLM would connect these).
    cmd = kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{base_pub}",
                      "--replay-bind", f"tcp://127.0.0.1:{base_replay}",
                      "--dp-rank", str(dp_rank), "--form", form, "--requests", "120", "--rate", "200",
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

            try:
                await wait_for(lambda: finished() or proc.poll() is not None,
                               "engine finished and relay caught up", timeout=30)
            except AssertionError as exc:  # say where each side stood (this wait timed out twice in CI)
                st = _read_state(state) or {}
                raise AssertionError(
                    f"{exc}: relay expected_seq {relay.expected_seq}, stats {relay.stats}; engine state "
                    f"finished={st.get('finished')} next_seq={st.get('next_seq')}\n"
                    f"{(tmp_path / 'engine.log').read_text()[-3000:]}") from None
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            st = _read_state(state)
            assert st is not None
            pool_blocks = sorted(tuple(e) for e in st["blocks"][str(dp_rank)])
            assert pool_blocks, "the workload cached nothing"
            assert sorted(relay.snapshot()[dp_rank]) == pool_blocks
            assert relay.stats.lost_batches == 0 and not relay.stats.malformed
            # Live PUB frames, not replay polling alone (which would hide an engine that never binds).
            assert relay.stats.frames > 0 and relay.stats.replay_only_probes < REPLAY_ONLY_PROBES_WARN
            assert {dp for dp, _, _ in sink.batches} == {dp_rank}
            assert any(type(e).__name__ == "BlockRemoved" for _, evs, _ in sink.batches for e in evs), \
                "the pool never evicted: the test is too gentle"
        assert proc.returncode == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)


# --- router-style lookups (--lookup-coordinator) --------------------------------------------------
MODEL = "sim-model"
SALT = "tenant-7"
WORKLOAD = {"--seed": "3", "--prefixes": "4", "--prefix-len": "64", "--suffix-len": "16"}


def _poll_state(path: Path, cond: Any, what: str, proc: Any, log: Path,
                timeout: float = 30.0) -> dict[str, Any]:
    """Poll the state file until ``cond(state)``; fail with the engine's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sim-engine exited while waiting for {what}:\n{log.read_text()[-3000:]}"
        st = _read_state(path)
        if st is not None and cond(st):
            return st
        time.sleep(0.05)
    lookup = st and st.get("lookup")
    raise AssertionError(f"timed out waiting for {what}; lookups {lookup}\n{log.read_text()[-3000:]}")


def _engine_cmd(pub: int, replay: int, coordinator: str, state: Path, *extra: str) -> list[str]:
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                       "--replay-bind", f"tcp://127.0.0.1:{replay}", "--model", MODEL, "--block-size", "8",
                       "--algo", "sha256_cbor", "--hash-seed", "0", "--output-len", "4",
                       *(x for kv in WORKLOAD.items() for x in kv), "--state-file", str(state),
                       "--lookup-coordinator", coordinator, *extra)


def _serve_cmd(gport: int) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}",
                       "--metrics-listen", f"127.0.0.1:{free_port()}",
                       "--http-listen", f"127.0.0.1:{free_port()}",
                       "--model", f"{MODEL},algo=sha256_cbor,block_size=8,seed=0")


def test_sim_engine_looks_up_each_prompt_like_a_router(tmp_path: Path) -> None:
    """serve + agent + sim-engine: the engine's lookups (with its cache_salt) find its own blocks."""
    gport, pub, replay = free_port(), free_port(), free_port()
    state = tmp_path / "state.json"
    logs = {n: tmp_path / f"{n}.log" for n in ("serve", "agent", "engine")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve_cmd(gport), log=logs["serve"]))
        wait_for_port(gport, timeout=30)
        engine = stack.enter_context(running(_engine_cmd(
            pub, replay, f"127.0.0.1:{gport}", state, "--lookup-node-id", "node-x", "--cache-salt", SALT,
            "--rate", "100"), log=logs["engine"]))
        agent_stats = tmp_path / "agent-stats.json"
        stack.enter_context(running(kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", "node-x", "--model", MODEL,
            "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
            "--stats-file", str(agent_stats)), log=logs["agent"]))
        st = _poll_state(state, lambda s: s["lookup"]["best_is_self"] >= 5, "lookups that hit this engine",
                         engine, logs["engine"])
        lk = st["lookup"]
        assert lk["errors"] == 0, lk
        assert lk["lookups"] >= lk["hits"] >= lk["best_is_self"] >= 5
        assert 0 < lk["best_matched_blocks"] <= lk["query_blocks"]
        # What the coordinator says this engine holds tracks what its pool held (the index lags a little).
        assert lk["self_matched_blocks"] > 0 and lk["local_cached_blocks"] > 0
        assert lk["self_matched_blocks"] <= lk["best_matched_blocks"]
        # The agent reads the engine's PUB socket live (both sides connecting would leave frames at 0).
        # The stats file is rewritten periodically, and the first batches may all come from the replay that
        # catches a late joiner up: poll it until live frames show.
        deadline = time.monotonic() + 30
        relay: dict[str, Any] = {}
        while time.monotonic() < deadline:
            relay = (_read_state(agent_stats) or {"relays": [{}]})["relays"][0]
            if relay.get("frames", 0) > 0:
                break
            time.sleep(0.05)
        assert relay.get("frames", 0) > 0 and relay["replay_only_probes"] < REPLAY_ONLY_PROBES_WARN, relay

        # The lookups carried the request's extra keys: the salted prompt hits, the unsalted one does not.
        prompt = PromptSource(3, prefixes=4, prefix_len=64, suffix_len=16, output_len=4).prompt()
        with CoordinatorClient(f"127.0.0.1:{gport}", timeout=5.0) as client:
            salted = client.lookup(MODEL, tokens=prompt, cache_salt=SALT)
            plain = client.lookup(MODEL, tokens=prompt)
        assert salted.nodes and salted.nodes[0].node_id == "node-x" and salted.nodes[0].matched_blocks >= 8
        assert not plain.nodes or plain.nodes[0].matched_blocks == 0


def test_sim_engine_keeps_serving_when_the_coordinator_is_down(tmp_path: Path) -> None:
    """A coordinator address that accepts TCP but never answers, then nothing, then a real coordinator:
    lookups time out and are counted (and logged once), the bounded queue drops the excess, requests keep
    flowing, and lookups are answered again once ``kvcoord serve`` is up. SIGTERM still stops it fast."""
    pub, replay = free_port(), free_port()
    state = tmp_path / "state.json"
    log = tmp_path / "engine.log"
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(64)  # the kernel completes handshakes; nobody ever reads: every RPC times out
    gport = black_hole.getsockname()[1]
    try:
        with running(_engine_cmd(pub, replay, f"127.0.0.1:{gport}", state, "--rate", "200",
                                 "--lookup-timeout", "0.2", "--lookup-queue", "4"), log=log) as engine:
            st = _poll_state(state, lambda s: s["lookup"]["errors"] >= 3 and s["lookup"]["dropped"] > 0
                             and s["requests_done"] >= 100, "failed and dropped lookups while requests go on",
                             engine, log)
            lk = st["lookup"]
            assert lk["lookups"] == 0 and lk["last_error"], lk
            black_hole.close()
            with running(_serve_cmd(gport), log=tmp_path / "serve.log"):
                wait_for_port(gport, timeout=30)
                before = st["requests_done"]
                st = _poll_state(state, lambda s: s["lookup"]["lookups"] >= 5, "lookups answered again",
                                 engine, log, timeout=45)
                assert st["requests_done"] > before
                text = log.read_text()
                assert text.count("lookups failing") == 1 and "lookups answered again" in text, text
            t0 = time.monotonic()
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(10)
            assert time.monotonic() - t0 < 5.0  # generous: CI is a loaded 2-core VM
        assert engine.returncode == 0, log.read_text()[-3000:]
    finally:
        black_hole.close()


@pytest.mark.parametrize(("flags", "env_seed", "message"), [
    (("--lookup-node-id", "n1"), "0", "--lookup-node-id needs --lookup-coordinator"),
    (("--lookup-coordinator", "127.0.0.1:1", "--lookup-timeout", "0"), "0",
     "argument --lookup-timeout: 0 must be > 0"),
    (("--lookup-coordinator", "127.0.0.1:1", "--lookup-tls-ca", "/nonexistent/ca.pem"), "0", "cannot read"),
    (("--algo", "md5"), "0", "unknown hash algorithm"),
    # No seed (neither --hash-seed nor PYTHONHASHSEED): refused before publishing, not at the first request.
    ((), None, "no NONE_HASH seed"),
])
def test_sim_engine_bad_flags_exit_2_before_serving(tmp_path: Path, flags: tuple[str, ...],
                                                   env_seed: str | None, message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    state = tmp_path / "state.json"
    pub = free_port()
    out = subprocess.run(kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--requests", "1",
                                     "--state-file", str(state), *flags),
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not state.exists(), "a refused engine served requests"
    with socket.socket() as s:  # nothing kept the PUB port
        s.bind(("127.0.0.1", pub))
