"""The coordinator in-process over real gRPC: ingest ordering, snapshots, leases, auth, bad input, lookup.

Every test talks to a real ``CoordinatorServer`` through the generated stubs, against the ``index``
fixture (every backend), and checks the index itself where a rule says "nothing applied".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.outbox import Outbox
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.events import BlockStored, Tier
from kvcoord.hashing import HashProfile
from kvcoord.index.base import Index
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.validate import ops_of, pack_u64
from kvcoord.wire import Sample, TokenSampler, event_to_proto, pack_tokens
from tests.procs import FIXTURES

MODEL = "m"
QWEN = "Qwen/Qwen3-0.6B"
TIMEOUT = 5.0


@dataclass
class Coord:
    server: CoordinatorServer
    channel: grpc.aio.Channel
    stub: pbg.CoordinatorStub
    index: Index

    async def lookup_hashes(self, hashes: Sequence[int], model: str = MODEL, **kw: Any) -> pb.LookupResponse:
        metadata = kw.pop("metadata", None)
        req = pb.LookupRequest(model=model, hashes=pb.HashQuery(block_hashes=P(hashes)), **kw)
        return await self.stub.Lookup(req, timeout=TIMEOUT, metadata=metadata)

    async def stats(self, metadata: Any = None) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT, metadata=metadata)

    async def node(self, node_id: str) -> pb.NodeInfo:
        resp = await self.stub.ListNodes(pb.ListNodesRequest(), timeout=TIMEOUT)
        return next(n for n in resp.nodes if n.node_id == node_id)


@contextlib.asynccontextmanager
async def serving(
    index: Index, toml: str | None = None, tmp_path: Any = None, **overrides: Any
) -> AsyncIterator[Coord]:
    path = None
    if toml is not None:
        path = tmp_path / "kvcoord.toml"
        path.write_text(toml)
    ov: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "", **overrides}
    ov.setdefault("models", [f"{MODEL},algo=sha256_cbor,block_size=4,seed=42"])
    cfg = load_config(path, env={}, overrides=ov)
    server = CoordinatorServer(cfg, index=index)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield Coord(server, channel, pbg.CoordinatorStub(channel), index)
    finally:
        await channel.close()
        await server.stop()


BAD_TIER = 7
"""A tier number no build knows: what an agent that sent garbage would put on the wire."""
TIERS = {"": 0, "GPU": 0, "CPU": 1, "DISK": 2, "STORAGE": 2}


def P(hashes: Sequence[int]) -> bytes:
    """Hashes packed as the wire carries them."""
    return pack_u64(hashes)


def stored(
    hashes: Sequence[int],
    parent: int | None = None,
    medium: str = "",
    block_size: int = 4,
    tokens: Sequence[int] = (),
) -> pb.KVEvent:
    """A wire BlockStored; an unknown ``medium`` becomes an unknown tier number (agents normalise)."""
    s = pb.BlockStored(block_hashes=P(hashes), block_size=block_size,
                       tier=TIERS.get(medium.upper(), BAD_TIER))  # type: ignore[arg-type]
    if tokens:
        s.token_ids = pack_tokens(tokens)
    if parent is not None:
        s.parent_block_hash = parent
    return pb.KVEvent(stored=s)


def removed(hashes: Sequence[int], medium: str = "") -> pb.KVEvent:
    tier = TIERS.get(medium.upper(), BAD_TIER)
    return pb.KVEvent(removed=pb.BlockRemoved(block_hashes=P(hashes), tier=tier))  # type: ignore[arg-type]


def sampled(events: Sequence[pb.KVEvent]) -> bool:
    return any(e.WhichOneof("event") == "stored" and e.stored.token_ids for e in events)


class Agent:
    """A hand-driven ingest stream, so each test controls every message."""

    def __init__(
        self,
        coord: Coord,
        node: str = "n1",
        *,
        epoch: int = 1,
        ranks: Sequence[int] = (0,),
        model: str = MODEL,
        token: str | None = None,
    ) -> None:
        self.node, self.epoch, self.ranks, self.model = node, epoch, list(ranks), model
        md = (("authorization", f"Bearer {token}"),) if token else None
        self.call = coord.stub.Ingest(metadata=md)

    async def send(self, **msg: Any) -> None:
        """Write one message. A stream the coordinator already ended refuses the write: that is not an
        error here, the test reads the status with :meth:`aborted` (or the next read raises it)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.call.write(pb.AgentMessage(**msg))

    async def recv(self) -> pb.CoordinatorMessage:
        msg = await asyncio.wait_for(self.call.read(), TIMEOUT)
        assert msg is not grpc.aio.EOF, "stream ended"
        return msg

    async def hello(self, next_seq: int = 1, profile: pb.HashProfile | None = None, *,
                    no_kv_events: bool = False) -> pb.Welcome:
        h = pb.Hello(
            node_id=self.node, model=self.model, dp_ranks=self.ranks, epoch=self.epoch, next_seq=next_seq,
            no_kv_events=no_kv_events,
        )
        if profile is not None:
            h.hash_profile.CopyFrom(profile)
        await self.send(hello=h)
        msg = await self.recv()
        assert msg.WhichOneof("msg") == "welcome", msg
        return msg.welcome

    async def batch(self, seq: int, events: Sequence[pb.KVEvent], rank: int = 0) -> pb.CoordinatorMessage:
        await self.send(batch=pb.EventBatch(seq=seq, dp_rank=rank, events=list(events), ts=time.time(),
                                            sampled=sampled(events)))
        return await self.recv()

    async def snapshot(
        self, seq: int, per_rank: dict[int, Sequence[tuple[int, int]]] | None = None
    ) -> pb.Ack:
        per_rank = per_rank or {}
        ranks = list(per_rank) or [self.ranks[0]]
        for i, rank in enumerate(ranks):
            entries = per_rank.get(rank, ())
            await self.send(
                snapshot=pb.Snapshot(
                    epoch=self.epoch,
                    seq=seq,
                    dp_rank=rank,
                    block_hashes=P([h for h, _ in entries]),
                    tiers=bytes(t for _, t in entries),
                    final=i == len(ranks) - 1,
                )
            )
        msg = await self.recv()
        assert msg.WhichOneof("msg") == "ack", msg
        assert msg.ack.seq == seq
        return msg.ack

    async def start(self, next_seq: int = 1) -> None:
        """Hello and an empty snapshot: the node is live with nothing cached."""
        welcome = await self.hello(next_seq)
        assert welcome.snapshot_required
        await self.snapshot(next_seq - 1)

    async def aborted(self) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            for _ in range(10):
                await asyncio.wait_for(self.call.read(), TIMEOUT)
        return info.value

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call.done_writing()
        self.call.cancel()


def ack_seq(msg: pb.CoordinatorMessage) -> int:
    assert msg.WhichOneof("msg") == "ack", msg
    return int(msg.ack.seq)


async def until(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await pred():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.02)


async def export(index: Index, node: str = "n1", rank: int = 0, model: str = MODEL) -> list[tuple[int, Tier]]:
    return [(int(h), Tier(t)) for h, t in await index.export_node(model, node, rank)]


# --- ordering ---------------------------------------------------------------------------------
@pytest.mark.slow
async def test_hello_batches_ack_and_lookup(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        welcome = await a.hello()
        assert welcome.snapshot_required and welcome.epoch == 1 and welcome.lease_seconds == 10
        await a.snapshot(0)
        assert ack_seq(await a.batch(1, [stored([1, 2, 3])])) == 1
        assert ack_seq(await a.batch(2, [removed([3]), stored([4], parent=2, medium="CPU")])) == 2
        resp = await c.lookup_hashes([1, 2, 4, 9])
        assert resp.num_blocks == 4 and resp.block_size == 4
        assert [(n.node_id, n.matched_blocks, n.tiers.gpu, n.tiers.cpu) for n in resp.nodes] == [
            ("n1", 3, 2, 1)
        ]
        stats = await c.stats()
        assert stats.events_applied == {"block_stored": 2, "block_removed": 1}
        assert stats.nodes[0].state == "active" and stats.nodes[0].last_seq == 2
        await a.close()


async def test_acks_queued_together_go_out_as_one() -> None:
    """Acks are cumulative: ten queued before the stream's writer runs are one Ack write (of the last seq);
    another message keeps its place among them; drain() writes at once whatever is queued."""

    class Written:  # what a gRPC servicer context is to the outbox: something that writes
        def __init__(self) -> None:
            self.out: list[pb.CoordinatorMessage] = []

        async def write(self, msg: pb.CoordinatorMessage) -> None:
            self.out.append(msg)

    ctx = Written()
    box = Outbox(ctx, ack_interval=0.0)  # type: ignore[arg-type]
    for seq in range(1, 11):
        box.ack(1, seq)
    box.put(pb.CoordinatorMessage(snapshot_request=pb.SnapshotRequest(epoch=1, reason="gap")))
    box.ack(1, 11)
    box.ack(1, 12)
    await box.drain()
    assert [m.WhichOneof("msg") for m in ctx.out] == ["ack", "snapshot_request", "ack"]
    assert [m.ack.seq for m in ctx.out if m.HasField("ack")] == [10, 12]
    box.ack(1, 13)
    slow = Outbox(ctx, ack_interval=3600.0)  # type: ignore[arg-type]
    slow.ack(1, 14)
    await slow.drain()  # not an hour: drain flushes
    assert ctx.out[-1].ack.seq == 14
    slow.ack(1, 15)
    while not slow._flush.waiting:  # until the writer waits out the hour
        await asyncio.sleep(0)
    await asyncio.wait_for(slow.drain(), 60)  # cut short by drain
    assert ctx.out[-1].ack.seq == 15
    box.close()
    slow.close()


async def test_duplicate_is_dropped_and_reacked(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        assert ack_seq(await a.batch(2, [stored([3])])) == 2
        assert ack_seq(await a.batch(1, [stored([99])])) == 2  # duplicate: re-ack last, not applied
        assert await export(index) == [(1, Tier.GPU), (2, Tier.GPU), (3, Tier.GPU)]
        await a.close()


async def test_gap_requests_snapshot_then_snapshot_replaces(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        msg = await a.batch(3, [stored([5])])
        assert msg.WhichOneof("msg") == "snapshot_request"
        assert (
            msg.snapshot_request.reason.startswith("gap") and "expected seq 2" in msg.snapshot_request.reason
        )
        assert (await c.lookup_hashes([1, 2])).nodes == []  # resyncing: not served
        assert (await c.node("n1")).state == "resyncing"
        await a.send(batch=pb.EventBatch(seq=4, events=[stored([6])]))  # discarded until the snapshot
        await a.snapshot(4, {0: [(7, Tier.GPU), (8, Tier.CPU)]})
        assert await export(index) == [(7, Tier.GPU), (8, Tier.CPU)]
        assert ack_seq(await a.batch(4, [stored([66])])) == 4  # superseded by the snapshot
        assert ack_seq(await a.batch(5, [stored([9], parent=8)])) == 5
        assert [n.matched_blocks for n in (await c.lookup_hashes([7, 8])).nodes] == [2]
        assert (await c.stats()).snapshots_requested >= 2  # hello + gap
        await a.close()


async def test_snapshot_chunks_over_ranks_and_absent_rank_emptied(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c, ranks=(0, 1, 2))
        await a.start()
        assert ack_seq(await a.batch(1, [stored([20, 21])], rank=2)) == 1
        assert await export(index, rank=2) == [(20, Tier.GPU), (21, Tier.GPU)]
        # A resync snapshot in three chunks; rank 2 is absent from it and must end up empty.
        await a.send(snapshot=pb.Snapshot(epoch=1, seq=1, dp_rank=0, block_hashes=P([1, 2]), final=False))
        await a.send(
            snapshot=pb.Snapshot(epoch=1, seq=1, dp_rank=0, block_hashes=P([3]),
                                 tiers=bytes([pb.TIER_STORAGE]))
        )
        await a.send(
            snapshot=pb.Snapshot(
                epoch=1, seq=1, dp_rank=1, block_hashes=P([10]), tiers=bytes([pb.TIER_CPU]), final=True
            )
        )
        assert ack_seq(await a.recv()) == 1
        assert await export(index, rank=0) == [(1, Tier.GPU), (2, Tier.GPU), (3, Tier.STORAGE)]
        assert await export(index, rank=1) == [(10, Tier.CPU)]
        assert await export(index, rank=2) == []
        await a.close()


async def test_reconnect_same_epoch_resumes_else_snapshot(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1])])) == 1
        assert ack_seq(await a.batch(2, [stored([2], parent=1)])) == 2
        await a.close()
        b = Agent(c)
        welcome = await b.hello(next_seq=3)
        assert not welcome.snapshot_required and welcome.acked_seq == 2
        assert ack_seq(await b.batch(3, [stored([3], parent=2)])) == 3
        await b.close()
        # The agent lost batches 4..5 (its next is 6): it cannot resend them, so a snapshot is required.
        d = Agent(c)
        welcome = await d.hello(next_seq=6)
        assert welcome.snapshot_required and welcome.acked_seq == 0
        await d.close()


async def test_new_epoch_requires_snapshot_that_replaces_entries(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c, epoch=1)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2, 3])])) == 1
        b = Agent(c, epoch=2)  # the agent restarted
        welcome = await b.hello()
        assert welcome.snapshot_required and welcome.epoch == 2
        assert (await c.lookup_hashes([1])).nodes == []  # old-epoch entries are not served
        await a.send(batch=pb.EventBatch(seq=2, events=[stored([50])]))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.ABORTED and "superseded" in (err.details() or "")
        await b.snapshot(0, {0: [(5, Tier.GPU)]})
        assert await export(index) == [(5, Tier.GPU)]
        assert ack_seq(await b.batch(1, [stored([6], parent=5)])) == 1
        assert [n.matched_blocks for n in (await c.lookup_hashes([5, 6])).nodes] == [2]
        await b.close()


# --- leases -----------------------------------------------------------------------------------
@pytest.mark.slow
async def test_lease_expiry_hides_node_at_once_and_reclaims(index: Index) -> None:
    async with serving(index, lease_seconds=0.4) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        keep = Agent(c, "n2")
        await keep.start()
        assert ack_seq(await keep.batch(1, [stored([1])])) == 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.8:  # n2 heartbeats (stream and unary), n1 stays silent
            await keep.send(heartbeat=pb.AgentHeartbeat(load=pb.Load(running_requests=3)))
            hb = await c.stub.Heartbeat(pb.HeartbeatRequest(node_id="n2", epoch=1), timeout=TIMEOUT)
            assert hb.known
            await asyncio.sleep(0.05)
        resp = await c.lookup_hashes([1, 2])
        assert [(n.node_id, n.load.running_requests) for n in resp.nodes] == [("n2", 3)]

        async def reclaimed() -> bool:
            return await export(index) == []

        await until(reclaimed)
        info = await c.node("n1")
        assert info.state == "expired"
        stats = await c.stats()
        assert stats.leases_expired == 1 and stats.nodes_by_state["expired"] == 1
        hb = await c.stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=1), timeout=TIMEOUT)
        assert not hb.known
        await a.send(batch=pb.EventBatch(seq=2, events=[stored([3])]))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.ABORTED and "expired" in (err.details() or "")
        assert await export(index) == []
        # It comes back only through a new hello and a snapshot.
        b = Agent(c)
        welcome = await b.hello(next_seq=2)
        assert welcome.snapshot_required
        await b.snapshot(1, {0: [(1, Tier.GPU)]})
        assert {n.node_id for n in (await c.lookup_hashes([1])).nodes} == {"n1", "n2"}
        await b.close()
        await keep.close()


# --- bad input: clear status AND index unchanged ----------------------------------------------
async def test_invalid_batch_is_rejected_and_snapshot_requested(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1])])) == 1
        msg = await a.batch(2, [stored([2]), stored([3], medium="FLOPPY")])
        assert msg.WhichOneof("msg") == "snapshot_request" and "invalid_event" in msg.snapshot_request.reason
        assert await export(index) == [(1, Tier.GPU)]
        # Ragged packed hashes (not a multiple of 8 bytes).
        bad = pb.KVEvent(stored=pb.BlockStored(block_hashes=b"\x04\x00\x00", block_size=4))
        await a.snapshot(1, {0: [(1, Tier.GPU)]})
        msg = await a.batch(2, [bad])
        assert msg.WhichOneof("msg") == "snapshot_request"
        assert "not a multiple of 8" in msg.snapshot_request.reason
        assert await export(index) == [(1, Tier.GPU)]
        stats = await c.stats()
        assert stats.events_rejected["invalid_event"] == 3
        await a.snapshot(1, {0: [(1, Tier.GPU)]})  # the stream stayed up and recovers
        assert ack_seq(await a.batch(2, [stored([2], parent=1)])) == 2
        await a.close()


async def test_events_before_hello_fail_precondition(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.send(batch=pb.EventBatch(seq=1, events=[stored([1])]))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "before Hello" in (err.details() or "")
        assert (await index.stats()).entries == 0 and len((await c.stats()).nodes) == 0


async def test_batch_over_max_events_is_invalid_argument(index: Index) -> None:
    async with serving(index, max_events_per_batch=3) as c:
        a = Agent(c)
        await a.start()
        await a.send(batch=pb.EventBatch(seq=1, events=[stored([i]) for i in range(1, 5)]))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_events_per_batch" in (
            err.details() or ""
        )
        assert await export(index) == []
        # The node lacks that batch now: it must resync (a snapshot), not be sent the batch again.
        assert (await c.node("n1")).state == "resyncing"


async def test_oversized_message_is_resource_exhausted(index: Index) -> None:
    async with serving(index, max_message_bytes=64 * 1024) as c:
        a = Agent(c)
        await a.start()
        await a.send(
            batch=pb.EventBatch(seq=1, events=[stored([2**63 + i for i in range(20_000)])])
        )  # ~200 KB
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await export(index) == []


async def test_malformed_messages_are_invalid_argument(index: Index) -> None:
    async with serving(index) as c:
        raw_stream = c.channel.stream_stream("/kvcoord.v2.Coordinator/Ingest")
        call = raw_stream()
        await call.write(b"\x0a\xff\xff\xff")  # field 1, length-delimited, truncated
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed AgentMessage" in (info.value.details() or "")
        raw_unary = c.channel.unary_unary("/kvcoord.v2.Coordinator/Lookup")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_unary(b"\x12\x05\x0a", timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await index.stats()).entries == 0 and len((await c.stats()).nodes) == 0


async def test_unusable_sample_is_invalid_argument_before_anything_is_applied(index: Index) -> None:
    """Issue 23: a sampled batch whose stored event has no hashes but 32 bytes of digests ended the stream
    UNKNOWN (a division by zero) after the batch was applied. Now the samples are read first: each
    unusable one ends the stream with INVALID_ARGUMENT and leaves the index as it was."""
    no_hashes = pb.BlockStored(block_size=16, block_digests=b"d" * 32)
    deep_keys = pb.BlockStored(block_hashes=P([7]), block_size=4, token_ids=pack_tokens([1, 2, 3, 4]),
                               extra_keys_msgpack=b"\x91" * 100_000 + b"\xc0")
    cases = [(no_hashes, "block_digests"), (deep_keys, "extra_keys_msgpack"),
             (pb.BlockStored(block_hashes=P([7, 8]), block_size=4, token_ids=pack_tokens(range(8)),
                             block_digests=b"d" * 3), "block_digests"),
             (pb.BlockStored(block_hashes=P([7]), block_size=0, token_ids=pack_tokens([1])), "token_ids")]
    async with serving(index) as c:
        for event, words in cases:
            a = Agent(c)
            await a.hello()
            await a.snapshot(0, {0: [(1, Tier.GPU)]})
            assert ack_seq(await a.batch(1, [stored([2], parent=1)])) == 1
            before = await export(index)
            await a.send(batch=pb.EventBatch(seq=2, events=[stored([3], parent=2), pb.KVEvent(stored=event)],
                                             sampled=True))
            err = await a.aborted()
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "unusable verification sample" in (err.details() or "") and words in (err.details() or "")
            assert await export(index) == before == [(1, Tier.GPU), (2, Tier.GPU)]
            assert (await c.node("n1")).state == "resyncing"  # it lacks the batch: a snapshot follows
            await a.close()


async def test_unknown_model_when_strict(index: Index) -> None:
    async with serving(index, strict_models=True) as c:
        a = Agent(c, model="other")
        await a.send(hello=pb.Hello(node_id="n1", model="other", epoch=1))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'other'" in (err.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.lookup_hashes([1], model="other")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await index.stats()).entries == 0 and len((await c.stats()).nodes) == 0


async def test_bad_snapshots_abort_and_apply_nothing(index: Index) -> None:
    async with serving(index) as c:
        cases = [
            (pb.Snapshot(epoch=9, seq=0, dp_rank=0, block_hashes=P([1]), final=True), "epoch"),
            (pb.Snapshot(epoch=1, seq=0, dp_rank=5, block_hashes=P([1]), final=True), "dp_rank"),
            (pb.Snapshot(epoch=1, seq=0, dp_rank=0, block_hashes=P([1, 2]), tiers=b"\x00", final=True),
             "tiers"),
            (pb.Snapshot(epoch=1, seq=0, dp_rank=0, block_hashes=P([1]), tiers=b"\x07", final=True),
             "unknown tier"),
        ]
        for snap, words in cases:
            a = Agent(c)
            await a.hello()
            await a.send(snapshot=snap)
            err = await a.aborted()
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (err.details() or ""), err
            assert await export(index) == []


# --- auth -------------------------------------------------------------------------------------
AUTH_TOML = """
[[auth.agent_tokens]]
token = "agent-1"
nodes = ["n1"]
[[auth.router_tokens]]
token = "router"
[[auth.admin_tokens]]
token = "admin"
"""


async def test_auth_tokens_and_roles(index: Index, tmp_path: Any) -> None:
    async with serving(index, AUTH_TOML, tmp_path) as c:
        router = (("authorization", "Bearer router"),)
        for md, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.stub.Lookup(
                    pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=P([1]))),
                    metadata=md,
                    timeout=TIMEOUT,
                )
            assert info.value.code() == code
        # A token bound to n1 publishing for n2: PERMISSION_DENIED and nothing applied.
        a = Agent(c, "n2", token="agent-1")
        await a.send(hello=pb.Hello(node_id="n2", model=MODEL, epoch=1))
        err = await a.aborted()  # (no write after the refused Hello: it would race the refusal's status)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'n2'" in (err.details() or "")
        assert (await index.stats()).entries == 0 and len((await c.stats(router)).nodes) == 0
        # The router may query but not publish or manage.
        r = Agent(c, "n1", token="router")
        await r.send(hello=pb.Hello(node_id="n1", model=MODEL, epoch=1))
        assert (await r.aborted()).code() == grpc.StatusCode.PERMISSION_DENIED
        ok = Agent(c, "n1", token="agent-1")
        await ok.start()
        assert ack_seq(await ok.batch(1, [stored([1])])) == 1
        resp = await c.stub.Lookup(
            pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=P([1]))),
            metadata=router,
            timeout=TIMEOUT,
        )
        assert [n.node_id for n in resp.nodes] == ["n1"]
        for rpc in (
            c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1"), metadata=router, timeout=TIMEOUT),
            c.stub.RemoveNode(pb.RemoveNodeRequest(node_id="n1"), metadata=router, timeout=TIMEOUT),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.Heartbeat(
                pb.HeartbeatRequest(node_id="n1", epoch=1), metadata=router, timeout=TIMEOUT
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await export(index) == [(1, Tier.GPU)]
        # The admin drains, then removes (the stream is refused afterwards).
        admin = (("authorization", "Bearer admin"),)
        await c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1"), metadata=admin, timeout=TIMEOUT)
        assert (
            await c.stub.Lookup(
                pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=P([1]))),
                metadata=admin,
                timeout=TIMEOUT,
            )
        ).nodes == []
        await c.stub.RemoveNode(pb.RemoveNodeRequest(node_id="n1"), metadata=admin, timeout=TIMEOUT)
        await ok.send(batch=pb.EventBatch(seq=2, events=[stored([2])]))
        assert (await ok.aborted()).code() == grpc.StatusCode.ABORTED

        async def gone() -> bool:
            return await export(index) == []

        await until(gone)


# --- lookup -----------------------------------------------------------------------------------
async def test_lookup_bad_input(index: Index) -> None:
    async with serving(index, max_query_blocks=4) as c:
        bad = [
            (pb.LookupRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "either tokens or hashes"),
            (
                pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=P(range(5)))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_query_blocks",
            ),
            (
                pb.LookupRequest(model=MODEL, tokens=pb.TokenQuery(token_ids=pack_tokens(range(20)))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_query_blocks",
            ),
            (
                pb.LookupRequest(hashes=pb.HashQuery(block_hashes=P([1]))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "model",
            ),
            (
                pb.LookupRequest(model="unconfigured",
                                 tokens=pb.TokenQuery(token_ids=pack_tokens([1, 2, 3, 4]))),
                grpc.StatusCode.FAILED_PRECONDITION,
                "no hash profile",
            ),
        ]
        for req, code, words in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.stub.Lookup(req, timeout=TIMEOUT)
            assert info.value.code() == code and words in (info.value.details() or ""), info.value


async def test_lookup_orders_by_tier_weights_filters_candidates_and_carries_load(index: Index) -> None:
    async with serving(index) as c:
        a, b = Agent(c, "a"), Agent(c, "b", ranks=(0, 1))
        await a.start()
        await b.start()
        assert ack_seq(await a.batch(1, [stored([1, 2, 3], medium="DISK")])) == 1
        assert ack_seq(await b.batch(1, [stored([1, 2])])) == 1
        assert ack_seq(await b.batch(2, [stored([1])], rank=1)) == 2
        await c.stub.Heartbeat(
            pb.HeartbeatRequest(node_id="b", epoch=1, load=pb.Load(waiting_requests=7)), timeout=TIMEOUT
        )
        resp = await c.lookup_hashes([1, 2, 3])
        # b/0: 2 GPU blocks = 2.0; a: 3 STORAGE blocks x 0.5 = 1.5; b/1: 1.0.
        assert [(n.node_id, n.dp_rank, n.matched_blocks) for n in resp.nodes] == [
            ("b", 0, 2),
            ("a", 0, 3),
            ("b", 1, 1),
        ]
        assert resp.nodes[0].load.waiting_requests == 7 and resp.nodes[2].tiers.gpu == 1
        assert resp.nodes[1].tiers.storage == 3
        resp = await c.lookup_hashes([1, 2, 3], candidates=[pb.NodeRef(node_id="a", dp_rank=0)])
        assert [n.node_id for n in resp.nodes] == ["a"]
        await a.close()
        await b.close()


def _fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "vllm-engine" / name).read_text())
    return data


def _qwen_event(data: dict[str, Any], *, extra_keys: bool) -> pb.KVEvent:
    n = len(data["block_hashes"])
    lora = data.get("lora_name")
    ev = BlockStored(
        block_hashes=tuple(data["block_hashes"]),
        parent_block_hash=data["parent_block_hash"],
        token_ids=tuple(data["token_ids"][: n * data["block_size"]]),
        block_size=data["block_size"],
        medium=data["medium"],
        lora_name=lora,
        extra_keys=tuple(((lora,) if lora else None) for _ in range(n)) if extra_keys else None,
    )
    return wire_event(ev)


def wire_event(ev: BlockStored) -> pb.KVEvent:
    """A model event as an agent sends a sampled one: with its tokens, for verification."""
    (op,) = ops_of([ev])
    return event_to_proto(op, ev, Sample.of(ev))


async def test_lookup_by_tokens_matches_real_engine_hashes(index: Index) -> None:
    base, lora = _fixture("kv_event_base.json"), _fixture("kv_event_lora.json")
    async with serving(index, models=[f"{QWEN},algo=sha256_cbor,block_size=16,seed=42"]) as c:
        a = Agent(c, "gpu-0", model=QWEN)
        await a.start()
        b = Agent(c, "gpu-1", model=QWEN)
        await b.start()
        assert ack_seq(await a.batch(1, [_qwen_event(base, extra_keys=True)])) == 1
        assert ack_seq(await b.batch(1, [_qwen_event(lora, extra_keys=True)])) == 1
        n = len(base["block_hashes"])
        tokens = base["token_ids"]
        resp = await c.stub.Lookup(
            pb.LookupRequest(model=QWEN, tokens=pb.TokenQuery(token_ids=pack_tokens(tokens))), timeout=TIMEOUT
        )
        assert resp.num_blocks == n == len(tokens) // 16 and resp.block_size == 16
        assert [(x.node_id, x.matched_blocks) for x in resp.nodes] == [("gpu-0", n)]
        # The LoRA prompt is the same text; only a query with the adapter's name finds gpu-1's blocks.
        q = pb.TokenQuery(token_ids=pack_tokens(lora["token_ids"]), lora_name="Alice")
        resp = await c.stub.Lookup(pb.LookupRequest(model=QWEN, tokens=q), timeout=TIMEOUT)
        assert [(x.node_id, x.matched_blocks) for x in resp.nodes] == [("gpu-1", n)]
        # Both verified (first chains are always checked): no mismatch.
        stats = await c.stats()
        assert stats.hash_mismatches == 0 and {x.state for x in stats.nodes} == {"active"}
        assert c.server.state is not None
        reg = c.server.state.metrics.registry
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "ok"}) == 2
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "mismatch"}) == 0
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    ("model_spec", "profile", "cause"),
    [
        ("algo=sha256_cbor,block_size=16,seed=43", None, "seed"),
        ("algo=sha256,block_size=16,seed=42", None, "algorithm: the engine's hashes match sha256_cbor"),
        ("algo=sha256_cbor,block_size=32,seed=42", None, "block size"),
        (
            "algo=sha256_cbor,block_size=16,seed=43",
            pb.HashProfile(
                algo="sha256_cbor",
                block_size=16,
                style="untagged",
                none_hash_fingerprint=HashProfile("sha256_cbor", 16, seed="42").fingerprint(),
            ),
            "seed: the engine's NONE_HASH fingerprint",
        ),
    ],
)
async def test_hash_mismatch_is_reported_with_its_cause(
    index: Index, model_spec: str, profile: pb.HashProfile | None, cause: str
) -> None:
    base = _fixture("kv_event_base.json")
    async with serving(index, models=[f"{QWEN},{model_spec}"]) as c:
        a = Agent(c, "gpu-0", model=QWEN)
        welcome = await a.hello(profile=profile)
        assert welcome.snapshot_required
        await a.snapshot(0)
        if profile is not None:  # an announced profile that cannot match: said in the Welcome at once
            assert cause in welcome.hash_mismatch
            assert ack_seq(await a.batch(1, [_qwen_event(base, extra_keys=True)])) == 1  # still applied
        else:  # found by verifying the batch: the agent is told, then the batch is acked (still applied)
            assert not welcome.hash_mismatch
            event = _qwen_event(base, extra_keys=True)
            await a.send(batch=pb.EventBatch(seq=1, events=[event], sampled=True))
            notice = await a.recv()
            assert notice.WhichOneof("msg") == "notice", notice
            assert notice.notice.state == "hash_mismatch" and cause in notice.notice.message
            assert ack_seq(await a.recv()) == 1
        info = await c.node("gpu-0")
        assert info.state == "hash_mismatch" and info.hash_mismatch
        assert (
            info.hash_mismatch_reason.startswith(cause.split(":")[0]) and cause in info.hash_mismatch_reason
        )
        assert (await c.stats()).hash_mismatches == 1
        # Hash lookups still see the node (it is live), so nothing silently scores zero.
        assert [
            n.matched_blocks for n in (await c.lookup_hashes(base["block_hashes"][:3], model=QWEN)).nodes
        ] == [3]
        await a.close()


async def test_verification_continues_chains_from_verified_parents(index: Index) -> None:
    base = _fixture("kv_event_base.json")
    async with serving(index, models=[f"{QWEN},algo=sha256_cbor,block_size=16,seed=42"]) as c:
        a = Agent(c, "gpu-0", model=QWEN)
        await a.start()
        hashes, tokens = base["block_hashes"], base["token_ids"]
        head = BlockStored(
            block_hashes=tuple(hashes[:2]),
            parent_block_hash=None,
            token_ids=tuple(tokens[:32]),
            block_size=16,
            extra_keys=(None, None),
        )
        assert ack_seq(await a.batch(1, [wire_event(head)])) == 1
        # A continuation whose parent the coordinator verified, with a forged hash: caught.
        forged = BlockStored(
            block_hashes=(hashes[2] ^ 1,),
            parent_block_hash=hashes[1],
            token_ids=tuple(tokens[32:48]),
            block_size=16,
            extra_keys=(None,),
        )
        notice = await a.batch(2, [wire_event(forged)])  # the agent is told, then the batch acked
        assert notice.notice.state == "hash_mismatch" and "parent verified" in notice.notice.message
        assert ack_seq(await a.recv()) == 2
        info = await c.node("gpu-0")
        assert info.state == "hash_mismatch" and "parent verified" in info.hash_mismatch_reason
        assert c.server.state is not None
        reg = c.server.state.metrics.registry
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "ok"}) == 1
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "mismatch"}) == 1
        await a.close()


async def test_verification_skips_events_without_extra_keys(index: Index) -> None:
    """A release that omits extra_keys may have hashed cache_salt or multimodal keys the coordinator
    cannot know: such events are skipped (counted), never reported as a mismatch."""
    base = _fixture("kv_event_base.json")
    # Seed 43: a wrong seed would be a mismatch if the event were verified.
    async with serving(index, models=[f"{QWEN},algo=sha256_cbor,block_size=16,seed=43"]) as c:
        a = Agent(c, "gpu-0", model=QWEN)
        await a.start()
        assert ack_seq(await a.batch(1, [_qwen_event(base, extra_keys=False)])) == 1
        info = await c.node("gpu-0")
        assert info.state == "active" and not info.hash_mismatch
        assert c.server.state is not None
        reg = c.server.state.metrics.registry
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "skipped"}) == 1
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "mismatch"}) == 0
        await a.close()


async def test_verification_checks_what_the_welcome_asks_agents_to_sample(index: Index) -> None:
    """The Welcome names the sample (the first chains, then one in ``sample_every``); an agent's
    TokenSampler sends tokens with exactly those events, and the coordinator verifies each of them.
    Every event is applied either way."""
    base = _fixture("kv_event_base.json")
    async with serving(index, models=[f"{QWEN},algo=sha256_cbor,block_size=16,seed=42"]) as c:
        assert c.server.state is not None
        verifier = c.server.state.verifier
        first, every = verifier.cfg.first, verifier.cfg.sample_every
        a = Agent(c, "gpu-0", model=QWEN)
        welcome = await a.hello()
        assert (welcome.verify.first, welcome.verify.every, welcome.verify.block_size) == (first, every, 16)
        await a.snapshot(0)
        sampler = TokenSampler()
        sampler.configure(welcome.verify)
        n = len(base["block_hashes"])
        ev = BlockStored(tuple(base["block_hashes"]), None, tuple(base["token_ids"][: n * 16]), 16,
                         medium="GPU", extra_keys=(None,) * n)
        (op,) = ops_of([ev])
        count = first + 2 * every
        carried = 0
        for seq in range(1, count + 1):
            sample = sampler.pick(ev)
            carried += sample is not None
            assert ack_seq(await a.batch(seq, [event_to_proto(op, ev, sample)])) == seq
        assert carried == first + 2
        reg = c.server.state.metrics.registry
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "ok"}) == first + 2
        assert (await c.node("gpu-0")).state == "active"
        assert [h for h, _ in await export(index, "gpu-0", model=QWEN)] == sorted(base["block_hashes"])
        await a.close()


# --- health follows the index backend ----------------------------------------------------------
async def test_health_follows_index_ping(tmp_path: Any) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvcoord.index import open_index
    from tests.redis_servers import start_server, stop_server

    redis = start_server()
    try:
        idx = open_index(redis.url, key_prefix=f"kvc-health-{redis.port}")
        try:
            async with serving(idx, 'stats_interval = 0.1\n', tmp_path) as c:
                health = health_pb2_grpc.HealthStub(c.channel)

                async def status_is(want: int) -> bool:
                    req = health_pb2.HealthCheckRequest(service="kvcoord.v2.Coordinator")
                    return bool((await health.Check(req, timeout=TIMEOUT)).status == want)

                await until(lambda: status_is(health_pb2.HealthCheckResponse.SERVING))
                redis.kill()
                await until(lambda: status_is(health_pb2.HealthCheckResponse.NOT_SERVING), timeout=10)
                redis.restart()
                await until(lambda: status_is(health_pb2.HealthCheckResponse.SERVING), timeout=10)
        finally:
            await idx.close()
    finally:
        stop_server(redis)


# --- index generation ---------------------------------------------------------------------------
class LosableIndex(MemoryIndex):
    """A memory index that can lose all it holds at once, as a Redis restarted empty does: so, as Redis
    has, a remote capability whose generation changes then."""

    def __init__(self) -> None:
        super().__init__()
        from kvcoord.index.redis.client import RedisMetrics

        self.remote = self
        self.metrics = RedisMetrics()
        self.lost = 0

    async def ping(self) -> bool:
        return True

    async def generation(self) -> str:
        return str(self.lost)

    def lose_everything(self) -> None:
        lost = self.lost + 1
        self.__init__()  # type: ignore[misc]  # empty
        self.lost = lost


async def test_index_that_lost_its_data_gets_every_node_resynced() -> None:
    index = LosableIndex()
    async with serving(index, stats_interval=0.05) as c:
        a = Agent(c, "n1")
        await a.start()
        b = Agent(c, "n2")
        await b.start()
        assert ack_seq(await a.batch(1, [stored([1, 2, 3])])) == 1
        assert ack_seq(await b.batch(1, [stored([1, 2])])) == 1
        assert [(n.node_id, n.matched_blocks) for n in (await c.lookup_hashes([1, 2, 3])).nodes] == [
            ("n1", 3), ("n2", 2)]
        gen = await index.generation()

        index.lose_everything()
        assert await index.generation() != gen
        for agent in (a, b):
            msg = await agent.recv()
            assert msg.WhichOneof("msg") == "snapshot_request", msg
            assert msg.snapshot_request.reason.startswith("index_reset")
        assert {n.node_id: n.state for n in (await c.stats()).nodes} == {"n1": "resyncing", "n2": "resyncing"}
        assert not (await c.lookup_hashes([1, 2, 3])).nodes
        # Batches are not applied to the empty index while a snapshot is due; the snapshot restores.
        await a.send(batch=pb.EventBatch(seq=2, events=[stored([4])]))
        await a.snapshot(2, {0: [(1, 0), (2, 0), (3, 0), (4, 0)]})
        await b.snapshot(1, {0: [(1, 0), (2, 0)]})
        assert [(n.node_id, n.matched_blocks) for n in (await c.lookup_hashes([1, 2, 3, 4])).nodes] == [
            ("n1", 4), ("n2", 2)]
        assert (await c.stats()).snapshots_requested >= 4  # two hellos, two index resets
        await a.close()
        await b.close()


# --- batch groups -------------------------------------------------------------------------------
async def test_batch_group_is_handled_batch_by_batch(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c)
        await a.hello()
        await a.snapshot(0)

        def batch(seq: int, hashes: Sequence[int]) -> pb.EventBatch:
            return pb.EventBatch(seq=seq, events=[stored(hashes)])

        # 1, 2, a duplicate of 2, 3: one cumulative ack for the whole group.
        group = [batch(1, [1]), batch(2, [2]), batch(2, [99]), batch(3, [3])]
        await a.send(batches=pb.EventBatches(batches=group))
        assert ack_seq(await a.recv()) == 3
        assert await export(index) == [(1, Tier.GPU), (2, Tier.GPU), (3, Tier.GPU)]
        # A bad batch inside a group is rejected alone: batch 4 applies, 5 is invalid, 6 is dropped
        # until the snapshot that the coordinator asks for.
        bad = pb.EventBatch(seq=5, events=[stored([5], medium="TAPE")])
        await a.send(batches=pb.EventBatches(batches=[batch(4, [4]), bad, batch(6, [6])]))
        msgs = [await a.recv(), await a.recv()]
        assert ack_seq(msgs[0]) == 4 and msgs[1].WhichOneof("msg") == "snapshot_request", msgs
        assert "invalid_batch" in msgs[1].snapshot_request.reason
        assert [h for h, _ in await export(index)] == [1, 2, 3, 4]
        await a.close()


async def test_reporter_backlog_goes_out_grouped_and_all_applies(index: Index) -> None:
    from kvcoord.agent.link import ReporterOptions
    from kvcoord.agent.reporter import Reporter

    async with serving(index) as c:
        opts = ReporterOptions(max_batch_blocks=2, flush_interval=0.001)
        rep = Reporter([c.server.address], node_id="n1", model=MODEL, epoch=1, snapshot=lambda r: [],
                       options=opts)
        await rep.start()
        try:
            await rep.wait_connected(TIMEOUT)
            for i in range(300):  # queued faster than one message per batch can go out
                rep.submit(0, [BlockStored(block_hashes=(2 * i + 1, 2 * i + 2), parent_block_hash=None,
                                           token_ids=(), block_size=4)])
            await rep.wait_acked(TIMEOUT)
            st = rep.stats().links[0]
            assert (st.batches_sent, st.batches_acked, st.snapshot_requests) == (300, 300, 0), st
        finally:
            await rep.close()
        assert [h for h, _ in await export(index)] == list(range(1, 601))


# --- node removal vs an in-flight write ---------------------------------------------------------
class GatedIndex(MemoryIndex):
    """A memory index whose applies can be held, as a slow backend round trip holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = 0

    async def apply(self, model: str, node_id: str, dp_rank: int, events: Sequence[Any]) -> Any:
        if not self.gate.is_set():
            self.held += 1
            await self.gate.wait()
        return await super().apply(model, node_id, dp_rank, events)


async def _true(cond: Any) -> bool:
    return bool(cond())


async def test_remove_node_waits_for_an_in_flight_apply() -> None:
    """RemoveNode while a batch's apply waits on the backend: the removal runs after it lands, so
    no entry of the removed node is left behind."""
    index = GatedIndex()
    async with serving(index) as c:
        a = Agent(c, "n1")
        await a.start()
        index.gate.clear()
        await a.send(batch=pb.EventBatch(seq=1, events=[stored([1, 2, 3])]))
        await until(lambda: _true(lambda: index.held == 1))
        await c.stub.RemoveNode(pb.RemoveNodeRequest(node_id="n1"), timeout=TIMEOUT)
        st = c.server.state
        assert st is not None and st.registry.removal_pending("n1")
        index.gate.set()
        await until(lambda: _true(lambda: not st.registry.removal_pending("n1")))
        assert await export(index) == []
        assert (await index.stats()).entries == 0
        await a.close()


# --- drain ----------------------------------------------------------------------------------------
async def test_drain_ends_on_undrain_and_on_a_new_epoch(index: Index) -> None:
    async with serving(index) as c:
        a = Agent(c, "n1")
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        await c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1"), timeout=TIMEOUT)
        assert (await c.node("n1")).state == "draining" and not (await c.lookup_hashes([1, 2])).nodes
        await c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1", undrain=True), timeout=TIMEOUT)
        assert (await c.node("n1")).state == "active"
        assert [n.matched_blocks for n in (await c.lookup_hashes([1, 2])).nodes] == [2]
        # Drained again, then the node restarts (new epoch): it returns after its snapshot.
        await c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1"), timeout=TIMEOUT)
        await a.close()
        b = Agent(c, "n1", epoch=2)
        await b.hello()
        await b.snapshot(0, {0: [(1, 0)]})
        assert (await c.node("n1")).state == "active"
        assert [n.matched_blocks for n in (await c.lookup_hashes([1, 2])).nodes] == [1]
        # A reconnect in the same epoch keeps a drain (the operator's decision stands).
        await c.stub.DrainNode(pb.DrainNodeRequest(node_id="n1"), timeout=TIMEOUT)
        await b.close()
        b2 = Agent(c, "n1", epoch=2)
        await b2.hello()
        assert (await c.node("n1")).state == "draining"
        await b2.close()


# --- index errors in lookups and stats ----------------------------------------------------------
class FaultyIndex(MemoryIndex):
    """A memory index whose match or stats can be made to raise a chosen exception."""

    def __init__(self) -> None:
        super().__init__()
        self.match_error: Exception | None = None
        self.stats_error: Exception | None = None

    async def match(self, model: str, hashes: Sequence[Any], candidates: Any = None) -> Any:
        if self.match_error is not None:
            raise self.match_error
        return await super().match(model, hashes, candidates)

    async def stats(self, *, exact: bool = True) -> Any:
        if self.stats_error is not None:
            raise self.stats_error
        return await super().stats(exact=exact)


async def test_lookup_bug_is_internal_outage_is_unavailable() -> None:
    index = FaultyIndex()
    async with serving(index) as c:
        a = Agent(c, "n1")
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        st = c.server.state
        assert st is not None
        index.match_error = KeyError("bug")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.lookup_hashes([1, 2])
        assert err.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in (err.value.details() or "")
        assert st.health.up  # a bug does not take the replica out of rotation
        reg = st.metrics.registry

        async def counted() -> bool:  # the status can reach the client before the handler's finally runs
            return reg.get_sample_value("kvcoord_lookup_latency_seconds_count", {"query": "invalid"}) == 1

        await until(counted)
        index.match_error = ConnectionError("backend gone")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.lookup_hashes([1, 2])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and not st.health.up
        index.match_error = None
        await until(lambda: _true(lambda: st.health.up))
        resp = await c.lookup_hashes([1, 2, 3])
        assert [n.matched_blocks for n in resp.nodes] == [2]
        assert reg.get_sample_value("kvcoord_lookup_matched_fraction_sum") == pytest.approx(2 / 3)
        await a.close()


async def test_stats_failure_is_marked_stale() -> None:
    index = FaultyIndex()
    async with serving(index) as c:
        a = Agent(c, "n1")
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        fresh = await c.stats()
        assert fresh.entries == 2 and not fresh.index_stats_stale and not fresh.blocks_upper_bound
        index.stats_error = RuntimeError("stats broke")
        assert ack_seq(await a.batch(2, [stored([3])])) == 2
        stale = await c.stats()
        assert stale.index_stats_stale and stale.entries == 2  # the last figures known, said to be so
        index.stats_error = None
        again = await c.stats()
        assert not again.index_stats_stale and again.entries == 3
        await a.close()


async def test_redis_refresh_uses_cheap_stats_and_stats_rpc_is_exact(redis_server: Any) -> None:
    """Over several buckets the periodic gauges take the per-bucket sum (flagged an upper bound, no
    scan); the Stats RPC answers the exact distinct count."""
    from kvcoord.index.redis.index import RedisIndex

    redis_server.flushall()
    index = RedisIndex.from_uri(redis_server.url + "?buckets=4", key_prefix="kvquick")
    try:
        names = iter(f"n{i}" for i in range(1000))
        first = next(names)
        other = next(n for n in names if index.bucket_of(n) != index.bucket_of(first))
        async with serving(index, stats_interval=0.05) as c:
            for node in (first, other):
                ag = Agent(c, node)
                await ag.start()
                assert ack_seq(await ag.batch(1, [stored([1, 2, 3])])) == 1
                await ag.close()
            quick = await index.stats(exact=False)
            assert (quick.blocks, quick.blocks_upper_bound) == (6, True)
            st = c.server.state
            assert st is not None
            reg = st.metrics.registry

            async def gauges_refreshed() -> bool:
                return reg.get_sample_value("kvcoord_index_blocks", {"model": MODEL}) == 6

            await until(gauges_refreshed)
            assert reg.get_sample_value("kvcoord_index_blocks_upper_bound") == 1
            resp = await c.stats()
            assert (resp.entries, resp.blocks, resp.blocks_upper_bound) == (6, 3, False)
    finally:
        await index.close()


async def test_a_rejected_batch_leaves_the_index_unchanged() -> None:
    """A bad event late in a batch (an unknown tier): the batch is rejected naming that event, the
    earlier stores of the same batch are not applied, and a snapshot is asked for."""
    index = MemoryIndex()
    async with serving(index) as c:
        a = Agent(c, "n1")
        await a.start()
        assert ack_seq(await a.batch(1, [stored([1, 2])])) == 1
        bad = removed([1], medium="tape")
        msg = await a.batch(2, [stored([3, 4]), bad])
        assert msg.WhichOneof("msg") == "snapshot_request", msg
        assert f"event 1: unknown tier {BAD_TIER}" in msg.snapshot_request.reason
        assert await export(index) == [(1, Tier.GPU), (2, Tier.GPU)]
        await a.close()
