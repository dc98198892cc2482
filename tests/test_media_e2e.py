"""Media as configuration, over real processes (issue 26, item 1): an engine (kvcoord's vLLM-exact ZMQ
publisher, with a replay buffer) publishes batches that mix GPU and CPU blocks with media kvcoord maps by
default (``SHARED_STORAGE``, llm-d's), by configuration (``MY_POOL``: the coordinator's ``[media]``, the
agent's ``--media``) and by nobody (``TAPE``, ``weird-medium``), relayed by ``kvcoord agent`` or by
``kvcoord serve`` itself after ``POST /register``.

Nothing is refused: the known blocks are indexed on their tiers (gRPC and HTTP lookups say which), the
unknown ones are not (a removal of an unknown medium removes nothing), the node stays ``exact`` and
active, no batch counts as malformed, and ``kvcoord_unknown_medium_events_total`` counts each name, logged
once. A bad ``[media]`` entry or ``--media`` flag stops the command with one line.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvcoord.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tests.coordinator.test_history_lost import BS, MODEL, Stack, block, tokens
from tests.http_util import Samples, by_label, http_json, metrics, sample
from tests.procs import free_port, kvcoord_cmd, running, until

CONFIG = """\
[media]
my_pool = "cpu"
"""


def store(i: int, medium: str | None) -> BlockStored:
    """Block ``i`` (a chain head of its own tokens, hashed as the coordinator verifies) on ``medium``."""
    return BlockStored(block_hashes=(block(i),), parent_block_hash=None, token_ids=tuple(tokens(i)),
                       block_size=BS, lora_id=None, medium=medium)


BATCHES = [
    (store(0, "GPU"), store(1, "CPU")),
    (store(2, "GPU"), store(3, "SHARED_STORAGE"), store(4, "TAPE"), store(5, "MY_POOL")),
    (store(6, "weird-medium"), BlockRemoved(block_hashes=(block(1),), medium="TAPE"), store(7, None)),
]
"""A good batch; then GPU blocks with llm-d's, an unknown and a configured medium (the batch vLLM 0.33's
relay dropped whole); then another unknown medium, and a removal on an unknown medium of a CPU block."""
TIERS = {0: "GPU", 1: "CPU", 2: "GPU", 3: "STORAGE", 5: "CPU", 7: "GPU"}
"""What the index must hold, and on which tier; blocks 4 and 6 (unknown media) it must not."""
UNKNOWN = {"TAPE": 2.0, "weird-medium": 1.0}


class MediaStack(Stack):
    """:class:`tests.coordinator.test_history_lost.Stack` with ``kvcoord serve --config`` holding a
    ``[media]`` table."""

    def start_serve(self) -> subprocess.Popen[bytes]:
        config = self.tmp / "kvcoord.toml"
        config.write_text(CONFIG)
        self.serves += 1
        proc = self.stack.enter_context(running(kvcoord_cmd(
            "serve", "--config", str(config), "--listen", f"127.0.0.1:{self.grpc}",
            "--metrics-listen", f"127.0.0.1:{self.metrics}", "--http-listen", f"127.0.0.1:{self.http}",
            "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"),
            log=self.tmp / f"serve{self.serves}.log"))
        until(lambda: self._listening(), "kvcoord serve listening", timeout=30)
        return proc

    def _listening(self) -> bool:
        try:
            self.scrape()
        except OSError:
            return False
        return True

    def scrape(self) -> Samples:
        return metrics(f"http://127.0.0.1:{self.metrics}/metrics")

    def relay(self, via: str, *agent_args: str) -> tuple[str, Path]:
        """Relay the engine's events through ``kvcoord agent`` (node ``node-a``, with ``agent_args``) or,
        ``via="register"``, through serve itself after ``POST /register`` (node ``7``); the node id and the
        log that reports what was skipped."""
        if via == "register":
            self.register(7)
            return "7", self.tmp / "serve1.log"
        log = self.tmp / "agent.log"
        self.stack.enter_context(running(kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{self.grpc}", "--node-id", "node-a", "--model", MODEL,
            "--zmq-endpoint", f"tcp://127.0.0.1:{self.pub}", "--replay-endpoint",
            f"tcp://127.0.0.1:{self.replay}", *agent_args), log=log))
        return "node-a", log

    def publish_all(self, batches: Sequence[Sequence[KVEvent]]) -> None:
        """Each batch from the engine, now, and every one sent."""
        for events in batches:
            self.engine.publish(KVEventBatch(ts=time.time(), events=list(events)))
        assert self.engine.flush()

    def assert_exact(self, node: str, entries: int) -> None:
        """``node`` is active and trusted ``exact`` (nothing it sent was refused), the index holds
        ``entries`` entries, and no relayed frame or batch was malformed or rejected."""
        info = self.node(node)
        assert info is not None, node
        assert (info.state, info.trust, info.trust_reason) == ("active", "exact", ""), info
        assert self.client.stats().entries == entries
        scraped = self.scrape()
        for bad in ("kvcoord_relay_malformed_total", "kvcoord_events_rejected_total"):
            assert not sample(scraped, bad), bad

    def unknown_media(self) -> dict[str, float]:
        return by_label(self.scrape(), "kvcoord_unknown_medium_events_total", "medium")

    def tiers(self, node: str) -> dict[int, str]:
        """Block -> the tier a gRPC lookup of it answers for ``node``, for every block published."""
        out = {}
        for i in range(8):
            for n in self.client.lookup(MODEL, hashes=[block(i)]).nodes:
                if n.node_id == node and n.matched_blocks == 1:
                    out[i] = ("GPU", "CPU", "STORAGE")[n.tiers.index(1)]
        return out

    def http_tiers(self, node: str, i: int) -> dict[str, int]:
        status, answer = http_json("POST", f"http://127.0.0.1:{self.http}/query_by_hash",
                                   {"block_hashes": [block(i)], "model_name": MODEL})
        assert status == 200, answer
        nodes = answer["nodes"]
        return next(n["tiers"] for n in nodes if n["node_id"] == node)


@contextlib.contextmanager
def media_stack(tmp: Path) -> Iterator[MediaStack]:
    with contextlib.ExitStack() as es:
        yield MediaStack(tmp, es, early=0, buffer=100)


@pytest.mark.parametrize("via", ["agent", "register"])
def test_unknown_media_are_skipped_and_counted_never_refused(tmp_path: Path, via: str) -> None:
    with media_stack(tmp_path) as s:
        node, log = s.relay(via, "--media", "my_pool=CPU")
        s.publish_all(BATCHES)
        until(lambda: s.tiers(node) == TIERS, "the known blocks indexed on their tiers, the unknown not",
              timeout=60)
        s.assert_exact(node, len(TIERS))
        assert s.http_tiers(node, 3) == {"GPU": 0, "CPU": 0, "STORAGE": 1}
        assert s.http_tiers(node, 5) == {"GPU": 0, "CPU": 1, "STORAGE": 0}
        # The agent reports what it skipped in its heartbeats (every lease/3): poll.
        until(lambda: s.unknown_media() == UNKNOWN, "kvcoord_unknown_medium_events_total per medium",
              timeout=60)
        lines = log.read_text().splitlines()
        for name in UNKNOWN:
            assert sum(f"unknown medium '{name}'" in line for line in lines) == 1, lines


def test_a_bad_media_table_stops_serve_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[media]\nSHARED_STORAGE = "TAPE"\n')
    cmd = kvcoord_cmd("serve", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    message = "media.SHARED_STORAGE: the tier must be one of GPU, CPU, STORAGE, not 'TAPE'"
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize(("flag", "message"), [
    ("SSD", "--media 'SSD': expected NAME=TIER"),
    ("SSD=FLASH", "--media.SSD: the tier must be one of GPU, CPU, STORAGE, not 'FLASH'"),
])
def test_a_bad_media_flag_stops_the_agent_with_one_line(flag: str, message: str) -> None:
    cmd = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{free_port()}", "--node-id", "n",
                      "--model", MODEL, "--zmq-endpoint", "tcp://127.0.0.1:1", "--media", flag)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
