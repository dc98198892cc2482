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
- Expiry needs no message: every replica applies the same ttl, counted from when Redis added the entry
  (its id's ms, mapped onto this clock by the ids of this replica's own entries), in normal running as
  at a catch-up: a copy expires when the original does, later only by the time its change took to be
  written, never by the feed's read lag.
- An idle replica writes an empty entry every :data:`HEARTBEAT_SECONDS`; a replica heard from no
  entry for ``silent_seconds`` (config ``replica_silent_seconds``, default 3: killed, or cut off from
  Redis) has every reservation it published dropped. A replica that cannot reach Redis drops the
  others' after the same time.
- A replica that may have been dropped so (its round trip failed, or its entries came
  ``silent_seconds`` apart, less a margin) writes its routers' reservations in force again, in an entry
  marked ``replace``, with their remaining ttls: readers drop what they held of it and apply those, so
  they are seen again after a lone outage, and what was released or ended meanwhile is not brought back.
- A replica that stops cleanly (SIGTERM) writes a last entry with ``gone`` set (within
  :data:`FINAL_SECONDS`; Redis may be down): the others drop its routers' reservations at once.
- A replica catches up before its first round trip, and after Redis was out of its reach for
  ``silent_seconds`` (it dropped the others' meanwhile): it reads the stream back (the longest ttl, as
  much as the stream keeps: ``FEED_ENTRIES``) and replays the entries of the replicas still alive, in
  order, each at the time Redis added it (a stream id carries the server's ms time). So it starts with
  the reservations in force: a release or a stream's end cancels what came before it, ttls run from the
  reservation, and what was released, ended or expired is not brought back. After an outage, a replica
  heard from when this one lost Redis is replayed too (the outage may have silenced it as well).
  Reservations older than what the stream keeps are not seen (they end with their requests, or their
  ttl).
- Holds (a lookup waiting for a concurrent reservation of the same new prefix) are claimed across the
  replicas (:meth:`ReservationSync.claim`: one ``SET NX`` round trip per lookup that holds, only while
  another replica is live and the last round trip to Redis succeeded); a lookup that finds
  another replica's router holding it waits for that pick to come by the feed, which is read every
  :data:`FLUSH_SECONDS` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time

from google.protobuf.message import DecodeError
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcoord.coordinator.health import LogOnce
from kvcoord.coordinator.reservations import MAX_TTL, Reservations, apply_op
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import ReservationFeed
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.waits import wait_event

__all__ = ["FINAL_SECONDS", "FLUSH_SECONDS", "HEARTBEAT_SECONDS", "POLL_SECONDS", "ReservationSync",
           "ReservationSyncCollector"]

FLUSH_SECONDS = 0.005
"""The least time between two flushes (changes queued meanwhile go in one entry)."""
POLL_SECONDS = 0.05
"""The longest time between two reads of the other replicas' entries."""
HEARTBEAT_SECONDS = 1.0
"""An idle replica writes an empty entry this often, so the others know it is alive."""
FINAL_SECONDS = 1.0
"""The longest a stopping replica tries to write its last entry (Redis may be down)."""
MAX_PENDING = 10_000
"""Changes kept for the next flush while Redis does not answer (the oldest go first)."""

log = logging.getLogger("kvcoord.coordinator")


class ReservationSync:
    """This replica's side of the shared reservations: publishes its routers' changes, applies the others'."""

    def __init__(self, reservations: Reservations, feed: ReservationFeed, replica_id: str,
                 log_once: LogOnce, silent_seconds: float = 3.0) -> None:
        self.reservations = reservations
        self.feed = feed
        self.replica_id = replica_id
        self.log_once = log_once
        self.silent_seconds = silent_seconds
        """A replica heard from no entry this long has its reservations dropped here
        (``replica_silent_seconds``)."""
        self._pending: list[pb.ReservationChange] = []
        self._wake = asyncio.Event()
        self._after = ""
        """The stream position read up to ("": catch up first, see :meth:`_catch_up`)."""
        self._last_write = 0.0
        self._last_ok = time.monotonic()
        self._lost_at: float | None = None
        """When this replica last reached Redis before it dropped the others' (the next catch-up's cue)."""
        self._heard: dict[str, float] = {}
        """origin replica -> when its newest entry read was added (this clock)."""
        self._routers: dict[str, set[str]] = {}
        """origin replica -> the router names its changes were applied under here."""
        self._local: set[str] = set()
        """This replica's routers (their streams are here, not ended)."""
        self._republish = False
        """The others may have dropped this replica's reservations: the next entry has them all again."""
        self._offset: float | None = None
        """This clock minus the feed's, as of this replica's last entry (taken when its round trip came
        back, so an entry's time maps here no earlier than it was added); None before any."""
        self._reachable = True
        """The last round trip to Redis (a flush or a claim) succeeded: lookups claim their holds there (in
        an outage they keep to this replica's holds rather than wait on Redis)."""
        self._eager_until = 0.0
        """Until then the feed is read every :data:`FLUSH_SECONDS`: a lookup waits for another replica's
        router's pick."""
        self.counts = {"published": 0, "entries": 0, "applied": 0, "replayed": 0, "rejected": 0,
                       "origin_gone": 0, "origin_dropped": 0, "republished": 0, "errors": 0,
                       "claims": 0, "contested": 0, "claim_errors": 0}
        reservations.outbox = self.queue
        reservations.claim = self.claim

    async def claim(self, model: str, block: BlockHash64, rid: tuple[str, str],
                    seconds: float) -> tuple[tuple[str, str], float] | None:
        """Claim a lookup's new prefix (its first new block) for request ``rid`` across the replicas:
        None when it is this request's (or no other replica is live, Redis is out of reach, or the
        holder's pick already came by the feed), else the request another replica's router holds it
        for, named as its changes are applied here, and the seconds its claim has left."""
        if not self._heard or not self._reachable or "\0" in rid[0]:
            return None
        mine = f"{self.replica_id}/{rid[0]}\0{rid[1]}".encode()
        try:
            async with asyncio.timeout(seconds):
                got = await self.feed.claim(f"{model}:{block:x}", mine, seconds)
        except (ConnectionError, TimeoutError) as exc:
            self._reachable = False  # until a flush gets through
            self.counts["claim_errors"] += 1
            self.log_once("reservation-claim-fail", logging.WARNING, "reservation feed: a lookup's hold was "
                          "not claimed across replicas (%s); it holds on this replica only",
                          str(exc) or f"no answer in {seconds:g}s")
            return None
        self.counts["claims"] += 1
        if got is None:
            return None
        name, sep, request_id = got[0].decode(errors="replace").partition("\0")
        if not sep or name.startswith(f"{self.replica_id}/") or self.reservations.settled((name, request_id)):
            return None  # this replica's own (its local hold is the word on it), or its pick is in
        self.counts["contested"] += 1
        # never earlier than it was: an earlier lookup may still wait on another replica's pick
        self._eager_until = max(self._eager_until, time.monotonic() + min(seconds, got[1]))
        self._wake.set()
        return (name, request_id), got[1]

    def queue(self, router: str, op: pb.ReserveOp | None) -> None:
        """One change a router's stream applied here (``op`` None: its stream ended), for the next flush."""
        change = pb.ReservationChange(router_id=router)
        if op is not None:
            change.op.CopyFrom(op)
            self._local.add(router)
        else:
            self._local.discard(router)
        self._pending.append(change)
        self._wake.set()

    async def flush(self) -> None:
        """One round trip (after a catch-up when due): write the queued changes (or a heartbeat when due;
        or, when the others may have dropped this replica's reservations, all of them again), read the
        others' since."""
        if not self._after:
            await self._catch_up()
        now = time.monotonic()
        republish = self._republish
        if republish:  # the live reservations supersede every change queued
            self._pending = []
            changes = [pb.ReservationChange(router_id=router, op=op)
                       for router, op in self.reservations.live_ops(self._local)]
        else:
            changes, self._pending = self._pending, []
        entry: bytes | None = None
        if republish or changes or now - self._last_write >= HEARTBEAT_SECONDS:
            msg = pb.ReservationChanges(replica_id=self.replica_id, replace=republish)
            msg.changes.extend(changes)
            entry = msg.SerializeToString()
        try:
            self._after, added, entries = await self.feed.exchange(entry, self._after)
        except BaseException:
            if not republish:
                self._pending[:0] = changes  # written at the next flush, in order
                del self._pending[:-MAX_PENDING]
            raise
        back = time.monotonic()
        if entry is not None:
            self._wrote(now, republish, len(changes))
        if added is not None:
            self._offset = back - added
        for when, raw in entries:
            if (got := self._decode(raw)) is not None:
                self._apply(got, self._here(when, back))
        self._last_ok, self._reachable = back, True
        self._drop_silent(back)

    def _here(self, when: float, now: float) -> float | None:
        """An entry's time (the feed's clock) on this clock, never ahead of ``now``; None: unknown yet
        (applied as of now)."""
        return None if self._offset is None else min(now, when + self._offset)

    def _wrote(self, started: float, republished: bool, changes: int) -> None:
        """An entry was written (its round trip ``started`` then). One that came ``silent_seconds`` (less
        a margin) after the one before may have come after the others dropped this replica's
        reservations (this replica stalled, or its writes were slow): the next entry has them again."""
        if republished:
            self._republish = False
            self.counts["republished"] += changes
            log.info("reservation feed: this replica's routers' live reservations written again (%d "
                     "changes), as the other replicas may have dropped them", changes)
        elif self.counts["entries"] and (time.monotonic() - self._last_write
                                         >= self.silent_seconds - HEARTBEAT_SECONDS / 2):
            self._republish = True
            self._wake.set()
        self._last_write = started
        self.counts["published"] += changes
        self.counts["entries"] += 1

    async def _catch_up(self) -> None:
        """Rebuild the other replicas' live reservations from the stream: at start, and after this replica
        dropped them while cut off from Redis. The entries of the longest ttl back (as many as the stream
        keeps) are replayed in order, each at the time Redis added it, so a release or a stream's end
        cancels the reservation before it, a ttl runs from the reservation, and what was released, ended
        or expired stays so. Replicas gone (a ``gone`` entry) or silent by then are skipped; the view of
        the others is rebuilt from nothing, so no reservation counts twice. After an outage, a replica
        heard from when this one lost Redis counts as alive (the outage may have silenced it too) and has
        ``silent_seconds`` from now to be heard again."""
        beat = pb.ReservationChanges(replica_id=self.replica_id).SerializeToString()
        after, added, entries = await self.feed.history(beat, MAX_TTL)
        now = time.monotonic()
        self._last_write, self._offset = now, now - added
        self.counts["entries"] += 1
        msgs = [(min(now, when + self._offset), msg) for when, raw in entries
                if (msg := self._decode(raw)) is not None and msg.replica_id != self.replica_id]
        newest: dict[str, float] = {}
        for at, msg in msgs:
            if msg.gone:
                newest.pop(msg.replica_id, None)
            else:
                newest[msg.replica_id] = at
        alive_since = now - self.silent_seconds
        if self._lost_at is not None:
            alive_since = min(alive_since, self._lost_at - self.silent_seconds)
        live = {origin for origin, at in newest.items() if at > alive_since}
        for origin in {*self._routers, *self._heard}:
            self._forget(origin)
        replayed = [(at, msg) for at, msg in msgs if msg.replica_id in live]
        for at, msg in replayed:
            self._apply(msg, at)
        if self._lost_at is not None:
            self._heard.update(dict.fromkeys(live, now))
            self._lost_at = None
        self.counts["replayed"] += len(replayed)
        self._after = after
        log.info("reservation feed: caught up on %d entries of %d other live replicas (%d requests in "
                 "flight here now, this replica's routers' too)", len(replayed), len(live),
                 self.reservations.totals()[0])

    def _decode(self, raw: bytes) -> pb.ReservationChanges | None:
        try:
            msg = pb.ReservationChanges.FromString(raw)
        except DecodeError as exc:
            self._reject(f"an undecodable reservation feed entry ({exc})")
            return None
        if not msg.replica_id:
            self._reject("a reservation feed entry without its replica id")
            return None
        return msg

    def _apply(self, msg: pb.ReservationChanges, at: float | None) -> None:
        """Another replica's entry, added at ``at`` (None: just now); a ``replace`` entry supersedes all
        of that replica's before it."""
        origin = msg.replica_id
        if origin == self.replica_id:
            return
        if msg.gone:
            n = self._forget(origin)
            self.counts["origin_gone"] += 1
            log.info("replica %s stopped: its routers' %d reservations dropped here", origin, n)
            return
        if msg.replace:  # all its routers' reservations follow: none kept from before
            n = self._forget(origin)
            log.info("replica %s wrote its routers' live reservations again (%d changes; %d of its "
                     "reservations were here)", origin, len(msg.changes), n)
        self._heard[origin] = time.monotonic() if at is None else at
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
            reason = apply_op(res, name, change.op, at)
            if reason:
                self._reject(reason)
                continue
            routers.add(name)
            self.counts["applied"] += 1

    def _reject(self, reason: str) -> None:
        self.counts["rejected"] += 1
        self.log_once(f"reservation-feed:{reason[:60]}", logging.WARNING,
                      "reservation feed: %s (counted, logged once)", reason)

    def _forget(self, origin: str) -> int:
        """Every reservation of ``origin``'s routers goes; returns how many."""
        self._heard.pop(origin, None)
        return sum(self.reservations.drop_router(name) for name in self._routers.pop(origin, ()))

    def _drop_silent(self, now: float) -> None:
        for origin, heard in list(self._heard.items()):
            if now - heard < self.silent_seconds:
                continue
            n = self._forget(origin)
            self.counts["origin_dropped"] += n
            log.info("replica %s silent for %.0fs: its routers' %d reservations dropped here", origin,
                     now - heard, n)

    async def loop(self) -> None:
        """Flush when changes are queued (at most every :data:`FLUSH_SECONDS`), else every
        :data:`POLL_SECONDS`; a failed round trip is counted, logged once, and retried (after a catch-up,
        once Redis was out of reach for ``silent_seconds``)."""
        while True:
            eager = time.monotonic() < self._eager_until
            await wait_event(self._wake, FLUSH_SECONDS if eager else POLL_SECONDS)
            self._wake.clear()
            started = time.monotonic()
            try:
                await self.flush()
            except Exception as exc:
                self.counts["errors"] += 1
                self._reachable = False
                self._republish = True  # an outage may silence this replica to the others
                self.log_once("reservation-feed-fail", logging.WARNING,
                              "reservation feed unavailable (other replicas' reservations are dropped "
                              "after %gs): %s", self.silent_seconds, exc)
                now = time.monotonic()
                self._drop_silent(now)
                if now - self._last_ok >= self.silent_seconds and self._after:
                    self._after = ""  # the entries missed meanwhile are replayed when Redis answers
                    self._lost_at = self._last_ok
                await asyncio.sleep(POLL_SECONDS)
            await asyncio.sleep(max(0.0, started + FLUSH_SECONDS - time.monotonic()))

    async def close(self) -> None:
        """This replica stops (its routers' streams ended): its last entry says so (``gone``), and the
        others drop every reservation it published at once rather than after ``silent_seconds``.
        Bounded by :data:`FINAL_SECONDS`, as Redis may be down; call it once :meth:`loop` is done."""
        if not self.counts["entries"]:
            return  # it never wrote: the others know nothing of it
        gone = pb.ReservationChanges(replica_id=self.replica_id, gone=True).SerializeToString()
        try:
            await asyncio.wait_for(self.feed.append(gone), FINAL_SECONDS)
        except (TimeoutError, ConnectionError) as exc:
            log.warning("reservation feed: this replica's last entry was not written (%s); the others drop "
                        "its routers' reservations after %gs", str(exc) or f"no answer in {FINAL_SECONDS:g}s",
                        self.silent_seconds)
            return
        self.counts["entries"] += 1


class ReservationSyncCollector(Collector):
    """``kvcoord_reservation_sync_total{op}``: what this replica shared with the others."""

    def __init__(self, sync: ReservationSync) -> None:
        self.sync = sync

    def collect(self) -> list[Metric]:
        c = CounterMetricFamily("kvcoord_reservation_sync", "Reservations shared between coordinator "
                                "replicas (Redis): published (this replica's routers' changes written), "
                                "entries (stream entries written, heartbeats too), applied (other replicas' "
                                "changes applied here), replayed (other replicas' entries read back at a "
                                "catch-up), rejected (undecodable or refused changes), origin_gone (stop "
                                "entries of other replicas: their reservations dropped at once), "
                                "origin_dropped (reservations of a replica gone silent), republished "
                                "(changes of this replica's routers' live reservations written again, as the "
                                "others may have dropped them), errors (failed round trips), claims "
                                "(lookups' holds claimed across replicas), contested (claims another "
                                "replica's router held, its pick not here yet: the lookup waited for it), "
                                "claim_errors "
                                "(claims Redis did not answer: held on this replica only)", labels=["op"])
        for op, n in self.sync.counts.items():
            c.add_metric([op], n)
        return [c]
