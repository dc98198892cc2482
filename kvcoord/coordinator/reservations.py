"""Routers' reservations: the picks every router made and the engines have not reported yet, shared
through lookup answers so that several ``kvcoord route`` / ``kvcoord epp`` replicas place as one.

A router reserves each pick on its ``Reserve`` stream (one long-lived client stream, never awaited per
request): the node, the prompt's blocks beyond what the index showed, and the predicted prefill. Lookups
from *other* routers then see, per node, the requests in flight there, their prefill not yet done, and the
leading query blocks routed there but not yet reported by events ("about to be cached on node X").

Lifetimes, like Dynamo's active sequences:
- the prefill part ends at the request's first byte, the request part when it completes;
- the blocks stay ``BLOCK_HOLD`` seconds past completion (the engine's events may still be on the wire),
  then the index is the only word on them;
- everything expires after the router's ttl, and when its stream ends (a killed router's TCP connection
  closes; the ttl covers a router that froze with its connection open).

The window between a lookup and its reservation is closed by a *hold*: a lookup that names the request
id it will reserve (``reserve_id``) holds the new prefix it asked about (its first block the index does
not show) until that reservation arrives, or ``HOLD_SECONDS`` pass; any other lookup of the same new
prefix (another router's, or the same router's next request) waits for it, so it sees the pick.
Uncontested lookups never wait.

Reservations live in memory, not in the index. On the Redis backend, replicas share them: each replica
hands what its routers' streams applied (:attr:`Reservations.outbox`) to
:mod:`kvcoord.coordinator.reservation_sync`, which publishes it and applies the other replicas' changes
here, under router names prefixed by their origin replica (docs/routing.md, "Routers that share one view").
A hold is claimed across the replicas too (one Redis round trip for the lookup, only while another replica
is live), so a lookup on one replica waits for a pick made through another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import InvalidEvent, pack_u64, unpack_u64
from kvcoord.waits import wait_event

__all__ = ["BLOCK_HOLD", "HOLD_SECONDS", "MAX_TTL", "ReservationCollector", "Reservations", "Reserved",
           "apply_op", "lookup_view"]

HOLD_SECONDS = 0.25
"""How long a lookup's hold on a new prefix makes another router's lookup of it wait at most."""
BLOCK_HOLD = 5.0
"""Seconds a completed request's blocks still count as routed (its engine's events may lag)."""
MAX_TTL = 3600.0
"""The longest ttl a router may ask for."""
STRIDE = 4
"""Only every ``STRIDE``-th query position (3, 7, 11, ...) of a reservation is kept: a block hash names
its whole prefix, so a hit there means every block before it is reserved too. A lookup sees reserved
depths rounded down to a checkpoint (at most ``STRIDE - 1`` blocks short), for a quarter of the work
and memory per request."""

Rid = tuple[str, str]
"""``(router_id, request_id)``."""
Claim = Callable[[str, BlockHash64, Rid, float], Awaitable[tuple[Rid, float] | None]]
"""``(model, first new block, request, seconds) -> None`` when claimed, else ``(holder, seconds left)``."""


@dataclass(slots=True)
class _Entry:
    model: str
    key: NodeKey
    first: int
    hashes: tuple[BlockHash64, ...]
    prefill: int
    expires: float
    blocks_expire: float
    running: bool = True


@dataclass(slots=True)
class _Hold:
    router: str
    hash: tuple[str, BlockHash64]
    expires: float
    done: asyncio.Event | None = None
    """Made by the first lookup that waits for this hold (most holds are never waited for)."""


@dataclass(frozen=True, slots=True)
class Reserved:
    """Reservations on one node, for one query: blocks routed there by any router, other routers'
    requests and prefill."""

    blocks: int = 0
    requests: int = 0
    prefill_tokens: int = 0


class Reservations:
    """Every router's reservations on this coordinator. One event loop: no locks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 hold_seconds: float = HOLD_SECONDS) -> None:
        self.clock = clock
        self.hold_seconds = hold_seconds
        """How long a lookup's hold on a new prefix lasts, and so the longest another lookup waits on it."""
        self.claim: Claim | None = None
        """Claims a new prefix for a lookup across replicas (the replicas' sync): None when this lookup
        holds it, else the holding request as this replica names it and the seconds its claim has left;
        None: one process."""
        self._claims: set[asyncio.Future[tuple[Rid, float] | None]] = set()
        """Claims under way (kept referenced until done)."""
        self._settled: dict[Rid, float] = {}
        """With replicas: requests whose pick came (reserved or released) -> until when that still
        answers a claim on their prefix (its hold's time: a claim key outlives neither). A pick that
        came before a lookup found its claim, or whose entry is gone, is not waited for."""
        self._entries: dict[Rid, _Entry] = {}
        self._blocks: dict[str, dict[BlockHash64, Rid]] = {}
        """``model -> {block hash -> the latest reservation routing it}``: one holder per block (the
        latest pick of a prefix is where it is about to be cached), and no container per block, which
        the garbage collector would walk."""
        self._load: dict[tuple[str, NodeKey], dict[str, list[int]]] = {}
        """``(model, node) -> {router: [requests, prefill tokens]}``, running requests only."""
        self._holds: dict[Rid, _Hold] = {}
        self._held: dict[tuple[str, BlockHash64], Rid] = {}
        self._next_sweep = 0.0
        self.outbox: Callable[[str, pb.ReserveOp | None], None] | None = None
        """Told every operation a router's stream applied here, and ``None`` when its stream ended (the
        replicas' sync publishes them); None: nobody listens (one process)."""
        self.counts = {"reserved": 0, "released": 0, "expired": 0, "dropped": 0, "rejected": 0,
                       "held": 0, "waited": 0}

    # ------------------------------------------------------------------ writes (the Reserve stream)
    def reserve(self, router: str, request_id: str, model: str, key: NodeKey, first: int,
                hashes: Sequence[BlockHash64], prefill: int, ttl: float, at: float | None = None) -> str:
        """Record one pick made at ``at`` (this clock; None: now), its ttl counted from then; "" or the
        one-line reason it was refused. A pick whose ttl has passed already replaces the request's
        earlier one and is not kept."""
        if not router or not request_id or not model or not key[0]:
            return "a reservation needs router_id, request_id, model and node_id"
        if not 0 < ttl <= MAX_TTL:
            return f"ttl_seconds must be in (0, {MAX_TTL:g}], got {ttl:g}"
        now = self.clock()
        expires = (now if at is None else min(at, now)) + ttl
        rid = (router, request_id)
        self._drop(rid)
        self._resolve(rid)
        self._settle(rid, now)
        if expires <= now:
            return ""
        # Checkpoints only (see STRIDE): block ``first + j`` sits at query position ``first + j``.
        marks = tuple(hashes[(STRIDE - 1 - first) % STRIDE::STRIDE])
        entry = _Entry(model, key, first, marks, prefill, expires, expires)
        self._entries[rid] = entry
        self._blocks.setdefault(model, {}).update(dict.fromkeys(entry.hashes, rid))
        per = self._load.setdefault((model, key), {}).setdefault(router, [0, 0])
        per[0] += 1
        per[1] += prefill
        self.counts["reserved"] += 1
        self._sweep(now)
        return ""

    def release(self, router: str, request_id: str, *, first_byte: bool, at: float | None = None) -> None:
        """The request's first byte (its prefill is done) or its end, at ``at`` (None: now); unknown ids
        are no-ops."""
        rid = (router, request_id)
        self._resolve(rid)  # a pick that was never made (the router placed otherwise): no more waiting
        self._settle(rid, self.clock())
        entry = self._entries.get(rid)
        if entry is None or not entry.running:
            return
        if first_byte:
            self._load[(entry.model, entry.key)][router][1] -= entry.prefill
            entry.prefill = 0
            return
        self._unload(rid, entry)
        now = self.clock()
        entry.blocks_expire = min(entry.expires, (now if at is None else min(at, now)) + BLOCK_HOLD)
        self.counts["released"] += 1

    def drop_router(self, router: str) -> int:
        """The router's stream ended: every reservation and hold of it goes. Returns how many."""
        mine = [rid for rid in self._entries if rid[0] == router]
        for rid in mine:
            self._drop(rid)
        for rid in [rid for rid in self._holds if rid[0] == router]:
            self._resolve(rid)
        self.counts["dropped"] += len(mine)
        return len(mine)

    def live_ops(self, routers: Collection[str]) -> list[tuple[str, pb.ReserveOp]]:
        """``(router, op)`` that rebuild ``routers``' reservations in force now, each with its remaining
        ttl (so it expires where this one does, counted from when the ops are applied) and its prefill
        still to come: a replica republishes its routers' when the others may have dropped them. A
        completed request's is its blocks' hold (the rest of it as a ttl, then its end); what was
        released past that, or expired, is not in them."""
        now = self.clock()
        self._sweep(now, force=True)
        out: list[tuple[str, pb.ReserveOp]] = []
        for (router, request_id), e in self._entries.items():
            left = (e.expires if e.running else e.blocks_expire) - now
            if router not in routers or left <= 0:
                continue
            op = pb.ReserveOp(request_id=request_id)
            r = op.reserve
            r.model, r.node_id, r.dp_rank, r.prefill_tokens, r.ttl_seconds = (e.model, e.key[0], e.key[1],
                                                                               e.prefill, left)
            # Only the checkpoints are kept: each at its position again (the first one's), 0 between.
            r.first_block = e.first + (STRIDE - 1 - e.first) % STRIDE
            spread = [0] * (STRIDE * (len(e.hashes) - 1) + 1) if e.hashes else []
            spread[::STRIDE] = e.hashes
            r.block_hashes = pack_u64(spread)
            out.append((router, op))
            if not e.running:
                out.append((router, pb.ReserveOp(request_id=request_id, release=pb.Release())))
        return out

    # ------------------------------------------------------------------ reads (lookups)
    async def hold(self, router: str, reserve_id: str, model: str, hashes: Sequence[BlockHash64], start: int,
                   wait: float) -> None:
        """Before answering a lookup: wait (at most ``wait`` s) for another request's hold on this query's
        first new block (``hashes[start]``), then hold it for this request's pick when ``reserve_id``
        names one. With replicas, a hold no lookup here had is also claimed across them (:attr:`claim`),
        once taken here (so this replica's next lookups of it wait for this one, not for Redis); when
        another replica's router has it and its pick has not come yet (:meth:`settled`), this lookup
        waits until that reservation or release comes by the feed, or the claim lapses."""
        if start >= len(hashes):
            return
        h = (model, hashes[start])
        rid = (router, reserve_id)
        other = self._held.get(h)
        hold = self._holds.get(other) if other is not None else None
        fresh = hold is None or hold.expires <= self.clock()
        if not fresh and other != rid:
            await self._wait(hold, wait)
        if not (router and reserve_id):
            return
        self._resolve(rid)
        self._holds[rid] = _Hold(router, h, self.clock() + self.hold_seconds)
        self._held[h] = rid  # before any round trip: this replica's next lookups of it wait for this one
        self.counts["held"] += 1
        if fresh and self.claim is not None:
            await self._claim_and_wait(self.claim(model, hashes[start], rid, self.hold_seconds), rid, h,
                                       wait)

    async def _claim_and_wait(self, claim: Awaitable[tuple[Rid, float] | None], rid: Rid,
                              h: tuple[str, BlockHash64], wait: float) -> None:
        """The claim runs to its end (bounded by the hold's time; it holds the prefix on the other replicas
        even when this lookup may not wait for it, then as a task of its own); within ``wait`` s in all,
        its answer is waited for and then, when another replica's router holds the prefix, that router's
        reservation (or release) by the feed. This lookup's own hold then runs from when it answers."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        if wait >= self.hold_seconds:  # the usual case: the claim's own bound is within the lookup's
            got = await claim
        else:
            task = asyncio.ensure_future(claim)
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)
            if wait <= 0:
                return
            try:
                got = await asyncio.wait_for(asyncio.shield(task), wait)
            except TimeoutError:
                return
        if got is None or got[0] == rid or self.settled(got[0]):
            return
        other, left = got
        hold = self._holds.get(other)
        if hold is None:  # lasts as long as the claim key: the other replica's hold
            hold = self._holds[other] = _Hold(other[0], h, self.clock() + left)
        await self._wait(hold, end - loop.time())
        mine = self._holds.get(rid)
        if mine is not None:
            mine.expires = self.clock() + self.hold_seconds

    async def _wait(self, hold: _Hold | None, wait: float) -> None:
        """Until ``hold`` ends (its request's reservation or release), expires, or ``wait`` s pass."""
        now = self.clock()
        if hold is None or hold.expires <= now or wait <= 0:
            return
        self.counts["waited"] += 1
        if hold.done is None:
            hold.done = asyncio.Event()
        await wait_event(hold.done, min(wait, hold.expires - now))

    def overlay(self, model: str, hashes: Sequence[BlockHash64], start: int,
                asker: str) -> dict[NodeKey, Reserved]:
        """Reservations per node for this query: other routers' requests and prefill on every node of
        ``model``, and the leading blocks any router (``asker`` too: its own memory may keep fewer)
        routed there, from position ``start`` (the index's best) on."""
        now = self.clock()
        self._sweep(now)
        if not self._entries:
            return {}
        depth: dict[NodeKey, int] = {}
        blocks = self._blocks.get(model, {})
        for i in range(start + (STRIDE - 1 - start) % STRIDE, len(hashes), STRIDE):
            rid = blocks.get(hashes[i])
            e = self._entries.get(rid) if rid is not None else None
            if e is None or e.blocks_expire <= now:
                break
            depth[e.key] = i + 1
        out: dict[NodeKey, Reserved] = {}
        for (m, key), routers in self._load.items():
            if m != model:
                continue
            req = sum(v[0] for r, v in routers.items() if r != asker)
            pre = sum(v[1] for r, v in routers.items() if r != asker)
            if req or pre or key in depth:
                out[key] = Reserved(depth.get(key, 0), req, pre)
        for key, d in depth.items():
            out.setdefault(key, Reserved(d))
        return out

    def settled(self, rid: Rid) -> bool:
        """Whether request ``rid``'s pick came (reserved, or released unmade) within its hold's time, or
        its reservation is kept: a claim on its prefix need not be waited for."""
        return rid in self._entries or rid in self._settled

    def any(self) -> bool:
        """Whether any reservation is kept (else every lookup's :meth:`overlay` is empty)."""
        return bool(self._entries)

    def totals(self) -> tuple[int, int, int]:
        """``(running requests, their prefill tokens, reservations holding blocks)`` right now."""
        self._sweep(self.clock(), force=True)
        running = [e for e in self._entries.values() if e.running]
        return len(running), sum(e.prefill for e in running), len(self._entries)

    # ------------------------------------------------------------------ upkeep
    def _settle(self, rid: Rid, now: float) -> None:
        """``rid``'s pick came (with replicas only: a claim on its prefix is then not waited for)."""
        if self.claim is None:
            return
        self._settled.pop(rid, None)  # to the end: the dict stays in order of expiry (_sweep trims it)
        self._settled[rid] = now + self.hold_seconds

    def _resolve(self, rid: Rid) -> None:
        hold = self._holds.pop(rid, None)
        if hold is not None:
            if hold.done is not None:
                hold.done.set()
            if self._held.get(hold.hash) == rid:
                del self._held[hold.hash]

    def _drop(self, rid: Rid) -> None:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return
        blocks = self._blocks.get(entry.model, {})
        for h in entry.hashes:
            if blocks.get(h) == rid:
                del blocks[h]
        if entry.running:
            self._unload(rid, entry)

    def _unload(self, rid: Rid, entry: _Entry) -> None:
        """The request no longer runs: out of its node's load (a router with none there leaves it)."""
        routers = self._load[(entry.model, entry.key)]
        per = routers[rid[0]]
        per[0] -= 1
        per[1] -= entry.prefill
        entry.prefill, entry.running = 0, False
        if per[0] <= 0:
            del routers[rid[0]]
            if not routers:
                del self._load[(entry.model, entry.key)]

    def _sweep(self, now: float, force: bool = False) -> None:
        """Drop what expired (at most every 0.2 s unless ``force``)."""
        if now < self._next_sweep and not force:
            return
        self._next_sweep = now + 0.2
        for rid, e in list(self._entries.items()):
            if e.expires <= now:
                self.counts["expired"] += e.running
                self._drop(rid)
            elif not e.running and e.blocks_expire <= now:
                self._drop(rid)
        for rid, hold in list(self._holds.items()):
            if hold.expires <= now:
                self._resolve(rid)
        while self._settled:
            rid, until = next(iter(self._settled.items()))
            if until > now:
                break
            del self._settled[rid]


async def lookup_view(res: Reservations, router: str, reserve_id: str, model: str,
                      hashes: Sequence[BlockHash64], start: int, wait: float) -> dict[NodeKey, Reserved]:
    """A lookup's view of the reservations, for both APIs (gRPC ``Lookup``, HTTP ``/query``): the asking
    router's hold on its new prefix (from position ``start``, the index's best) once any other hold on it
    was waited for (at most ``wait`` s, capped at its ``hold_seconds``), then :meth:`Reservations.overlay`."""
    if router:
        await res.hold(router, reserve_id, model, hashes, start, min(wait, res.hold_seconds))
    return res.overlay(model, hashes, start, router)


LogOnce = Callable[..., None]


async def take_stream(res: Reservations, batches: AsyncIterator[object], log_once: LogOnce) -> int:
    """Apply one router's ``Reserve`` stream until it ends, then drop that router's reservations.
    A bad batch or operation is counted (``rejected``), logged once per reason, and skipped. Returns the
    operations received."""
    router, n = "", 0
    try:
        async for batch in batches:
            if not isinstance(batch, pb.ReserveBatch):
                _refused(res, log_once, f"malformed ReserveBatch: {getattr(batch, 'reason', batch)}")
                continue
            if not batch.router_id or (router and batch.router_id != router):
                _refused(res, log_once, "a ReserveBatch needs the stream's one router_id")
                continue
            router = batch.router_id
            n += len(batch.ops)
            for op in batch.ops:
                reason = apply_op(res, router, op)
                if reason:
                    _refused(res, log_once, reason)
                elif res.outbox is not None:
                    res.outbox(router, op)
    finally:
        if router:
            res.drop_router(router)
            if res.outbox is not None:
                res.outbox(router, None)
    return n


def _refused(res: Reservations, log_once: LogOnce, reason: str) -> None:
    res.counts["rejected"] += 1
    log_once(f"reserve:{reason[:60]}", logging.WARNING, "Reserve: %s (counted, logged once)", reason)


def apply_op(res: Reservations, router: str, op: pb.ReserveOp, at: float | None = None) -> str:
    """One operation, made at ``at`` (None: now); "" or why it was refused."""
    kind = op.WhichOneof("op")
    if kind == "release":
        res.release(router, op.request_id, first_byte=op.release.first_byte, at=at)
        return ""
    if kind != "reserve":
        return "a ReserveOp needs reserve or release"
    r = op.reserve
    try:
        hashes = unpack_u64(r.block_hashes, "Reservation")
    except InvalidEvent as exc:
        return str(exc)
    return res.reserve(router, op.request_id, r.model, (r.node_id, r.dp_rank), r.first_block, hashes,
                       r.prefill_tokens, r.ttl_seconds, at)


class ReservationCollector(Collector):
    """``kvcoord_reservations*``, read at scrape time (expired reservations swept first)."""

    def __init__(self, reservations: Reservations) -> None:
        self.reservations = reservations

    def collect(self) -> list[Metric]:
        running, prefill, held = self.reservations.totals()
        g = GaugeMetricFamily("kvcoord_reservations", "Routers' reservations now: requests in flight, "
                              "entries (in flight or holding their blocks past completion)", labels=["kind"])
        g.add_metric(["requests"], running)
        g.add_metric(["entries"], held)
        p = GaugeMetricFamily("kvcoord_reserved_prefill_tokens", "Predicted prefill tokens of reserved "
                              "requests not at their first byte yet")
        p.add_metric([], prefill)
        c = CounterMetricFamily("kvcoord_reservation_ops", "Reservation operations by outcome: reserved, "
                                "released, expired (ttl), dropped (router's stream ended), rejected, held "
                                "(a lookup held its new prefix), waited (a lookup waited for a hold)",
                                labels=["op"])
        for op, n in self.reservations.counts.items():
            c.add_metric([op], n)
        return [g, p, c]
