"""Engines' gRPC event streams (issue 25, item 3): a ``SubscribeKvEvents`` publisher built on
``smg-grpc-proto``'s stubs (:mod:`tests.smg_publisher`), over real gRPC, feeds ``kvcoord serve`` through
``kvcoord agent --grpc-endpoint`` and through ``POST /register {"grpc_endpoint": ...}``.

Lookups then find exactly the blocks the engine holds, on their tiers, through stores, an eviction, a gap
healed by resuming the stream, a gap nobody can fill (the node ``degraded`` until the engine clears), a
malformed batch (counted, logged once, degraded), an engine restart (new sequence numbers) and a resync by
snapshot chunks after ``OUT_OF_RANGE``; the engine's load (``KvEventBatch.load``) is in lookup answers and
``ListNodes``, with no metrics URL. An engine nobody serves is retried, and the agent still stops at once on
SIGTERM; bad flags and bad registrations get one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as pb

from kvcoord.engine.grpc_relay import GrpcRelay
from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_smg_batch,
    stored_tokens,
    to_model,
)
from kvcoord.router.client import CoordinatorClient, NodeStatus
from tests.coordinator.test_history_lost import MODEL, SPEC, block, tokens
from tests.http_util import http_json, http_request, metrics, sample
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port
from tests.smg_publisher import Engine, cleared_event, int64, removed_event, stored_event

HOST, DISK = pb.KV_CACHE_TIER_HOST, pb.KV_CACHE_TIER_DISK
TIER_NAMES = ("GPU", "CPU", "STORAGE")


def store(i: int, *, tier: int = 0, medium: str | None = None) -> pb.KvCacheEvent:
    """Block ``i`` of the shared test chain (hashed as the coordinator verifies), as SGLang publishes it."""
    return stored_event([(int64(block(i)), tokens(i))], tier=tier, medium=medium)


class GrpcStack:
    """The gRPC engine (in this process), ``kvcoord serve``, and the agent when asked."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.tmp, self.stack = tmp, stack
        self.port, self.grpc, self.metrics, self.http = (free_port() for _ in range(4))
        self.engine = Engine(self.port).serve()
        stack.callback(self.engine.close)
        self.serve = stack.enter_context(running(kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{self.grpc}", "--metrics-listen", f"127.0.0.1:{self.metrics}",
            "--http-listen", f"127.0.0.1:{self.http}", "--model", SPEC), log=tmp / "serve.log"))
        wait_for_port(self.grpc)
        wait_for_port(self.http)
        self.client = stack.enter_context(CoordinatorClient(f"127.0.0.1:{self.grpc}", timeout=10.0))
        self.log = tmp / "serve.log"

    def start_agent(self, node: str) -> None:
        self.log = self.tmp / "agent.log"
        self.stack.enter_context(running(kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{self.grpc}", "--node-id", node, "--model", MODEL,
            "--grpc-endpoint", f"127.0.0.1:{self.port}"), log=self.log))

    def register(self, body: dict[str, object]) -> tuple[int, str]:
        reply = http_request("POST", f"http://127.0.0.1:{self.http}/register", body)
        return reply.status, reply.text

    def node(self, node: str) -> NodeStatus | None:
        return next((n for n in self.client.list_nodes() if n.node_id == node), None)

    def trust(self, node: str) -> str | None:
        n = self.node(node)
        return n.trust if n is not None else None

    def held(self, node: str) -> dict[int, str]:
        """Block -> its tier, for every block of the chain the index holds for ``node``."""
        out = {}
        for i in range(16):
            for n in self.client.lookup(MODEL, hashes=[block(i)]).nodes:
                if n.node_id == node and n.matched_blocks == 1:
                    out[i] = TIER_NAMES[n.tiers.index(1)]
        return out

    def expect(self, node: str, held: dict[int, str], trust: str, what: str) -> None:
        """The index holds exactly ``held`` for ``node``, whose trust is ``trust``."""
        until(lambda: self.held(node) == held and self.trust(node) == trust, what)
        assert self.client.stats().entries == len(held), what

    def malformed_total(self) -> float:
        return sample(metrics(f"http://127.0.0.1:{self.metrics}/metrics"), "kvcoord_relay_malformed_total")


@contextlib.contextmanager
def grpc_stack(tmp: Path) -> Iterator[GrpcStack]:
    with contextlib.ExitStack() as es:
        yield GrpcStack(tmp, es)


@pytest.mark.parametrize("via", ["agent", "register"])
def test_a_grpc_stream_feeds_exact_lookups_through_gaps_restarts_and_snapshots(tmp_path: Path,
                                                                               via: str) -> None:
    with grpc_stack(tmp_path) as s:
        e = s.engine
        if via == "agent":
            node = "grpc-node"
            s.start_agent(node)
        else:
            node = "7"
            body = {"instance_id": 7, "grpc_endpoint": f"127.0.0.1:{s.port}", "model_name": MODEL,
                    "block_size": 4}
            assert s.register(body)[0] == 201
        until(lambda: e.subscriptions, "a subscription")
        assert e.subscriptions[0] == 0  # from the current state

        # Stores on three tiers (a tier enum, a medium name, neither), with the engine's load.
        e.load = pb.EngineLoad(running_requests=3, waiting_requests=2, token_usage=0.25)
        e.publish(store(0), store(1, tier=HOST), store(2, medium="DISK"))
        s.expect(node, {0: "GPU", 1: "CPU", 2: "STORAGE"}, "exact", "three blocks on their tiers")
        def loaded() -> bool:
            return any(n.load.running_requests == 3 for n in s.client.lookup(MODEL, hashes=[block(0)]).nodes)

        until(loaded, "the engine's load in lookup answers")
        (answer,) = s.client.lookup(MODEL, hashes=[block(0)]).nodes
        load = answer.load
        assert (load.running_requests, load.waiting_requests, load.kv_usage) == (3, 2, 0.25)
        status = s.node(node)
        assert status is not None and status.load.waiting_requests == 2

        # An eviction.
        e.publish(removed_event([int64(block(1))], tier=HOST))
        s.expect(node, {0: "GPU", 2: "STORAGE"}, "exact", "block 1 evicted")

        # A batch dropped on the stream: the relay resumes from its last sequence and the engine resends it.
        gap = e.next_seq
        e.drop.add(gap)
        e.publish(store(3))
        e.publish(store(4, tier=DISK))
        s.expect(node, {0: "GPU", 2: "STORAGE", 3: "GPU", 4: "STORAGE"}, "exact", "the gap healed")
        assert gap - 1 in e.subscriptions[1:], e.subscriptions

        # A batch nobody can resend: the rank is cleared and degraded until the engine clears its cache.
        e.forgotten.add(e.next_seq)
        e.publish(store(5))
        e.publish(store(6))
        s.expect(node, {6: "GPU"}, "degraded", "an unrecoverable gap")
        status = s.node(node)
        assert status is not None and status.trust_cause == "history_lost", status
        e.publish(cleared_event(), store(7))
        s.expect(node, {7: "GPU"}, "exact", "exact again after the engine's clear")

        # A malformed batch (an event of no kind): counted, logged once, degraded; never dropped silently.
        e.publish_raw(pb.KvEventBatch(timestamp=time.time(), events=[pb.KvCacheEvent(event_id=1)], dp_rank=0))
        e.publish(store(8))
        s.expect(node, {8: "GPU"}, "degraded", "a malformed batch")
        until(lambda: s.log.read_text().count("skipping malformed KV event batch (event;") == 1,
              "the malformed batch logged once")
        if via == "register":
            assert s.malformed_total() == 1.0
        e.publish(cleared_event(), store(9))
        s.expect(node, {9: "GPU"}, "exact", "exact again after the engine's clear")

        # The engine restarts (its stream ends; new sequence numbers from 0): the old blocks go.
        e.restart()
        e.publish(store(10))
        e.publish(store(11, tier=HOST))
        s.expect(node, {10: "GPU", 11: "CPU"}, "exact", "the restarted engine's blocks only")

        # The server cannot resume the stream (OUT_OF_RANGE): resync from its snapshot chunks.
        e.snapshot = True
        e.publish(store(12))
        e.end_streams(grpc.StatusCode.OUT_OF_RANGE)
        s.expect(node, {10: "GPU", 11: "CPU", 12: "GPU"}, "exact", "the snapshot applied")
        assert e.subscriptions[-1] == 0


def test_an_unreachable_engine_is_retried_and_the_agent_stops_at_once(tmp_path: Path) -> None:
    with grpc_stack(tmp_path) as s:
        e = s.engine
        e.close()  # nothing serves the port yet
        s.start_agent("late")
        until(lambda: "KV event stream failed (UNAVAILABLE" in s.log.read_text(), "the failure logged")
        e2 = Engine(s.port).serve()
        try:
            e2.publish(store(0))
            s.expect("late", {0: "GPU"}, "exact", "relayed once the engine is up")
            assert s.log.read_text().count("KV event stream failed") == 1  # once per outage
        finally:
            e2.close()
    lone = Engine(free_port())  # not served: nothing answers
    log = tmp_path / "lone.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(kvcoord_cmd("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n",
                                            "--model", "m", "--grpc-endpoint", f"127.0.0.1:{lone.port}"),
                                stderr=err)
    try:
        # Stopped while retrying (its handlers are installed by then; a loaded machine takes seconds).
        until(lambda: "KV event stream failed" in log.read_text(), "the agent to retry the engine")
        t0 = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5.0  # at once: it ends within the retry's backoff, not after it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("flags", "message"), [
    (["--grpc-endpoint", "nope"], "invalid gRPC endpoint `nope`: missing TCP port"),
    (["--grpc-endpoint", "127.0.0.1:1", "--zmq-endpoint", "tcp://127.0.0.1:2"], "drop --zmq-endpoint"),
    (["--grpc-endpoint", "127.0.0.1:1", "--replay-endpoint", "tcp://127.0.0.1:2"], "drop --replay-endpoint"),
    (["--grpc-endpoint", "127.0.0.1:1", "--no-kv-events"], "drop --no-kv-events"),
    (["--grpc-endpoint", "127.0.0.1:1", "--dp-ranks", "0,1"], "carries one DP rank's sequence"),
])
def test_bad_grpc_flags_stop_the_agent_with_one_line(flags: list[str], message: str) -> None:
    out = subprocess.run(kvcoord_cmd("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model",
                                     "m", *flags), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


def test_bad_grpc_registrations_are_refused_with_one_line(tmp_path: Path) -> None:
    with grpc_stack(tmp_path) as s:
        base = {"instance_id": 3, "model_name": MODEL, "block_size": 4}
        status, body = s.register({**base, "grpc_endpoint": "nope"})
        assert status == 400 and "invalid gRPC endpoint `nope`" in body, body
        status, body = s.register({**base, "grpc_endpoint": "127.0.0.1:5", "endpoint": "tcp://127.0.0.1:6"})
        assert status == 400 and "without endpoint and replay_endpoint" in body, body
        status, body = s.register(base)
        assert status == 422 and "missing required field `endpoint`" in body, body
        assert s.register({**base, "grpc_endpoint": f"127.0.0.1:{s.port}"})[0] == 201
        status, workers = http_json("GET", f"http://127.0.0.1:{s.http}/workers")
        assert status == 200, workers
        (worker,) = workers
        assert (worker["source"], worker["endpoints"]) == ("grpc", {"0": f"grpc://127.0.0.1:{s.port}"})


class RecordingSink:
    """A real consumer: what the relay forwards, and the ranks it marks."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.lost: list[tuple[int, str]] = []

    def submit(self, dp_rank: int, events: Sequence[Any], ts: float | None = None,
               ops: Sequence[Any] | None = None, spans: Sequence[int] | None = None) -> None:
        self.batches.append((dp_rank, len(events)))

    def history_lost(self, dp_rank: int, reason: str) -> None:
        self.lost.append((dp_rank, reason))


def raw_server(port: int, messages: list[bytes]) -> grpc.Server:
    """A server whose SubscribeKvEvents sends ``messages`` as they are (bytes that may not parse); idles."""
    def subscribe(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from messages
        while context.is_active():
            time.sleep(0.05)

    handler = grpc.method_handlers_generic_handler("sglang.grpc.scheduler.SglangScheduler", {
        "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(subscribe)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_garbage_heartbeats_and_partial_snapshots_on_the_wire(tmp_path: Path) -> None:
    """What does not parse is a malformed batch (counted, lost history); a load-only heartbeat repeating the
    last sequence only updates the load; a snapshot that lacks the engine's early batches is marked."""
    def batch(seq: int, *events: pb.KvCacheEvent, **kw: Any) -> bytes:
        out: bytes = pb.KvEventBatch(sequence_number=seq, timestamp=1.0, events=events, dp_rank=0,
                                     **kw).SerializeToString()
        return out

    heartbeat = pb.EngineLoad(running_requests=5, waiting_requests=1, token_usage=0.5, load_only=True)
    messages = [
        batch(0, stored_event([(10, [1, 2])]), load=pb.EngineLoad(running_requests=1)),
        batch(0, load=heartbeat),
        b"\xff\xff\xff not a protobuf",
        batch(2, stored_event([(20, [3, 4])])),
        batch(3, cleared_event(), stored_event([(30, [5, 6])]),
              snapshot=pb.KvSnapshotChunk(index=0, count=1, blocks=1, unknown_before=4)),
    ]
    port = free_port()
    server = raw_server(port, messages)
    sink = RecordingSink()
    relay = GrpcRelay(f"127.0.0.1:{port}", sink, allowed_ranks={0})
    loads = []

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        deadline = time.monotonic() + 30
        while relay.stats.snapshot_chunks < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        loads.append(relay.load())
        stop.set()
        await asyncio.wait_for(task, 5)

    try:
        asyncio.run(run())
    finally:
        server.stop(None).wait(5)
    assert [h for h, _ in relay.mirror.rank_entries(0)] == [30]
    assert dict(relay.stats.malformed) == {"protobuf": 1}
    assert (relay.stats.restarts, relay.stats.gaps, relay.stats.snapshot_chunks) == (0, 0, 1)
    assert len(sink.lost) == 2 and "malformed (protobuf)" in sink.lost[0][1], sink.lost
    assert "snapshot lacks its first 4 batch(es)" in sink.lost[1][1], sink.lost
    assert [(x.running_requests, x.waiting_requests, x.kv_usage) for x in loads] == [(5, 1, 0.5)]


def test_the_decoder_maps_every_field_of_a_grpc_batch() -> None:
    """``decode_smg_batch``: int64 hashes as their uint64, tiers as medium names, the store's fields, the
    blocks' token ids (read when asked for) and extra keys; a batch it cannot map is an EventDecodeError."""
    blocks = [pb.KvBlock(block_hash=-2, token_ids=[1, 2], block_size=2, lora_id=7,
                         extra_keys=[pb.KvBlockExtraKey(text="a"), pb.KvBlockExtraKey(
                             multimodal=pb.KvMultimodalKey(identifier="img", offset=3))]),
              pb.KvBlock(block_hash=5, token_ids=[3, 4], block_size=2)]
    stored = pb.KvBlocksStored(blocks=blocks, parent_block_hash=-1, tier=pb.KV_CACHE_TIER_EXTERNAL,
                               group_idx=1, kv_cache_spec_kind="full_attention", lora_name="ad",
                               cache_salt="salt", session_id="s", locality=pb.KV_CACHE_LOCALITY_REMOTE)
    msg = pb.KvEventBatch(sequence_number=9, timestamp=2.5, dp_rank=3, events=[
        pb.KvCacheEvent(stored=stored),
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[5], medium="CPU_PINNED")),
        pb.KvCacheEvent(cleared=pb.KvCacheCleared())])
    batch = decode_smg_batch(msg)
    assert (batch.ts, batch.data_parallel_rank) == (2.5, 3)
    st, rm, cl = (to_model(ev) for ev in batch.events)
    assert st == BlockStored(block_hashes=((1 << 64) - 2, 5), parent_block_hash=(1 << 64) - 1,
                             token_ids=(1, 2, 3, 4), block_size=2, lora_id=7, medium="EXTERNAL",
                             lora_name="ad", extra_keys=(("a", ("img", 3)), None), group_idx=1,
                             kv_cache_spec_kind="full_attention", locality="remote", session_id="s",
                             cache_salt="salt")
    assert rm == BlockRemoved(block_hashes=(5,), medium="CPU_PINNED")
    assert cl == AllBlocksCleared()
    assert stored_tokens(batch.events[0]) == (1, 2, 3, 4)
    bad = pb.KvEventBatch(events=[pb.KvCacheEvent(stored=pb.KvBlocksStored(blocks=[
        pb.KvBlock(block_hash=1, block_size=2), pb.KvBlock(block_hash=2, block_size=4)]))])
    with pytest.raises(EventDecodeError) as err:
        decode_smg_batch(bad)
    assert err.value.kind == "block_size"
