"""``KVEvent.events``: a run of like engine events as one wire event.

An agent that predates the field sends one wire event per engine event; a current one sends a run as
one event of all its hashes, standing for ``events`` engine events, and cuts it around a sampled store
(which goes alone with its tokens) and at the batch bounds. Both are applied exactly, and the
coordinator counts engine events either way (``events_applied``, ``max_events_per_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockRemoved, BlockStored, KVEvent
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.base import Index
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import op_runs
from tests.agent.test_reporter import Script, batches, scripted_server
from tests.coordinator.test_coordinator_ingest import (
    MODEL,
    TIMEOUT,
    Agent,
    ack_seq,
    export,
    removed,
    serving,
    stored,
)
from tests.procs import free_port

PROFILE = HashProfile(algo="sha256_cbor", block_size=4, seed="42")
"""The ingest tests' model profile (``m,algo=sha256_cbor,block_size=4,seed=42``)."""


def run_event(event: pb.KVEvent, events: int) -> pb.KVEvent:
    event.events = events
    return event


def engine_events() -> tuple[list[int], list[KVEvent]]:
    """A 12-block chain stored as six 2-block events (the coordinator can verify each), then ten
    one-block removals of its tail, as vLLM frees blocks."""
    tokens = list(range(100, 148))
    chain = block_hashes64(PROFILE, tokens)
    evs: list[KVEvent] = []
    for k in range(6):
        evs.append(BlockStored(block_hashes=tuple(chain[2 * k:2 * k + 2]),
                               parent_block_hash=chain[2 * k - 1] if k else None,
                               token_ids=tuple(tokens[8 * k:8 * k + 8]), block_size=4,
                               extra_keys=(None, None)))
    evs += [BlockRemoved(block_hashes=(h,)) for h in reversed(chain[2:])]
    return chain, evs


def wire_counts(got: Sequence[pb.EventBatch]) -> list[list[tuple[str | None, int, bool]]]:
    """Per batch: each wire event's kind, the engine events it stands for, and whether it has tokens."""
    return [[(e.WhichOneof("event"), e.events or 1, bool(e.stored.token_ids)) for e in b.events] for b in got]


async def test_old_and_new_agents_apply_the_same_and_count_engine_events(index: Index) -> None:
    async with serving(index) as c:
        old, new = Agent(c, "old"), Agent(c, "new")
        await old.start()
        await new.start()
        # old: one wire event per engine event; new: the removals as one run event, the stores as two
        three = [stored([1, 2]), stored([3], parent=2), stored([4], parent=3)]
        assert ack_seq(await old.batch(1, three)) == 1
        assert ack_seq(await old.batch(2, [removed([h]) for h in (4, 3, 9)])) == 2
        assert ack_seq(await new.batch(1, [stored([1, 2]), run_event(stored([3, 4], parent=2), 2)])) == 1
        assert ack_seq(await new.batch(2, [run_event(removed([4, 3, 9]), 3)])) == 2
        assert await export(index, "old") == await export(index, "new")
        assert [h for h, _ in await export(index, "new")] == [1, 2]
        stats = await c.stats()
        assert stats.events_applied == {"block_stored": 6, "block_removed": 6}
        await old.close()
        await new.close()


async def test_max_events_per_batch_counts_the_engine_events_of_a_run(index: Index) -> None:
    async with serving(index, max_events_per_batch=3) as c:
        a = Agent(c)
        await a.start()
        assert ack_seq(await a.batch(1, [run_event(removed([1, 2, 3]), 3)])) == 1  # at the limit
        await a.send(batch=pb.EventBatch(seq=2, events=[run_event(removed([1, 2, 3, 4]), 4)]))
        err = await a.aborted()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "has 4 events" in (err.details() or "")


async def test_reporter_sends_runs_split_around_samples_and_bounds() -> None:
    """Sampling the first 4 chains: those stores go alone with their tokens, the next two as one run
    (no tokens), the ten removals as runs cut where a batch of 8 engine events fills."""
    chain, evs = engine_events()
    port = free_port()
    s = Script()
    async with scripted_server(s, port):
        opts = ReporterOptions(max_batch_events=8, flush_interval=0.005, backoff_initial=0.02,
                               backoff_max=0.1)
        r = Reporter([f"127.0.0.1:{port}"], node_id="n1", model=MODEL, epoch=7, snapshot=lambda rank: [],
                     options=opts)
        await r.start()
        try:
            r.sampler.configure(pb.VerifySample(first=4, every=32, block_size=4))
            ops, spans = op_runs(evs)
            assert spans == [6, 10]
            r.submit(0, evs, ts=1.0, ops=ops, spans=spans)
            await r.wait_acked(TIMEOUT)
            got = batches(s)
        finally:
            await r.close()
    assert wire_counts(got) == [
        [("stored", 1, True)] * 4 + [("stored", 2, False), ("removed", 2, False)],
        [("removed", 8, False)],
    ]
    assert got[0].sampled and not got[1].sampled
    run = got[0].events[4].stored
    assert run.parent_block_hash == chain[7] and run.block_size == 4
    assert [b.events[-1].removed.block_hashes for b in got] == [
        b"".join(h.to_bytes(8, "little") for h in chain[11:9:-1]),
        b"".join(h.to_bytes(8, "little") for h in chain[9:1:-1]),
    ]


async def test_reporter_runs_verify_and_apply_exactly(index: Index) -> None:
    """End to end: the coordinator verifies the sampled stores (the run after them needs no tokens),
    applies every engine event and counts each one."""
    chain, evs = engine_events()
    async with serving(index) as c:
        r = Reporter([c.server.address], node_id="n1", model=MODEL, epoch=1, snapshot=lambda rank: [],
                     options=ReporterOptions(flush_interval=0.001))
        await r.start()
        try:
            await r.wait_connected(TIMEOUT)
            ops, spans = op_runs(evs[:6])
            r.submit(0, evs[:6], ops=ops, spans=spans)
            await r.wait_acked(TIMEOUT)
            assert sorted(h for h, _ in await export(index)) == sorted(chain)
            ops, spans = op_runs(evs[6:])
            r.submit(0, evs[6:], ops=ops, spans=spans)
            await r.wait_acked(TIMEOUT)
        finally:
            await r.close()
        assert sorted(h for h, _ in await export(index)) == sorted(chain[:2])
        stats = await c.stats()
        assert stats.events_applied == {"block_stored": 6, "block_removed": 10}
        assert (await c.node("n1")).state == "active"
        assert c.server.state is not None
        reg = c.server.state.metrics.registry
        assert reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "ok"}) == 4
        assert not reg.get_sample_value("kvcoord_hash_verifications_total", {"result": "mismatch"})


def test_sampled_tokens_go_packed_unless_past_uint32() -> None:
    """A sampled store's token ids go as little-endian uint32; ids a uint32 cannot hold (none a tokenizer
    has) leave the event unverified, with no tokens, instead of failing the batch."""
    from kvcoord.validate import ops_of
    from kvcoord.wire import Sample, event_to_proto

    for tokens, sent in (((1, 2, 0xFFFFFFFF, 0), True), ((), True), ((1, 1 << 32, 3, 4), False),
                         ((-1, 2, 3, 4), False)):
        ev = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=tokens, block_size=4)
        msg = event_to_proto(ops_of([ev])[0], ev, Sample.of(ev)).stored
        assert msg.block_hashes == (7).to_bytes(8, "little") and msg.block_size == 4
        assert msg.token_ids == (b"".join(t.to_bytes(4, "little") for t in tokens) if sent else b"")
