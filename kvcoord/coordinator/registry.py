"""Node registry: who is connected, at which epoch and seq, their load, their lease and their state.

The registry is the coordinator's authority on liveness. Lookups drop any node the registry does
not consider live *at answer time*, so an expired lease takes effect immediately, while the index
reclaims the node's entries in the background.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from kvcoord.load import (
    APPROXIMATE,
    DEGRADED,
    EXACT,
    HASH_MISMATCH,
    HISTORY_LOST,
    RESYNCING,
    TRUSTS,
    NodeLoad,
)

ACTIVE = "active"
DRAINING = "draining"
EXPIRED = "expired"
STATES = (ACTIVE, DRAINING, RESYNCING, HASH_MISMATCH, EXPIRED)
"""Node states; ``resyncing`` is also a trust state (:data:`kvcoord.load.TRUSTS`), with the same meaning."""


LOST_RANKS_SHOWN = 3
"""Lost ranks named in a trust reason; the rest are counted (an agent may announce 1024 ranks)."""


class Trust(NamedTuple):
    """A node's trust (:data:`kvcoord.load.TRUSTS`), why in words, and why for machines (``cause``:
    :data:`kvcoord.load.TRUST_CAUSES`, empty unless degraded)."""

    state: str
    reason: str
    cause: str


def trust_state(mismatch: str | None, *, resyncing: bool, expired: bool,
                history_lost: str | None = None, no_kv_events: bool = False) -> Trust:
    """``(trust, reason, cause)`` of a node: the one rule, for this replica's records and others' alike.

    - ``degraded``: its hashes failed verification (``mismatch`` is the reason), or its agent lost
      history (``history_lost``: batches the engine published that its relay could not recover, so the
      index lacks what they stored); a mismatch is the reason when both apply. Degraded comes first
      because both hold across a resync. A mismatch ends only with a new epoch (the engine or agent
      restarted: the Hello clears the mark and verification starts over) or when the node is removed
      or expires and comes back; the mark is never cleared while the same process keeps publishing,
      since its hashes will not change. Lost history of a rank ends with an ``AllBlocksCleared`` of
      that rank (the engine starts from nothing: everything is known again), a snapshot of it without
      the mark, or a new epoch, the same ways back.
    - ``resyncing``: waiting for a snapshot (after a Hello that could not resume, a gap, an index
      outage) or expired (its entries are being reclaimed; it needs a snapshot to be served again).
      It ends when the snapshot is applied.
    - ``approximate``: in sync, but its engine publishes no KV events (its agent said so in the Hello):
      the index holds nothing of it, so a lookup's zero is unknown, not a miss. A Hello without the
      flag (the engine got KV events) ends it.
    - ``exact``: in sync, every batch applied in order.

    ``cause`` tells the two degraded cases apart (``hash_mismatch``: entries may be wrong;
    ``history_lost``: entries are missing, those held are real); it is empty for any other trust.
    """
    if mismatch is not None:
        return Trust(DEGRADED, mismatch, HASH_MISMATCH)
    if history_lost is not None:
        return Trust(DEGRADED, history_lost, HISTORY_LOST)
    if expired:
        return Trust(RESYNCING, "lease expired: entries reclaimed, a snapshot is required when it reconnects",
                     "")
    if resyncing:
        return Trust(RESYNCING, "waiting for the node's snapshot", "")
    if no_kv_events:
        return Trust(APPROXIMATE, NO_KV_EVENTS, "")
    return Trust(EXACT, "", "")


NO_KV_EVENTS = "the engine publishes no KV events: only its load is known"
_EXACT = trust_state(None, resyncing=False, expired=False)


class Changes:
    """The changes to what lookups report of nodes, counted and logged: any record's model, ranks,
    liveness flags, trust marks, load or URL, and records coming and going (every such change sets a
    watched field of :class:`NodeRecord`), plus registrations. The HTTP API's native answers are built
    from views that name the count they were taken at (``kvcoord.coordinator.fastpath``): a view is stale
    once it moved, and brought up to date from the nodes logged since."""

    __slots__ = ("base", "count", "log")

    LOG_MAX = 4096
    """Changes kept; a view older than the log is rebuilt whole."""

    def __init__(self) -> None:
        self.count = 0
        self.base = 0
        self.log: list[str | None] = []
        """Change ``base + i + 1`` was of node ``log[i]`` (None: not of one node)."""

    def bump(self, node_id: str | None = None) -> None:
        """One change, of ``node_id``'s record or (None) of something else."""
        self.count += 1
        log = self.log
        log.append(node_id)
        if len(log) > self.LOG_MAX:
            drop = len(log) // 2
            del log[:drop]
            self.base += drop

    def since(self, count: int) -> set[str | None] | None:
        """The nodes changed after change ``count`` (None among them: something else did); None when
        the log no longer reaches back that far."""
        if count < self.base:
            return None
        return set(self.log[count - self.base:])


CHANGES = Changes()
"""One per process (several coordinators in one process only rebuild more often)."""

_UNSET = object()
_WATCHED = frozenset({"model", "dp_ranks", "resyncing", "draining", "expired", "hash_mismatch", "load",
                      "serving_url", "history_lost", "announced", "no_kv_events"})
"""The :class:`NodeRecord` fields lookups read (``live``, ``trust``, the answer's load and URL, the
announced block size of a model without a profile)."""


@dataclass(slots=True)
class AnnouncedProfile:
    """The hash profile an agent announced in its Hello (never a seed)."""

    algo: str = ""
    block_size: int = 0
    style: str = ""
    none_hash_fingerprint: str = ""
    engine_release: str = ""


@dataclass(slots=True, eq=False)
class NodeRecord:
    """One node as the coordinator knows it. Mutated only on the event loop."""

    node_id: str
    model: str
    dp_ranks: tuple[int, ...]
    epoch: int
    last_seq: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    load: NodeLoad = field(default_factory=NodeLoad)
    announced: AnnouncedProfile | None = None
    resyncing: bool = True
    """Waiting for a snapshot: the node's entries are not trustworthy and it is left out of lookups."""
    draining: bool = False
    expired: bool = False
    expired_at: float = 0.0
    hash_mismatch: bool = False
    hash_mismatch_reason: str = ""
    stream_gen: int = 0
    """Generation of the ingest stream that owns this node; older streams are refused."""
    indexed: set[tuple[str, int]] = field(default_factory=set)
    """(model, dp_rank) pairs the index may hold entries for, so a changed model/rank set is cleaned up."""
    verify_seen: int = 0
    """Sampled BlockStored chains verified (or tried)."""
    serving_url: str = ""
    """The engine's OpenAI-compatible base URL, as its agent announced it (empty: not announced)."""
    role: str = ""
    """The engine's P/D role its Hello declared (``prefill``, ``decode``, ``both``; "" none): ListNodes
    shows it, and route and epp take their prefill and decode pools from it."""
    no_kv_events: bool = False
    """Its agent's Hello said the engine publishes no KV events: trust ``approximate``, no batches."""
    history_lost: dict[int, str] = field(default_factory=dict)
    """``{dp_rank: reason}``: ranks whose agent lost history it cannot recover (see :func:`trust_state`).
    Changed in place only with :data:`CHANGES` bumped."""
    entries: int = 0
    """Entries the node holds over its ranks, as its snapshot and applied batches counted them (an upper
    bound: a snapshot may repeat a block): what ``max_entries_per_node`` is checked against."""

    def __setattr__(self, name: str, value: object) -> None:
        if name not in _WATCHED:
            object.__setattr__(self, name, value)
            return
        old = getattr(self, name, _UNSET)
        object.__setattr__(self, name, value)
        if old is _UNSET or old != value:  # a heartbeat with the same load changes nothing
            CHANGES.bump(getattr(self, "node_id", None))

    @property
    def state(self) -> str:
        if self.expired:
            return EXPIRED
        if self.draining:
            return DRAINING
        if self.resyncing:
            return RESYNCING
        if self.hash_mismatch:
            return HASH_MISMATCH
        return ACTIVE

    @property
    def trust(self) -> Trust:
        """See :func:`trust_state`."""
        return self.trust_at(expired=self.expired)

    def trust_at(self, *, expired: bool) -> Trust:
        """:attr:`trust`, with ``expired`` as the caller sees it (past its lease, not yet swept)."""
        if not (self.hash_mismatch or self.history_lost or expired or self.resyncing or self.no_kv_events):
            return _EXACT  # nothing to weigh: asked per node of every lookup answer
        lost = None
        if self.history_lost and not self.hash_mismatch:  # a mismatch is the reason: not built for nothing
            shown = heapq.nsmallest(LOST_RANKS_SHOWN, self.history_lost)
            lost = "; ".join(f"dp rank {r}: {self.history_lost[r]}" for r in shown)
            if len(self.history_lost) > LOST_RANKS_SHOWN:
                lost += f"; and {len(self.history_lost) - LOST_RANKS_SHOWN} more rank(s)"
        return trust_state(self.hash_mismatch_reason if self.hash_mismatch else None,
                           resyncing=self.resyncing, expired=expired, history_lost=lost,
                           no_kv_events=self.no_kv_events)

    def rank_trust(self, rank: int) -> Trust:
        """The trust of one dp rank, as lookups report it: a mismatch, a resync and an expiry are the
        node's (one stream, one verification); lost history is the rank's own, so a rank that lost nothing
        stays exact beside one that did."""
        if not (self.hash_mismatch or self.history_lost or self.expired or self.resyncing
                or self.no_kv_events):
            return _EXACT
        lost = self.history_lost.get(rank)
        return trust_state(self.hash_mismatch_reason if self.hash_mismatch else None,
                           resyncing=self.resyncing, expired=self.expired,
                           history_lost=f"dp rank {rank}: {lost}" if lost is not None else None,
                           no_kv_events=self.no_kv_events)

    def live(self, now: float, lease: float) -> bool:
        """Served in lookups: heard from within the lease, in sync, and not draining."""
        return not (self.expired or self.resyncing or self.draining) and now - self.last_heard <= lease


class NodeRegistry:
    """Nodes by id, per-node locks that serialise index writes, and background entry removals."""

    def __init__(self, lease_seconds: float, *, retain_expired: float | None = None) -> None:
        self.lease = lease_seconds
        self.retain_expired = retain_expired if retain_expired is not None else max(60.0, 10 * lease_seconds)
        self._nodes: dict[str, NodeRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._removals: dict[str, asyncio.Task[None]] = {}
        self._live_hint: dict[str, NodeRecord] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeRecord]:
        return iter(list(self._nodes.values()))

    def get(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)

    def lock(self, node_id: str) -> asyncio.Lock:
        """The lock every index write for ``node_id`` holds (it outlives records: a new record after
        expiry must not interleave with a stale stream's write)."""
        lk = self._locks.get(node_id)
        if lk is None:
            lk = self._locks[node_id] = asyncio.Lock()
        return lk

    def is_live(self, node_id: str, model: str, now: float | None = None) -> bool:
        rec = self._nodes.get(node_id)
        if rec is None or rec.model != model:
            return False
        return rec.live(time.monotonic() if now is None else now, self.lease)

    def live_record(self, node_id: str, model: str, now: float) -> NodeRecord | None:
        """The node's record if it is served in lookups of ``model`` at ``now``."""
        rec = self._nodes.get(node_id)
        if rec is None or rec.model != model or not rec.live(now, self.lease):
            return None
        return rec

    def has_live(self, model: str) -> bool:
        """Any node of ``model`` served in lookups now. O(1) while the node found last time stays live
        (a lookup must not scan the fleet); the scan runs only when that node stops being live."""
        now = time.monotonic()
        hint = self._live_hint.get(model)
        if hint is not None and self._nodes.get(hint.node_id) is hint and hint.model == model and hint.live(
            now, self.lease
        ):
            return True
        for r in self._nodes.values():
            if r.model == model and r.live(now, self.lease):
                self._live_hint[model] = r
                return True
        self._live_hint.pop(model, None)
        return False

    def hello(
        self,
        node_id: str,
        model: str,
        dp_ranks: tuple[int, ...],
        epoch: int,
        *,
        index_ok: bool,
        next_seq: int = 0,
        no_kv_events: bool = False,
    ) -> tuple[NodeRecord, bool]:
        """Register a (re)connecting node. Returns the record and whether the stream resumes where
        the node left off (same epoch, model, ranks and ``no_kv_events``, in sync, not expired, index
        reachable, and the agent can resend everything after the last applied seq: ``next_seq`` 0 =
        unknown)."""
        now = time.monotonic()
        rec = self._nodes.get(node_id)
        resume = (
            rec is not None
            and not rec.expired
            and not rec.resyncing
            and rec.epoch == epoch
            and rec.model == model
            and rec.dp_ranks == dp_ranks
            and rec.no_kv_events == no_kv_events
            and index_ok
            and now - rec.last_heard <= self.lease
            and (next_seq == 0 or next_seq <= rec.last_seq + 1)
        )
        if rec is None or rec.expired:
            # Expired entries are being reclaimed by remove_node (see wait_removal): start clean.
            rec = NodeRecord(node_id=node_id, model=model, dp_ranks=dp_ranks, epoch=epoch, last_heard=now)
            self._nodes[node_id] = rec
        elif not resume:
            if rec.epoch != epoch:
                # A restarted node (new epoch) starts over: a drain was for the old process.
                rec.draining = False
                rec.hash_mismatch = False
                rec.hash_mismatch_reason = ""
                rec.history_lost.clear()
                CHANGES.bump(node_id)
                rec.verify_seen = 0
            rec.model, rec.dp_ranks, rec.epoch = model, dp_ranks, epoch
            rec.last_seq = 0
            rec.resyncing = True
        rec.no_kv_events = no_kv_events
        rec.last_heard = now
        rec.stream_gen += 1
        return rec, resume

    def owns(self, rec: NodeRecord, gen: int) -> bool:
        """True while stream generation ``gen`` still owns ``rec`` (not superseded, removed, expired)."""
        return rec.stream_gen == gen and not rec.expired and self._nodes.get(rec.node_id) is rec

    def heard(self, rec: NodeRecord, at: float | None = None) -> None:
        """``rec`` was heard from now, or (``at``, monotonic) when its engine last answered: a registered
        engine's lease runs from there, not from its in-process feed's heartbeat. A lease that moved back
        is a change (views built on the later one must not outlive it)."""
        if at is None:
            rec.last_heard = time.monotonic()
            return
        at = min(at, time.monotonic())
        if at < rec.last_heard:
            CHANGES.bump(rec.node_id)
        rec.last_heard = at

    def drain(self, node_id: str, draining: bool = True) -> bool:
        """Set (or with ``draining=False`` end) a node's drain; False for an unknown node."""
        rec = self._nodes.get(node_id)
        if rec is None:
            return False
        rec.draining = draining
        return True

    def put(self, rec: NodeRecord) -> None:
        """Hold ``rec`` as its node's record (a lookup worker's copy of the main process's)."""
        self._nodes[rec.node_id] = rec
        CHANGES.bump(rec.node_id)

    def remove(self, node_id: str) -> NodeRecord | None:
        """Forget the node entirely (its stream, if any, is refused on its next message)."""
        rec = self._nodes.pop(node_id, None)
        if rec is not None:
            rec.expired = True
            rec.stream_gen += 1
            CHANGES.bump(node_id)  # gone, even if it had expired already (its model may be unknown now)
        return rec

    def expire_due(self, now: float | None = None) -> list[NodeRecord]:
        """Mark nodes past their lease expired; forget long-expired ones. Returns the newly expired."""
        now = time.monotonic() if now is None else now
        out: list[NodeRecord] = []
        for rec in list(self._nodes.values()):
            if rec.expired:
                if now - rec.expired_at > self.retain_expired:
                    del self._nodes[rec.node_id]
                    CHANGES.bump(rec.node_id)
            elif now - rec.last_heard > self.lease:
                rec.expired = True
                rec.expired_at = now
                rec.stream_gen += 1
                out.append(rec)
        return out

    def track_removal(self, node_id: str, task: asyncio.Task[None]) -> None:
        self._removals[node_id] = task
        task.add_done_callback(
            lambda t: self._removals.pop(node_id, None) if self._removals.get(node_id) is t else None
        )

    async def wait_removal(self, node_id: str) -> None:
        """Wait for a pending background removal of ``node_id`` so it cannot wipe a fresh snapshot."""
        task = self._removals.get(node_id)
        if task is not None:
            await asyncio.shield(task)

    def removal_pending(self, node_id: str) -> bool:
        """A background removal of ``node_id`` is queued or running (it takes the node's lock)."""
        task = self._removals.get(node_id)
        return task is not None and not task.done()

    def pending_removals(self) -> list[asyncio.Task[None]]:
        return list(self._removals.values())

    def by_state(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        now = time.monotonic()
        for rec in self._nodes.values():
            state = rec.state
            if state != EXPIRED and now - rec.last_heard > self.lease:
                state = EXPIRED  # past its lease; the sweeper has not run yet
            out[state] += 1
        return out

    def by_trust(self) -> dict[str, int]:
        """Nodes by trust state, every state present; expired nodes (and those past their lease) are not
        counted: they are in no lookup answer."""
        out = dict.fromkeys(TRUSTS, 0)
        now = time.monotonic()
        for rec in self._nodes.values():
            if not rec.expired and now - rec.last_heard <= self.lease:
                out[rec.trust[0]] += 1
        return out
