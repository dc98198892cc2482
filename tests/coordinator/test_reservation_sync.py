"""Two replicas' reservation sync (:mod:`kvcoord.coordinator.reservation_sync`) in one process, on a real
``redis-server``'s stream, each round trip driven by the test: a copy's ttl counts from when Redis added
its entry, however late the other replica reads it. The real-process tests are in
test_reservation_replicas.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvcoord.coordinator.reservation_sync import ReservationSync
from kvcoord.coordinator.reservations import Reservations, apply_op
from kvcoord.index.redis.index import RedisIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import pack_u64
from tests.redis_servers import RedisServer

TTL = 60.0


@pytest.fixture
async def syncs(redis_server: RedisServer) -> AsyncIterator[tuple[ReservationSync, ReservationSync]]:
    """Replicas A and B on one stream, both caught up."""
    redis_server.flushall()
    index = RedisIndex.from_uri(redis_server.url, key_prefix="kvsync")
    feed = index.reservation_feed
    assert feed is not None
    out = tuple(ReservationSync(Reservations(), feed, name, lambda *a: None) for name in ("a", "b"))
    try:
        for s in out:
            await s.flush()
        yield out[0], out[1]
    finally:
        await index.close()


def _reserve(sync: ReservationSync, request_id: str, hashes: list[int]) -> None:
    """A router's pick on ``sync``'s replica, as its Reserve stream applies and queues it."""
    op = pb.ReserveOp(request_id=request_id)
    r = op.reserve
    r.model, r.node_id, r.block_hashes, r.prefill_tokens, r.ttl_seconds = "m", "n1", pack_u64(hashes), 9, TTL
    assert apply_op(sync.reservations, "r", op) == ""
    sync.queue("r", op)


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

