"""Routers' reservations shared by coordinator replicas on one Redis index, so that routers connected to
different replicas see each other's picks (docs/routing.md, "Routers that share one view").

Each replica keeps every reservation in memory (:class:`~kvcoord.coordinator.reservations.Reservations`):
lookups read only that, never Redis. What its own routers' streams apply (reserve, release, a router's
stream ended) is queued here (``Reservations.outbox``) and written as one entry of the index's
``reservation_feed`` (a Redis stream per index) per flush; the same round trip reads the entries the
other replicas wrote since, which are applied to this replica's view under the router name
``<origin replica>/<router>``. So a router's own load, which it counts itself, is never subtracted
from another replica's copy of it, and a router that moves to another replica is not dropped there when
its old stream's end arrives.

- A flush runs as soon as changes are queued (at most every :data:`FLUSH_SECONDS`, so a busy replica
  coalesces many changes into one entry), and at least every :data:`POLL_SECONDS` to read the others.
- Expiry needs no message: every replica applies the same ttl (counted from when it applied the
  reservation, so a copy outlives the original by the feed's lag at most).
- An idle replica writes an empty entry every :data:`HEARTBEAT_SECONDS`; a replica heard from no
  entry for :data:`ORIGIN_SILENT_SECONDS` (killed, or cut off from Redis) has every reservation it
  published dropped. A replica that cannot reach Redis drops the others' after the same time.
- A replica starts reading at the stream's end: reservations made before it started are not seen there
  (they end with their requests, or their ttl).
- Holds (a lookup waiting for a concurrent reservation of the same new prefix) stay per replica: across
  replicas the window is the feed's lag (a flush plus a poll, a few ms to :data:`POLL_SECONDS`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from google.protobuf.message import DecodeError
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcoord.coordinator.health import LogOnce
from kvcoord.coordinator.reservations import Reservations, apply_op
from kvcoord.index.base import ReservationFeed
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.waits import wait_event

__all__ = ["FLUSH_SECONDS", "HEARTBEAT_SECONDS", "ORIGIN_SILENT_SECONDS", "POLL_SECONDS", "ReservationSync",
           "ReservationSyncCollector"]

FLUSH_SECONDS = 0.005
"""The least time between two flushes (changes queued meanwhile go in one entry)."""
POLL_SECONDS = 0.05
"""The longest time between two reads of the other replicas' entries."""
HEARTBEAT_SECONDS = 1.0
"""An idle replica writes an empty entry this often, so the others know it is alive."""
ORIGIN_SILENT_SECONDS = 3.0
"""A replica not heard from for this long has its reservations dropped everywhere else."""
MAX_PENDING = 10_000
"""Changes kept for the next flush while Redis does not answer (the oldest go first)."""

log = logging.getLogger("kvcoord.coordinator")


class ReservationSync:
    """This replica's side of the shared reservations: publishes its routers' changes, applies the others'."""

    def __init__(self, reservations: Reservations, feed: ReservationFeed, replica_id: str,
                 log_once: LogOnce) -> None:
        self.reservations = reservations
        self.feed = feed
        self.replica_id = replica_id
        self.log_once = log_once
        self._pending: list[pb.ReservationChange] = []
        self._wake = asyncio.Event()
        self._after = ""
        """The stream position read up to ("": not known yet)."""
        self._last_write = 0.0
        self._heard: dict[str, float] = {}
        """origin replica -> when an entry of it was last read (monotonic)."""
        self._routers: dict[str, set[str]] = {}
        """origin replica -> the router names its changes were applied under here."""
        self.counts = {"published": 0, "entries": 0, "applied": 0, "rejected": 0, "origin_dropped": 0,
                       "errors": 0}
        reservations.outbox = self.queue

    def queue(self, router: str, op: pb.ReserveOp | None) -> None:
        """One change a router's stream applied here (``op`` None: its stream ended), for the next flush."""
        change = pb.ReservationChange(router_id=router)
        if op is not None:
            change.op.CopyFrom(op)
        self._pending.append(change)
        self._wake.set()

    async def flush(self) -> None:
        """One round trip: write the queued changes (or a heartbeat when due), read the others' since."""
        now = time.monotonic()
        if not self._after:
            self._after = await self.feed.tail()
        changes, self._pending = self._pending, []
        entry: bytes | None = None
        if changes or now - self._last_write >= HEARTBEAT_SECONDS:
            msg = pb.ReservationChanges(replica_id=self.replica_id)
            msg.changes.extend(changes)
            entry = msg.SerializeToString()
        try:
            self._after, entries = await self.feed.exchange(entry, self._after)
        except BaseException:
            self._pending[:0] = changes  # written at the next flush, in order
            del self._pending[:-MAX_PENDING]
            raise
        if entry is not None:
            self._last_write = now
            self.counts["published"] += len(changes)
            self.counts["entries"] += 1
        for raw in entries:
            self._apply_entry(raw)
        self._drop_silent(time.monotonic())

    def _apply_entry(self, raw: bytes) -> None:
        try:
            msg = pb.ReservationChanges.FromString(raw)
        except DecodeError as exc:
            self._reject(f"an undecodable reservation feed entry ({exc})")
            return
        origin = msg.replica_id
        if not origin:
            self._reject("a reservation feed entry without its replica id")
            return
        if origin == self.replica_id:
            return
        self._heard[origin] = time.monotonic()
        routers = self._routers.setdefault(origin, set())
        res = self.reservations
        for change in msg.changes:
            if not change.router_id:
                self._reject("a reservation change without its router id")
                continue
            name = f"{origin}/{change.router_id}"
            if not change.HasField("op"):
                res.drop_router(name)
                routers.discard(name)
                self.counts["applied"] += 1
                continue
            reason = apply_op(res, name, change.op)
            if reason:
                self._reject(reason)
                continue
            routers.add(name)
            self.counts["applied"] += 1

    def _reject(self, reason: str) -> None:
        self.counts["rejected"] += 1
        self.log_once(f"reservation-feed:{reason[:60]}", logging.WARNING,
                      "reservation feed: %s (counted, logged once)", reason)

    def _drop_silent(self, now: float) -> None:
        for origin, heard in list(self._heard.items()):
            if now - heard < ORIGIN_SILENT_SECONDS:
                continue
            del self._heard[origin]
            n = sum(self.reservations.drop_router(name) for name in self._routers.pop(origin, ()))
            self.counts["origin_dropped"] += n
            log.info("replica %s silent for %.0fs: its routers' %d reservations dropped here", origin,
                     now - heard, n)

    async def loop(self) -> None:
        """Flush when changes are queued (at most every :data:`FLUSH_SECONDS`), else every
        :data:`POLL_SECONDS`; a failed round trip is counted, logged once, and retried."""
        while True:
            await wait_event(self._wake, POLL_SECONDS)
            self._wake.clear()
            started = time.monotonic()
            try:
                await self.flush()
            except Exception as exc:
                self.counts["errors"] += 1
                self.log_once("reservation-feed-fail", logging.WARNING,
                              "reservation feed unavailable (other replicas' reservations are dropped "
                              "after %gs): %s", ORIGIN_SILENT_SECONDS, exc)
                self._drop_silent(time.monotonic())
                await asyncio.sleep(POLL_SECONDS)
            await asyncio.sleep(max(0.0, started + FLUSH_SECONDS - time.monotonic()))


class ReservationSyncCollector(Collector):
    """``kvcoord_reservation_sync_total{op}``: what this replica shared with the others."""

    def __init__(self, sync: ReservationSync) -> None:
        self.sync = sync

    def collect(self) -> list[Metric]:
        c = CounterMetricFamily("kvcoord_reservation_sync", "Reservations shared between coordinator "
                                "replicas (Redis): published (this replica's routers' changes written), "
                                "entries (stream entries written, heartbeats too), applied (other replicas' "
                                "changes applied here), rejected (undecodable or refused changes), "
                                "origin_dropped (reservations of a replica gone silent), errors (failed "
                                "round trips)", labels=["op"])
        for op, n in self.sync.counts.items():
            c.add_metric([op], n)
        return [c]
