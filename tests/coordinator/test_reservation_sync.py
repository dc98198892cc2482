"""Two replicas' reservation sync (:mod:`kvcoord.coordinator.reservation_sync`) in one process, on a real
``redis-server``'s stream, each round trip driven by the test: a copy's ttl counts from when Redis added
its entry, however late the other replica reads it; a lookup's hold on a new prefix is claimed across the
replicas, and a lookup on the other waits for that pick (or its release) to come by the feed. The
real-process tests are in test_reservation_replicas.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from kvcoord.coordinator.reservation_sync import ReservationSync
from kvcoord.coordinator.reservations import Reservations, Reserved, apply_op
from kvcoord.index.redis.index import RedisIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import pack_u64
from tests.procs import until_async
from tests.redis_servers import RedisServer
from tests.redis_servers import redis_server as own_redis_server

TTL = 60.0
SILENT = 600.0
"""``silent_seconds`` here: no replica loop writes heartbeats, so a stalled test must not drop the other."""


@pytest.fixture
async def syncs(redis_server: RedisServer) -> AsyncIterator[tuple[ReservationSync, ReservationSync]]:
    """Replicas A and B on one stream, both caught up."""
    redis_server.flushall()
    index = RedisIndex.from_uri(redis_server.url, key_prefix="kvsync")
    feed = index.reservation_feed
    assert feed is not None
    out = tuple(ReservationSync(Reservations(), feed, name, lambda *a: None, SILENT) for name in ("a", "b"))
    try:
        for s in out:
            await s.flush()
        yield out[0], out[1]
    finally:
        await index.close()


def _reserve(sync: ReservationSync, request_id: str, hashes: list[int], router: str = "r") -> None:
    """A router's pick on ``sync``'s replica, as its Reserve stream applies and queues it."""
    op = pb.ReserveOp(request_id=request_id)
    r = op.reserve
    r.model, r.node_id, r.block_hashes, r.prefill_tokens, r.ttl_seconds = "m", "n1", pack_u64(hashes), 9, TTL
    assert apply_op(sync.reservations, router, op) == ""
    sync.queue(router, op)


def _release(sync: ReservationSync, request_id: str, router: str) -> None:
    """A router's release of a pick at its end (or of one it never made: it placed otherwise), as its
    stream queues it."""
    op = pb.ReserveOp(request_id=request_id, release=pb.Release())
    assert apply_op(sync.reservations, router, op) == ""
    sync.queue(router, op)


async def test_a_copy_expires_with_its_original_however_late_it_is_read(
        syncs: tuple[ReservationSync, ReservationSync]) -> None:
    a, b = syncs
    _reserve(a, "q1", list(range(16)))
    await a.flush()
    written = time.monotonic()
    await asyncio.sleep(0.5)  # B reads it late
    read = time.monotonic()
    await b.flush()
    original = a.reservations._entries[("r", "q1")].expires
    copy = b.reservations._entries[("a/r", "q1")].expires
    # From Redis' time of the entry (after A's pick: never before the original's deadline, less a ms of
    # rounding), not from B's read half a second after A's write came back.
    assert original - 0.002 <= copy < read + TTL
    assert read - written >= 0.5



async def test_a_hold_is_claimed_across_replicas_and_the_others_lookup_waits_for_its_pick(
        syncs: tuple[ReservationSync, ReservationSync]) -> None:
    a, b = syncs
    for s in (a, b):
        s.reservations.hold_seconds = 60.0  # no wait here ends by time: only the feed's changes end them
    alone = list(range(300, 316))
    await a.reservations.hold("r1", "q0", "m", alone, 0, 60.0)
    assert a.counts["claims"] == 0  # A has heard of no other replica yet: no round trip
    await a.flush()  # A reads B's first entry
    for prompt, pick in ((list(range(200, 216)), True), (list(range(400, 416)), False)):
        await a.reservations.hold("r1", f"q{pick}", "m", prompt, 0, 60.0)  # A's router looked it up
        waiting = asyncio.create_task(b.reservations.hold("r2", "x", "m", prompt, 0, 60.0))

        async def waits(n: int = 1 + (not pick)) -> bool:
            return b.counts["contested"] == n and b.reservations.counts["waited"] == n

        await until_async(waits, "B's lookup waiting on A's router's claim", timeout=30)
        assert not waiting.done()  # it waits for A's router: only B's next read can end that
        if pick:
            _reserve(a, "qTrue", prompt, router="r1")
        else:
            _release(a, "qFalse", router="r1")
        await a.flush()
        await b.flush()
        await asyncio.wait_for(waiting, 30)
        seen = b.reservations.overlay("m", prompt, 0, "r2")
        # the pick's blocks and load; after the release, only the first round's request as load
        assert seen == {("n1", 0): Reserved(16 if pick else 0, 1, 9)}
    assert a.counts["claims"] == 2 and a.counts["contested"] == 0
    assert b.counts["claims"] == 2 and b.reservations.counts["waited"] == 2


async def test_a_pick_that_came_before_the_claim_was_found_is_not_waited_for(
        syncs: tuple[ReservationSync, ReservationSync]) -> None:
    """The claim key lives its whole hold (60 s here), but the holder's answer is already in: a release of
    a pick never made, and a reservation completed and gone past its blocks' hold. B's lookups find the
    claims and do not wait (30 s bounds them; they would wait 60)."""
    a, b = syncs
    shift = [0.0]
    b.reservations.clock = lambda: time.monotonic() + shift[0]
    for s in (a, b):
        s.reservations.hold_seconds = 60.0
    await a.flush()  # A reads B's first entry: claims go to Redis
    placed_elsewhere, done = list(range(1000, 1016)), list(range(1100, 1116))
    await a.reservations.hold("r1", "q1", "m", placed_elsewhere, 0, 60.0)
    await a.reservations.hold("r1", "q2", "m", done, 0, 60.0)
    _release(a, "q1", router="r1")
    _reserve(a, "q2", done, router="r1")
    _release(a, "q2", router="r1")
    await a.flush()
    await b.flush()
    shift[0] = 10.0  # past the blocks' hold (BLOCK_HOLD): B drops q2's entry
    assert b.reservations.totals() == (0, 0, 0)
    for prompt in (placed_elsewhere, done):
        await asyncio.wait_for(b.reservations.hold("r2", "x", "m", prompt, 0, 60.0), 30)
    assert b.counts["claims"] == 2 and b.counts["contested"] == 0 and b.reservations.counts["waited"] == 0


async def test_a_claim_near_its_end_does_not_slow_the_reads_an_earlier_wait_needs(
        syncs: tuple[ReservationSync, ReservationSync]) -> None:
    """B's first lookup waits on A's 60 s claim; its second finds a claim with 5 s left. The feed must still
    be read at the waiting pace for the first (until the later of the two), not drop to the idle poll."""
    a, b = syncs
    for s in (a, b):
        s.reservations.hold_seconds = 60.0
    await a.flush()
    first, second = list(range(1200, 1216)), list(range(1300, 1316))
    await a.reservations.hold("r1", "q1", "m", first, 0, 60.0)
    assert b.feed.claim is not None and await b.feed.claim(f"m:{second[0]:x}", b"a/r1\0q2", 5.0) is None
    waits = [asyncio.create_task(b.reservations.hold("r0", "x", "m", first, 0, 60.0))]

    async def contested(n: int) -> bool:
        return b.counts["contested"] == n

    await until_async(lambda: contested(1), "B's first lookup finding A's claim", timeout=30)
    eager = b._eager_until
    waits.append(asyncio.create_task(b.reservations.hold("r9", "x", "m", second, 0, 60.0)))
    await until_async(lambda: contested(2), "B's second lookup finding the short claim", timeout=30)
    assert b._eager_until >= eager
    for request_id in ("q1", "q2"):
        _release(a, request_id, router="r1")
    await a.flush()
    await b.flush()
    await asyncio.wait_for(asyncio.gather(*waits), 30)


async def test_concurrent_lookups_on_one_replica_wait_for_the_first_not_for_redis(
        syncs: tuple[ReservationSync, ReservationSync]) -> None:
    """A burst of one new prefix on one replica: the first lookup holds it before its claim's round trip,
    so the others wait for its pick here (one claim, no second holder)."""
    a, _ = syncs
    await a.flush()  # A reads B's first entry: claims go to Redis
    a.reservations.hold_seconds = 60.0
    prompt = list(range(500, 516))
    burst = [asyncio.create_task(a.reservations.hold(f"r{i}", "q", "m", prompt, 0, 60.0)) for i in range(3)]
    await asyncio.wait(burst[:1])

    async def both_wait() -> bool:
        return a.reservations.counts["waited"] == 2

    await until_async(both_wait, "the burst's other lookups waiting on r0's hold", timeout=30)
    assert not any(t.done() for t in burst[1:])  # waiting for r0's pick
    _reserve(a, "q", prompt, router="r0")
    await asyncio.wait_for(asyncio.gather(*burst), 30)
    assert a.counts["claims"] == 1 and a.reservations.counts["waited"] == 2


async def test_a_claim_redis_does_not_answer_is_counted_and_later_lookups_hold_here() -> None:
    """Redis paused: the claim gets no answer within the hold's time, is counted and logged once, and the
    lookup holds on this replica; later lookups make no round trip until a flush gets through again."""
    with own_redis_server() as server:
        assert server.proc is not None
        index = RedisIndex.from_uri(server.url + "?timeout=60", key_prefix="kvclaim")
        feed = index.reservation_feed
        assert feed is not None
        logged: list[str] = []

        def log_once(key: str, level: int, msg: str, *args: object) -> None:
            logged.append(msg % args)

        a, b = (ReservationSync(Reservations(hold_seconds=0.3), feed, name, log_once, SILENT)
                for name in ("a", "b"))
        try:
            for s in (a, b, a):
                await s.flush()  # each has heard of the other
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                # the lookup may wait longer than the claim's own bound (the hold's time): it sees it fail
                await a.reservations.hold("r1", "q1", "m", list(range(600, 616)), 0, 30.0)
                await a.reservations.hold("r1", "q2", "m", list(range(700, 716)), 0, 30.0)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert (a.counts["claims"], a.counts["claim_errors"], a.reservations.counts["held"]) == (0, 1, 2)
            assert len(logged) == 1 and "not claimed across replicas" in logged[0]
            await a.flush()
            await a.reservations.hold("r1", "q3", "m", list(range(800, 816)), 0, 30.0)
            assert (a.counts["claims"], a.counts["claim_errors"]) == (1, 1)
            # A lookup waits no longer than it may, however long the claim takes; the claim goes on.
            a.reservations.hold_seconds = 60.0
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(a.reservations.hold("r1", "q4", "m", list(range(900, 916)), 0, 0.05),
                                       30)
                await asyncio.wait_for(a.reservations.hold("r1", "q5", "m", list(range(950, 966)), 0, 0.0),
                                       30)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)

            async def claimed() -> bool:
                return a.counts["claims"] == 3

            await until_async(claimed, "both claims answered once Redis is back", timeout=30)
        finally:
            await index.close()
