"""The reporter against a scripted coordinator (a real grpc.aio server on a free port) whose answers
each test controls: acks, resends after a restart, snapshots, chunking, overflow, heartbeats, auth."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.node import snapshot_from_mapping
from kvcoord.agent.reporter import Reporter
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.transport import ChannelSecurity
from kvcoord.validate import ops_of, unpack_u64
from kvcoord.wire import ops_from_proto
from tests.procs import free_port

SLOW = 5.0
"""A bound for "does not hang": generous, as a loaded 2-core CI machine can stall any step a while."""
FAST = ReporterOptions(flush_interval=0.005, backoff_initial=0.02, backoff_max=0.1, welcome_timeout=2.0)


@dataclass
class Script:
    """What the scripted coordinator answers; tests flip these between phases."""

    acked_seq: int = 0
    snapshot_required: bool = False
    lease_seconds: float = 10.0
    ack: bool = True
    received: list[pb.AgentMessage] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    streams: list[Any] = field(default_factory=list)


class Scripted:
    def __init__(self, script: Script) -> None:
        self.s = script

    async def ingest(self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any) -> None:
        s = self.s
        s.metadata.append({k: v for k, v in context.invocation_metadata()})
        s.streams.append(context)
        async for msg in request_iterator:
            s.received.append(msg)
            kind = msg.WhichOneof("msg")
            if kind == "hello":
                await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
                    epoch=msg.hello.epoch, acked_seq=s.acked_seq, lease_seconds=s.lease_seconds,
                    snapshot_required=s.snapshot_required)))
            elif kind in ("batch", "batches") and s.ack:
                last = msg.batch.seq if kind == "batch" else msg.batches.batches[-1].seq
                s.acked_seq = max(s.acked_seq, last)
                await context.write(pb.CoordinatorMessage(ack=pb.Ack(seq=last)))
            elif kind == "snapshot" and msg.snapshot.final:
                s.acked_seq = msg.snapshot.seq
                s.snapshot_required = False
                await context.write(pb.CoordinatorMessage(ack=pb.Ack(seq=msg.snapshot.seq)))


@contextlib.asynccontextmanager
async def scripted_server(script: Script, port: int) -> AsyncIterator[grpc.aio.Server]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        Scripted(script).ingest, request_deserializer=pb.AgentMessage.FromString,
        response_serializer=pb.CoordinatorMessage.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvcoord.v2.Coordinator",
                                                                          {"Ingest": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=None)


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def batches(s: Script) -> list[pb.EventBatch]:
    out: list[pb.EventBatch] = []
    for m in s.received:
        if m.WhichOneof("msg") == "batch":
            out.append(m.batch)
        elif m.WhichOneof("msg") == "batches":
            out.extend(m.batches.batches)
    return out


def ops(events: Any) -> list[tuple[Any, ...]]:
    """A batch's ops (from the wire or from events), comparable."""
    got = ops_from_proto(events) if events and isinstance(events[0], pb.KVEvent) else ops_of(events)
    return [(o.kind, o.tier, list(o.hashes), o.group, o.indexable) for o in got]


def chunk_hashes(c: pb.Snapshot) -> list[int]:
    return list(unpack_u64(c.block_hashes, "snapshot"))


def chunk_tiers(c: pb.Snapshot) -> list[int]:
    return list(c.tiers) or [0] * len(chunk_hashes(c))


def snapshots(s: Script) -> list[pb.Snapshot]:
    return [m.snapshot for m in s.received if m.WhichOneof("msg") == "snapshot"]


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(), block_size=16)


State = dict[int, dict[int, Tier]]


def provider(state: State) -> Callable[[int], list[tuple[int, Tier]]]:
    return lambda rank: sorted(state.get(rank, {}).items())


async def reporter(port: int, state: State | None = None, **kw: Any) -> Reporter:
    kw.setdefault("options", FAST)
    r = Reporter([f"127.0.0.1:{port}"], node_id="n1", model="m", epoch=7,
                 snapshot=provider(state if state is not None else {}), **kw)
    await r.start()
    return r


async def test_batches_are_numbered_acked_and_lossless() -> None:
    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        r = await reporter(port, dp_ranks=(0, 1))
        try:
            evs: list[KVEvent] = [stored(1, 2), BlockRemoved(block_hashes=(2,), medium="CPU"),
                                  AllBlocksCleared()]
            r.submit(0, evs[:2], ts=123.5)
            await r.flush()
            r.submit(1, evs[2:])
            await r.wait_acked(5)
            hello = s.received[0].hello
            assert (hello.node_id, hello.model, list(hello.dp_ranks), hello.epoch, hello.next_seq) == (
                "n1", "m", [0, 1], 7, 1)
            got = batches(s)
            assert [b.seq for b in got] == [1, 2]
            assert ops(got[0].events) == ops(evs[:2])
            assert got[0].ts == 123.5 and got[0].dp_rank == 0
            assert got[1].dp_rank == 1 and ops(got[1].events) == ops([AllBlocksCleared()])
            st = r.stats()
            totals = (st.total("batches_sent"), st.total("batches_acked"), st.total("unacked"))
            assert st.last_seq == 2 and totals == (2, 2, 0)
        finally:
            await r.close()


async def test_an_idle_stream_sends_at_once_and_a_busy_one_coalesces() -> None:
    """A stream waiting for work takes a batch at once, whatever ``flush_interval`` says; what is submitted
    while it writes goes in its next message, sealed when the write is done."""
    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        opts = ReporterOptions(flush_interval=30.0, backoff_initial=0.02, backoff_max=0.1)
        r = await reporter(port, {0: {}}, options=opts)
        try:
            await r.wait_connected(SLOW)
            await until(lambda: r._links[0].idle, what="the writer waiting for work")
            r.submit(0, [stored(1)])
            await until(lambda: len(batches(s)) == 1, timeout=SLOW, what="the first batch, without the timer")
            await until(lambda: r._links[0].idle, what="the writer waiting again")
            for h in range(2, 12):  # one burst: the first seals at once, the rest wait behind its write
                r.submit(0, [stored(h)])
            await until(lambda: len(batches(s)) == 3, timeout=SLOW, what="the rest, sealed after the write")
            await r.wait_acked(SLOW)
            assert r.last_seq == 3 and [b.seq for b in batches(s)] == [1, 2, 3]
            assert [len(b.events) for b in batches(s)] == [1, 1, 9]
        finally:
            await r.close()


async def test_linger_holds_a_batch_for_more_events() -> None:
    """With ``linger`` a batch waits for more events even with the stream free (until the linger ends or
    a flush)."""
    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        r = await reporter(port, {0: {}}, options=ReporterOptions(linger=30.0, backoff_initial=0.02))
        try:
            await r.wait_connected(SLOW)
            await until(lambda: r._links[0].idle, what="the writer waiting for work")
            r.submit(0, [stored(1)])
            await asyncio.sleep(0.05)
            r.submit(0, [stored(2)])
            assert r.last_seq == 0 and batches(s) == []
            await r.wait_acked(SLOW)  # seals what is pending
            assert [len(b.events) for b in batches(s)] == [2]
        finally:
            await r.close()


async def test_size_limits_split_batches() -> None:
    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        opts = ReporterOptions(max_batch_events=2, max_batch_blocks=5, flush_interval=0.005)
        r = await reporter(port, options=opts)
        try:
            r.submit(0, [stored(1), stored(2), stored(3)])  # 2 events, then 1
            r.submit(0, [stored(10, 11, 12, 13, 14, 15)])  # 6 blocks >= 5: its own batch with the pending one
            await r.wait_acked(5)
            sizes = [len(b.events) for b in batches(s)]
            assert sizes == [2, 2]
            assert [b.seq for b in batches(s)] == [1, 2]
        finally:
            await r.close()


async def test_resend_after_coordinator_restart_on_same_port() -> None:
    port = free_port()
    s1 = Script(ack=False)
    r: Reporter | None = None
    try:
        async with scripted_server(s1, port):
            r = await reporter(port)
            for i in range(3):
                r.submit(0, [stored(100 + i)])
                await r.flush()
            await until(lambda: len(batches(s1)) == 3, what="3 batches")
            assert r.stats().total("unacked") == 3
        # a new coordinator on the same port that had applied seq 1 (e.g. a replica sharing the index)
        s2 = Script(acked_seq=1)
        async with scripted_server(s2, port):
            await r.wait_acked(5)
            assert s2.received[0].hello.next_seq == 1
            assert [b.seq for b in batches(s2)] == [2, 3]
            assert [unpack_u64(b.events[0].stored.block_hashes, "e")[0] for b in batches(s2)] == [101, 102]
            st = r.stats().links[0]
            assert st.batches_resent == 2 and st.reconnects >= 1 and st.batches_acked == 3
    finally:
        if r is not None:
            await r.close()


async def test_restarted_empty_coordinator_gets_a_snapshot_then_new_batches() -> None:
    port = free_port()
    state: State = {0: {}}
    s1 = Script()
    r: Reporter | None = None
    try:
        async with scripted_server(s1, port):
            r = await reporter(port, state)
            for h in (1, 2, 3):
                r.submit(0, [stored(h)])
                state[0][h] = Tier.GPU
            await r.wait_acked(5)
        s2 = Script(snapshot_required=True)
        async with scripted_server(s2, port):
            await until(lambda: bool(snapshots(s2)), what="snapshot")
            snap = snapshots(s2)
            assert len(snap) == 1 and snap[0].final and snap[0].seq == r.last_seq and snap[0].epoch == 7
            assert chunk_hashes(snap[0]) == [1, 2, 3] and chunk_tiers(snap[0]) == [0, 0, 0]
            r.submit(0, [stored(4)])
            await r.wait_acked(5)
            kinds = [m.WhichOneof("msg") for m in s2.received]
            assert kinds[:3] == ["hello", "snapshot", "batch"]
            assert batches(s2)[0].seq == snap[0].seq + 1
            assert r.stats().links[0].snapshots_sent == 1
    finally:
        if r is not None:
            await r.close()


async def test_snapshot_request_flushes_pending_and_chunks() -> None:
    port = free_port()
    state: State = {0: {i: Tier.GPU for i in range(7)}, 1: {50: Tier.CPU}}
    s = Script()
    async with scripted_server(s, port):
        opts = ReporterOptions(flush_interval=30.0, snapshot_chunk_entries=3)
        r = await reporter(port, state, dp_ranks=(0, 1), options=opts)
        try:
            await until(lambda: bool(s.streams), what="stream")
            r.submit(0, [stored(6)])  # sealed at once (the stream waits for work) or pending behind a write
            await s.streams[0].write(pb.CoordinatorMessage(snapshot_request=pb.SnapshotRequest(epoch=7,
                                                                                                 reason="gap")))
            await until(lambda: any(c.final for c in snapshots(s)), what="final chunk")
            chunks = snapshots(s)
            assert r.last_seq == 1  # the pending batch was sealed first, and the snapshot is as of it
            assert [(c.dp_rank, len(chunk_hashes(c)), c.final) for c in chunks] == [
                (0, 3, False), (0, 3, False), (0, 1, False), (1, 1, True)]
            assert {c.seq for c in chunks} == {1}
            assert chunk_tiers(chunks[3]) == [pb.TIER_CPU]
            assert batches(s) == [] or batches(s)[0].seq == 1  # it may have gone out before the request
            await r.wait_acked(5)
            assert r.stats().links[0].snapshot_requests == 1
        finally:
            await r.close()


async def test_overflow_drops_queue_and_resyncs_with_snapshot_without_blocking() -> None:
    port = free_port()
    state: State = {0: {}}
    opts = ReporterOptions(flush_interval=0.001, max_unacked_batches=2, backoff_initial=0.02,
                           backoff_max=0.05)
    r = await reporter(port, state, options=opts)  # nothing listens yet
    try:
        for h in range(5):
            t0 = time.monotonic()
            r.submit(0, [stored(h)])
            state[0][h] = Tier.GPU
            await r.flush()
            assert time.monotonic() - t0 < SLOW  # never waits out connect backoff or a full queue
        await until(lambda: r.stats().links[0].last_error != "", what="a failed connect")
        st = r.stats().links[0]
        assert st.overflows == 2 and st.unacked == 1 and not st.connected
        s = Script(acked_seq=0)
        async with scripted_server(s, port):
            await r.wait_acked(5)
            kinds = [m.WhichOneof("msg") for m in s.received]
            assert kinds == ["hello", "snapshot"]
            assert chunk_hashes(snapshots(s)[0]) == [0, 1, 2, 3, 4] and snapshots(s)[0].seq == 5
    finally:
        await r.close()


async def test_heartbeats_token_and_thread_submit() -> None:
    port = free_port()
    s = Script(lease_seconds=0.15)
    async with scripted_server(s, port):
        r = await reporter(port, load=lambda: NodeLoad(3, 1, 0.5), security=ChannelSecurity(token="tok-1"))
        try:
            await until(lambda: sum(m.WhichOneof("msg") == "heartbeat" for m in s.received) >= 2,
                        what="heartbeats")
            hb = next(m.heartbeat for m in s.received if m.WhichOneof("msg") == "heartbeat")
            assert (hb.load.running_requests, hb.load.waiting_requests, hb.load.kv_usage) == (3, 1, 0.5)
            assert s.metadata[0]["authorization"] == "Bearer tok-1"
            th = threading.Thread(target=r.submit, args=(0, [stored(9)]))
            th.start()
            th.join()
            await until(lambda: len(batches(s)) == 1, what="batch from thread")
        finally:
            await r.close()


async def test_bad_input_is_rejected_and_queues_nothing() -> None:
    port = free_port()
    r = await reporter(port)
    try:
        with pytest.raises(ValueError, match="dp_rank 3 is not one of"):
            r.submit(3, [stored(1)])
        with pytest.raises(ValueError, match=r"event 1: .*outside uint64"):
            r.submit(0, [stored(1), stored(-1)])
        await r.flush()
        assert r.last_seq == 0 and r.stats().events_submitted == 0
    finally:
        await r.close()
    with pytest.raises(RuntimeError):
        r.submit(0, [stored(1)])
    with pytest.raises(ValueError, match="dp_ranks"):
        Reporter(["x:1"], node_id="n", model="m", snapshot=snapshot_from_mapping({}), dp_ranks=(0, 0))


@pytest.mark.parametrize("listening", [False, True])
async def test_close_is_prompt(listening: bool) -> None:
    port = free_port()
    s = Script(ack=False)
    async with contextlib.AsyncExitStack() as stack:
        if listening:
            await stack.enter_async_context(scripted_server(s, port))
        r = await reporter(port)
        r.submit(0, [stored(1)])
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await r.close()
        assert time.monotonic() - t0 < SLOW
        assert all(t.done() for t in asyncio.all_tasks() if t.get_name().startswith("kvcoord-reporter"))


async def test_snapshot_from_a_relay_mirror_takes_its_columns_whole() -> None:
    """A real relay BlockMirror as the snapshot provider: its RankSnapshot's columns go into the chunks
    as they are (uint64 hashes, tier numbers), per rank and chunked, equal to the per-entry path's."""
    from kvcoord.engine.mirror import BlockMirror

    mirror = BlockMirror()
    digest = BlockStored(block_hashes=(b"\x07" * 32,), parent_block_hash=None, token_ids=(), block_size=16,
                         medium="CPU")
    mirror.apply(0, [stored(1, 2, (1 << 64) - 1), digest])
    mirror.apply(1, [BlockStored(block_hashes=(5, 6), parent_block_hash=None, token_ids=(), block_size=16,
                                 medium="disk"), BlockRemoved(block_hashes=(6,), medium="disk")])
    assert hasattr(mirror.rank_entries(0), "columns")
    port = free_port()
    s = Script(snapshot_required=True)
    async with scripted_server(s, port):
        opts = ReporterOptions(flush_interval=0.005, snapshot_chunk_entries=2)
        r = Reporter([f"127.0.0.1:{port}"], node_id="n1", model="m", epoch=7,
                     snapshot=mirror.rank_entries, dp_ranks=(0, 1), options=opts)
        await r.start()
        try:
            await r.wait_connected(SLOW)
            chunks = snapshots(s)
            got = {(c.dp_rank, h, t) for c in chunks
                   for h, t in zip(chunk_hashes(c), chunk_tiers(c), strict=True)}
            want = {(rank, int(h), int(t)) for rank in (0, 1) for h, t in mirror.rank_entries(rank)}
            assert got == want and len(want) == 5
            assert [(c.dp_rank, len(chunk_hashes(c)), c.final) for c in chunks] == [
                (0, 2, False), (0, 2, False), (1, 1, True)]
            # the mirror's columns were read, not copied into or changed
            hashes, tiers = mirror.rank_entries(0).columns()
            assert sorted(hashes) == sorted(h for c in chunks[:2] for h in chunk_hashes(c))
            assert all(isinstance(t, Tier) for t in tiers)
        finally:
            await r.close()


async def test_merged_runs_go_out_as_one_wire_event_each() -> None:
    """The relay hands over runs of like events as one op each (``op_runs``, with ``spans``): each run
    goes on the wire as one event standing for them all (``KVEvent.events``), cut where a run crosses a
    batch bound (batches count engine events)."""
    from kvcoord.validate import op_runs

    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        opts = ReporterOptions(max_batch_events=4, max_batch_blocks=64, flush_interval=0.005)
        r = await reporter(port, options=opts)
        try:
            evs: list[KVEvent] = [stored(1, 2), stored(3)]
            evs += [BlockRemoved(block_hashes=(h,)) for h in range(20, 27)]
            evs += [BlockRemoved(block_hashes=(40, 41), medium="CPU"), AllBlocksCleared(),
                    BlockRemoved(block_hashes=(50,))]
            runs, spans = op_runs(evs)
            assert len(runs) < len(evs) and sum(spans) == len(evs)
            r.submit(0, evs, ts=1.0, ops=runs, spans=spans)
            await r.wait_acked(5)
            got = batches(s)
            assert [sum(e.events or 1 for e in b.events) for b in got] == [4, 4, 4]
            assert [len(b.events) for b in got] == [2, 1, 4]

            def blocks(xs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:  # per block, runs or not
                return [(k, t, h, g, i) for k, t, hs, g, i in xs for h in hs or [None]]
            assert blocks([op for b in got for op in ops(b.events)]) == blocks(ops(evs))
        finally:
            await r.close()
