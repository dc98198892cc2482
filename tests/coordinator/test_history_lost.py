"""Lost history makes a node ``degraded`` (issue 15, item 1), over real processes: an engine (kvcoord's
vLLM-exact ZMQ publisher, with a replay buffer of BUFFER batches) that published EARLY batches before
anyone listened, then ``kvcoord agent`` -> ``kvcoord serve`` (the gRPC ``Reporter``), or ``kvcoord serve``
relaying the engine itself after ``POST /register`` (the in-process ``LocalFeed``).

The relay joins, replays what the buffer still holds, and knows the EARLY - BUFFER batches before it are
gone: the node must say so (``degraded``, the reason naming how many batches from which seq) in ListNodes,
lookups and the ``kvcoord_nodes_by_trust`` gauge, while the index holds exactly what the relay got. An
``AllBlocksCleared`` from the engine makes everything known again: ``exact``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvcoord.coordinator.registry import NodeRecord
from kvcoord.coordinator.shared import SharedNode
from kvcoord.events import AllBlocksCleared, BlockStored, KVEventBatch
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.router.client import CoordinatorClient, NodeStatus
from tests.coordinator.test_coordinator_ingest import Agent, ack_seq
from tests.coordinator.test_coordinator_ingest import stored as wire_stored
from tests.coordinator.test_coordinator_ingest import until as until_async
from tests.coordinator.test_trust import HASHES, chain, coordinator
from tests.engine.test_relay import DroppingPublisher
from tests.http_util import by_label, http_json, metrics
from tests.procs import free_port, kvcoord_cmd, running, stop, until, wait_for_port
from tests.redis_servers import RedisServer

MODEL = "history-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")
SPEC = f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"
BUFFER = 10
EARLY = 30
LOST = EARLY - BUFFER
REASON = (f"dp rank 0: history lost: {LOST} batch(es) from seq 0 are gone "
          f"(the replay buffer now starts at {LOST})")


def tokens(i: int) -> list[int]:
    return list(range(10_000 + i * BS, 10_000 + (i + 1) * BS))


def block(i: int) -> int:
    """Batch ``i`` stores one chain head: this block."""
    return int(block_hashes64(PROFILE, tokens(i))[0])


def stored(i: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=(BlockStored(
        block_hashes=(block(i),), parent_block_hash=None, token_ids=tuple(tokens(i)), block_size=BS,
        lora_id=None, medium="GPU"),))


class Stack:
    """The engine (in this process) and ``kvcoord serve``; the agent when asked."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack, *, early: int = EARLY,
                 buffer: int = BUFFER, drop: frozenset[int] = frozenset()) -> None:
        self.tmp, self.stack = tmp, stack
        self.pub, self.replay, self.grpc, self.metrics, self.http = (free_port() for _ in range(5))
        self.engine = DroppingPublisher(0, f"tcp://127.0.0.1:{self.pub}", f"tcp://127.0.0.1:{self.replay}",
                                        buffer_steps=buffer, bind=True, drop=set(drop))
        stack.callback(self.engine.shutdown)
        for i in range(early):  # nobody listens yet: only the last `buffer` stay in the replay buffer
            self.engine.publish(stored(i))
        assert self.engine.flush()
        self.serves = 0
        self.serve = self.start_serve()
        self.client = stack.enter_context(CoordinatorClient(f"127.0.0.1:{self.grpc}", timeout=10.0))

    def start_serve(self) -> subprocess.Popen[bytes]:
        self.serves += 1
        proc = self.stack.enter_context(running(kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{self.grpc}", "--metrics-listen", f"127.0.0.1:{self.metrics}",
            "--http-listen", f"127.0.0.1:{self.http}", "--model", SPEC),
            log=self.tmp / f"serve{self.serves}.log"))
        wait_for_port(self.grpc)
        wait_for_port(self.http)
        return proc

    def start_agent(self, node: str) -> None:
        self.stack.enter_context(running(kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{self.grpc}", "--node-id", node, "--model", MODEL,
            "--zmq-endpoint", f"tcp://127.0.0.1:{self.pub}",
            "--replay-endpoint", f"tcp://127.0.0.1:{self.replay}"), log=self.tmp / "agent.log"))

    def register(self, instance_id: int) -> None:
        status, answer = http_json("POST", f"http://127.0.0.1:{self.http}/register", {
            "instance_id": instance_id, "endpoint": f"tcp://127.0.0.1:{self.pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "model_name": MODEL, "block_size": BS})
        assert status == 201, answer

    def node(self, node: str) -> NodeStatus | None:
        return next((n for n in self.client.list_nodes() if n.node_id == node), None)

    def trust(self, node: str) -> str | None:
        n = self.node(node)
        return n.trust if n is not None else None

    def held(self, node: str, blocks: range) -> list[int]:
        """The batches among ``blocks`` whose block the index holds for ``node`` (one lookup each)."""
        out = []
        for i in blocks:
            nodes = self.client.lookup(MODEL, hashes=[block(i)]).nodes
            if any(n.node_id == node and n.matched_blocks == 1 for n in nodes):
                out.append(i)
        return out

    def trust_gauge(self) -> dict[str, float]:
        page = metrics(f"http://127.0.0.1:{self.metrics}/metrics")
        return by_label(page, "kvcoord_nodes_by_trust", "trust")

    def http_trust(self, node: str, hashes: list[int]) -> tuple[str, str | None] | None:
        """``(trust, trust_cause)`` of ``node`` in a ``/query_by_hash`` answer (cause None: omitted)."""
        status, answer = http_json("POST", f"http://127.0.0.1:{self.http}/query_by_hash",
                                   {"block_hashes": hashes, "model_name": MODEL})
        assert status == 200, answer
        nodes = answer["nodes"]
        return next(((n["trust"], n.get("trust_cause")) for n in nodes if n["node_id"] == node), None)


@contextlib.contextmanager
def stack(tmp: Path, **kw: Any) -> Iterator[Stack]:
    with contextlib.ExitStack() as es:
        yield Stack(tmp, es, **kw)


def degraded_by_lost_history(s: Stack, node: str) -> None:
    """(a): degraded with the reason, on every surface; the index holds exactly what the relay got."""
    def marked() -> bool:
        n = s.node(node)
        return n is not None and n.trust == "degraded" and n.state == "active"

    until(marked, f"{node} degraded")
    info = s.node(node)
    assert info is not None and info.trust_reason == REASON, info
    assert info.trust_cause == "history_lost", info
    assert not info.hash_mismatch and info.hash_mismatch_reason == ""
    # The index content is unchanged by the marking: the batches the buffer still held, nothing else.
    until(lambda: s.held(node, range(EARLY)) == list(range(LOST, EARLY)), "the replayed blocks indexed")
    assert s.client.stats().entries == BUFFER
    answer = s.client.lookup(MODEL, tokens=tokens(EARLY - 1))
    assert [(n.node_id, n.matched_blocks, n.trust, n.trust_cause) for n in answer.nodes] == [
        (node, 1, "degraded", "history_lost")]
    assert s.http_trust(node, [block(LOST)]) == ("degraded", "history_lost")
    until(lambda: s.trust_gauge().get("degraded") == 1.0, "kvcoord_nodes_by_trust{trust=degraded} 1")
    assert s.trust_gauge()["exact"] == 0.0


def exact_after_a_clear(s: Stack, node: str) -> None:
    """(b): an AllBlocksCleared from the engine, then a new block: exact again, holding just that block."""
    s.engine.publish(KVEventBatch(ts=time.time(), events=(AllBlocksCleared(),)))
    s.engine.publish(stored(EARLY))
    assert s.engine.flush()

    def whole() -> bool:
        n = s.node(node)
        return n is not None and (n.trust, n.trust_reason) == ("exact", "")

    until(whole, f"{node} exact after the clear")
    until(lambda: s.held(node, range(EARLY + 1)) == [EARLY], "the index holding only the new block")
    assert s.client.stats().entries == 1
    answer = s.client.lookup(MODEL, tokens=tokens(EARLY))
    assert [(n.node_id, n.matched_blocks, n.trust, n.trust_cause) for n in answer.nodes] == [
        (node, 1, "exact", "")]
    assert s.http_trust(node, [block(EARLY)]) == ("exact", None)
    until(lambda: s.trust_gauge().get("exact") == 1.0, "kvcoord_nodes_by_trust{trust=exact} 1")
    assert s.trust_gauge()["degraded"] == 0.0


def test_an_agent_that_joins_past_the_replay_buffer_marks_its_node_degraded(tmp_path: Path) -> None:
    with stack(tmp_path) as s:
        s.start_agent("node-late")
        degraded_by_lost_history(s, "node-late")
        exact_after_a_clear(s, "node-late")


def test_the_mark_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """The same agent (same epoch) reconnects to a restarted, empty coordinator: its snapshot carries the
    mark, so the node is degraded again, not exact from a snapshot that lacks the lost history."""
    with stack(tmp_path) as s:
        s.start_agent("node-late")
        degraded_by_lost_history(s, "node-late")
        epoch = (s.node("node-late") or pytest.fail("no node")).epoch
        stop(s.serve)
        s.serve = s.start_serve()
        degraded_by_lost_history(s, "node-late")
        assert (s.node("node-late") or pytest.fail("no node")).epoch == epoch


def test_a_registered_engine_past_its_replay_buffer_is_degraded(tmp_path: Path) -> None:
    with stack(tmp_path) as s:
        s.register(7)
        degraded_by_lost_history(s, "7")
        exact_after_a_clear(s, "7")


def test_a_gap_replay_cannot_fill_marks_the_node_degraded_after_its_clear(tmp_path: Path) -> None:
    """After the stream started: the engine's PUB drops batches 5..19 and its 3-batch replay buffer has
    rolled past them by the time the agent sees batch 20. The relay clears the rank (the lost batches may
    have removed blocks) and the mark follows its clear: degraded, holding only what came after."""
    with stack(tmp_path, early=0, buffer=3, drop=frozenset(range(5, 20))) as s:
        s.start_agent("node-gap")
        until(lambda: s.trust("node-gap") == "exact", "node-gap exact")
        for i in range(5):
            s.engine.publish(stored(i))
        until(lambda: s.held("node-gap", range(5)) == list(range(5)), "the first 5 blocks indexed")
        assert s.trust("node-gap") == "exact"
        for i in range(5, 21):
            s.engine.publish(stored(i))
        assert s.engine.flush()
        until(lambda: s.trust("node-gap") == "degraded", "node-gap degraded")
        info = s.node("node-gap")
        assert info is not None
        m = re.fullmatch(r"dp rank 0: history lost: (\d+) batch\(es\) from seq (\d+) are gone "
                         r"\(the replay buffer now starts at (\d+)\)", info.trust_reason)
        assert m is not None, info.trust_reason
        n, first, start = map(int, m.groups())
        assert first + n == start and 5 <= first < start <= 18, info.trust_reason
        until(lambda: s.held("node-gap", range(21)) == list(range(start, 21)), "the blocks after the gap")
        assert s.client.stats().entries == 21 - start
        until(lambda: s.trust_gauge().get("degraded") == 1.0, "kvcoord_nodes_by_trust{trust=degraded} 1")
        # The engine's own clear ends it.
        s.engine.publish(KVEventBatch(ts=time.time(), events=(AllBlocksCleared(),)))
        assert s.engine.flush()
        until(lambda: s.trust("node-gap") == "exact", "node-gap exact after the clear")
        until(lambda: s.client.stats().entries == 0, "the index emptied by the clear")


async def test_the_rule_on_the_wire() -> None:
    """How a (node, rank) enters and leaves lost history, message by message (a hand-written stream to an
    in-process coordinator): a batch or snapshot chunk with ``history_lost`` marks it, an AllBlocksCleared
    (before the mark in the same batch) or a snapshot without the mark ends it, a mismatch stays the
    reason while both apply, and a new epoch starts over. Batches without the field change nothing."""
    why = "history lost: 3 batch(es) from seq 0 are gone (test)"
    async with coordinator() as c:
        a = Agent(c, "n1")
        await a.start()

        async def batch(seq: int, events: list[pb.KVEvent], lost: str | None = None) -> None:
            await a.send(batch=pb.EventBatch(seq=seq, dp_rank=0, events=events, history_lost=lost))
            assert ack_seq(await a.recv()) == seq

        async def trust() -> tuple[str, str]:
            info = await c.node("n1")
            return info.trust, info.trust_reason

        async def matched() -> int:
            nodes = (await c.lookup_hashes(HASHES)).nodes
            return max((n.matched_blocks for n in nodes), default=0)

        async def cause() -> str:
            """The lookup answer's ``trust_cause`` of n1 (which is in it, held or not)."""
            nodes = (await c.lookup_hashes(HASHES, include_unmatched=True)).nodes
            return next(n.trust_cause for n in nodes if n.node_id == "n1")

        await batch(1, [wire_stored(HASHES, block_size=BS)])  # as an older agent sends: no field
        assert (await trust(), await matched()) == (("exact", ""), 4)
        await batch(2, [], why)  # the mark alone: entries untouched
        assert (await trust(), await matched(), await cause()) == (
            ("degraded", f"dp rank 0: {why}"), 4, "history_lost")
        await batch(3, [pb.KVEvent(cleared=pb.AllBlocksCleared())], why)  # a relay's clear, then its mark
        assert (await trust(), await matched()) == (("degraded", f"dp rank 0: {why}"), 0)
        await batch(4, [pb.KVEvent(cleared=pb.AllBlocksCleared())])  # the engine's clear
        assert await trust() == ("exact", "")
        # A snapshot carries the mark (it supersedes the batch that said so), or ends it.
        marked = pb.Snapshot(epoch=1, seq=4, dp_rank=0, final=True, history_lost=why)
        await a.send(snapshot=marked)
        assert ack_seq(await a.recv()) == 4
        assert (await trust())[0] == "degraded"
        await a.snapshot(4)
        assert await trust() == ("exact", "")
        # Both apply: the mismatch is the reason.
        await batch(5, [], why)
        bad = [h ^ 1 for h in HASHES]
        await a.send(batch=pb.EventBatch(seq=6, events=[chain(bad, sampled=True)], sampled=True))
        notice = await a.recv()
        assert notice.notice.state == "hash_mismatch" and ack_seq(await a.recv()) == 6
        assert (await trust(), await cause()) == (("degraded", notice.notice.message), "hash_mismatch")
        await a.close()
        # A new epoch (the agent or engine restarted) starts over: resyncing, then exact with its snapshot.
        b = Agent(c, "n1", epoch=2)
        assert (await b.hello()).snapshot_required
        assert await trust() == ("resyncing", "waiting for the node's snapshot")
        await b.snapshot(0)
        assert await trust() == ("exact", "")
        await b.close()


async def test_another_replica_reports_the_cause(redis_server: RedisServer) -> None:
    """Replica b holds no stream of the node: its lookups carry the owner's cause (lost history, not a
    mismatch), and a record of a replica that predates the cause reads as before (no cause)."""
    ov = {"index": redis_server.url, "index_key_prefix": f"cause-{uuid.uuid4().hex[:8]}"}
    why = "history lost: 3 batch(es) from seq 0 are gone (test)"
    async with coordinator(**ov) as a, coordinator(**ov) as b:
        n1 = Agent(a, "n1")
        await n1.start()
        await n1.send(batch=pb.EventBatch(seq=1, dp_rank=0, events=[wire_stored(HASHES, block_size=BS)],
                                          history_lost=why))
        assert ack_seq(await n1.recv()) == 1

        async def seen() -> bool:
            nodes = (await b.lookup_hashes(HASHES)).nodes
            got = [(n.node_id, n.trust, n.trust_cause) for n in nodes]
            return got == [("n1", "degraded", "history_lost")]

        await until_async(seen, timeout=15.0)
        assert (await b.node("n1")).trust_reason == f"dp rank 0: {why}"
        await n1.close()
    old = SharedNode("n1", MODEL, (0,), "active", 1, 0.0, "r", 0.0, trust="degraded", trust_reason="x",
                     trust_cause="history_lost")
    raw = json.loads(old.encode())
    assert raw["trust_cause"] == "history_lost" and SharedNode.decode(old.encode()) == old
    del raw["trust_cause"]
    assert SharedNode.decode(json.dumps(raw)).trust_cause == ""


def test_the_reason_names_three_lost_ranks_and_counts_the_rest() -> None:
    """A bad agent may mark 1024 ranks with long reasons: the reason stays short."""
    rec = NodeRecord("n1", MODEL, tuple(range(1024)), epoch=1, resyncing=False)
    assert rec.trust == ("exact", "", "")
    rec.history_lost = {r: "x" * 200 for r in reversed(range(1024))}
    trust = rec.trust
    assert (trust.state, trust.cause) == ("degraded", "history_lost")
    shown = "; ".join(f"dp rank {r}: {'x' * 200}" for r in range(3))
    assert trust.reason == shown + "; and 1021 more rank(s)"
    rec.history_lost = {5: "a", 2: "b"}
    assert rec.trust.reason == "dp rank 2: b; dp rank 5: a"
    rec.hash_mismatch, rec.hash_mismatch_reason = True, "seed"
    assert rec.trust == ("degraded", "seed", "hash_mismatch")


def _relay_malformed(s: Stack, stats: Path | None) -> dict[str, float]:
    """The relay's malformed counts by reason: the coordinator's metric of its own relays, or (``stats``)
    the agent's ``--stats-file``."""
    if stats is not None:
        try:
            return {k: float(v) for k, v in json.loads(stats.read_text())["relays"][0]["malformed"].items()}
        except (OSError, ValueError):
            return {}
    page = metrics(f"http://127.0.0.1:{s.metrics}/metrics")
    return by_label(page, "kvcoord_relay_malformed_total", "reason")


@pytest.mark.parametrize("via", ["register", "agent"])
def test_an_undecodable_batch_marks_the_node_degraded(tmp_path: Path, via: str) -> None:
    """An engine (a raw ZMQ PUB in vLLM's framing, no replay), relayed by the coordinator after ``POST
    /register`` or by ``kvcoord agent``, whose first two batches are not msgpack, then a good one: the node
    is ``degraded`` (history lost, naming the batch), the index holds the good batch, the relay counts both
    (``kvcoord_relay_malformed_total{reason="msgpack"}``, or the agent's stats file) and logs it once. Once
    the stream has started, another one clears the rank (it may have removed blocks), still without a second
    log line."""
    with stack(tmp_path, early=0) as s:
        ctx = zmq.Context()
        s.stack.callback(ctx.term)
        xpub = ctx.socket(zmq.XPUB)  # a PUB that also hears subscriptions: publish once the relay is there
        s.stack.callback(xpub.close, 0)
        port = free_port()
        xpub.bind(f"tcp://127.0.0.1:{port}")
        stats: Path | None = None
        if via == "register":
            status, answer = http_json("POST", f"http://127.0.0.1:{s.http}/register", {
                "instance_id": 9, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": MODEL,
                "block_size": BS})
            assert status == 201, answer
            relay_log = tmp_path / "serve1.log"
        else:
            stats, relay_log = tmp_path / "stats.json", tmp_path / "agent.log"
            s.stack.enter_context(running(kvcoord_cmd(
                "agent", "--coordinator", f"127.0.0.1:{s.grpc}", "--node-id", "9", "--model", MODEL,
                "--zmq-endpoint", f"tcp://127.0.0.1:{port}", "--stats-file", str(stats)), log=relay_log))
        until(lambda: xpub.poll(100) and xpub.recv().startswith(b"\x01"), "the relay's subscription")

        def send(seq: int, payload: bytes) -> None:
            xpub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

        send(0, b"\xc1 not msgpack")
        send(1, b"\xc1 nor this")
        send(2, msgspec.msgpack.encode(stored(0)))
        until(lambda: s.held("9", range(3)) == [0], "the good batch indexed")
        until(lambda: s.trust("9") == "degraded", "node 9 degraded")
        info = s.node("9")
        assert info is not None and info.trust_cause == "history_lost", info
        assert info.trust_reason == ("dp rank 0: history lost: 1 batch(es) from seq 1 are gone "
                                     "(batch 1 is malformed (msgpack))"), info
        assert s.client.stats().entries == 1  # kept: nothing was applied before the bad batches
        until(lambda: _relay_malformed(s, stats).get("msgpack") == 2.0, "the relay counting 2")
        assert s.trust_gauge()["degraded"] == 1.0 and s.trust_gauge()["exact"] == 0.0

        send(3, b"\xc1 and not this")  # after the stream started: the rank is cleared
        until(lambda: _relay_malformed(s, stats).get("msgpack") == 3.0, "the relay counting 3")
        until(lambda: s.client.stats().entries == 0, "the rank cleared")
        assert s.trust("9") == "degraded"
        lines = [ln for ln in relay_log.read_text().splitlines() if "kvcoord.engine.relay" in ln]
        assert len(lines) == 1 and "skipping malformed KV event batch (msgpack" in lines[0], lines
        log = (tmp_path / "serve1.log").read_text().splitlines()
        assert len([ln for ln in log if "kvcoord.coordinator: node 9 dp rank 0: degraded" in ln]) == 1, log
