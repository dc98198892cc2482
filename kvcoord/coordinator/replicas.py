"""This replica's view of the others on one Redis: node records published, read, and reclaimed.

See :mod:`kvcoord.coordinator.shared` for the records and the directory that stores them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from kvcoord.coordinator.health import LogOnce
from kvcoord.coordinator.pools import Pools
from kvcoord.coordinator.registry import EXPIRED, NodeRecord, NodeRegistry
from kvcoord.coordinator.shared import PUBLISH_SECONDS, REFRESH_SECONDS, NodeDirectory, SharedNode
from kvcoord.index.base import Index, fence_token
from kvcoord.load import NodeLoad

log = logging.getLogger("kvcoord.coordinator")

Keep = Callable[["asyncio.Task[None]"], None]
"""Holds a background task until it ends (``CoordinatorState`` cancels them at stop)."""


def wall_of(mono: float) -> float:
    """A ``time.monotonic()`` instant as wall-clock time (replicas compare wall clocks)."""
    return time.time() - (time.monotonic() - mono)


def _signature(n: SharedNode) -> tuple[object, ...]:
    """What a republish must carry: any change of it is published at once."""
    return (n.model, n.dp_ranks, n.state, n.epoch, n.load, n.fence, n.trust, n.trust_cause, n.generation,
            n.role, n.pools, n.publisher)


class Replicas:
    """Shared node records (``directory``); None: this process alone decides liveness."""

    def __init__(self, index: Index, registry: NodeRegistry, directory: NodeDirectory | None,
                 keep: Keep, log_once: LogOnce, generation: Callable[[], str | None] = lambda: None,
                 pools: Pools | None = None) -> None:
        self.index = index
        self.pools = pools
        """Which nodes reach which pool: this replica's nodes' go into their records, the other replicas'
        nodes' are taken from theirs (so every replica credits a node with its pools)."""
        self.generation = generation
        """The index generation this replica accepted (``IndexHealth.generation``): records carry it."""
        self.registry = registry
        self.directory = directory
        self.keep = keep
        self.log_once = log_once
        self.replica_id = uuid.uuid4().hex[:12]
        self.shared: dict[str, SharedNode] = {}
        """Other replicas' node records as last read (see :mod:`kvcoord.coordinator.shared`)."""
        self._shared_models: dict[str, float] = {}
        """model -> the latest deadline of a served shared record (``has_live`` without a scan)."""
        self._published: dict[str, tuple[object, float]] = {}
        self._promised: dict[str, float] = {}
        """node -> the latest deadline this replica ever sent out for it (see :meth:`served_until`)."""
        self._removed: list[SharedNode] = []
        self._reclaim_tried: set[tuple[str, int]] = set()
        """(node, fencing token) of dead owners' nodes this replica tried to reclaim (once each)."""

    def _record(self, rec: NodeRecord, now: float, now_wall: float) -> SharedNode:
        lease = self.registry.lease
        state = rec.state
        if state != EXPIRED and now - rec.last_heard > lease:
            state = EXPIRED
        heard = now_wall - (now - rec.last_heard)
        # Published with slack: readers keep the node until at least the owner's own deadline, and a
        # heartbeat republishes only once the true deadline moved by half the slack.
        trust, reason, cause = rec.trust
        pools: tuple[str, ...] = ()
        publisher = ""
        if self.pools is not None:
            pools = tuple(sorted(self.pools.reach.get(rec.node_id, ())))
            publisher = self.pools.publishers.get(rec.node_id, "")
        return SharedNode(rec.node_id, rec.model, rec.dp_ranks, state, rec.epoch,
                          heard + lease + self._slack(), self.replica_id, heard,
                          rec.load, rec.serving_url, fence_token(self.index, rec.node_id), trust, reason,
                          cause, self.generation() or "", rec.role, pools, publisher)

    def _slack(self) -> float:
        return min(2.0, self.registry.lease / 2)

    def node_removed(self, rec: NodeRecord) -> None:
        """Publish that ``rec`` is gone (it is no longer in the registry to be published from)."""
        if self.directory is not None:
            node = self._record(rec, time.monotonic(), time.time())
            node.state = EXPIRED
            self._removed.append(node)

    def served_until(self, node_id: str) -> float:
        """Wall-clock time until which other replicas may still answer ``node_id`` as live from a record
        this replica published (its deadline, with slack; 0.0: never published). The node's entries must
        stay until then: removed earlier, they would be answered missing from a node called ``exact``."""
        return self._promised.get(node_id, 0.0)

    async def taken_over(self, node_id: str, heard: float) -> bool:
        """Another replica took ``node_id`` over since this one last heard it (monotonic ``heard``):
        its entries are that replica's snapshot now."""
        if self.directory is None:
            return False
        try:
            other = await self.directory.fetch(node_id)
        except Exception:
            other = None
        mine = fence_token(self.index, node_id)
        if other is not None and other.owner != self.replica_id and other.outranks(mine, wall_of(heard)):
            log.info("node %s: owned by replica %s now; its entries stay", node_id, other.owner)
            return True
        return False

    def _changed_records(self) -> list[SharedNode]:
        now, now_wall = time.monotonic(), time.time()
        out, self._removed = self._removed, []
        half = self._slack() / 2
        for rec in self.registry:
            node = self._record(rec, now, now_wall)
            other = self.shared.get(rec.node_id)
            if (other is not None and other.owner != self.replica_id
                    and other.outranks(node.fence, node.heard)):
                continue  # moved to another replica; our record is stale
            last = self._published.get(rec.node_id)
            if last is None or last[0] != _signature(node) or node.deadline - last[1] > half:
                out.append(node)
        return out

    async def publish(self) -> None:
        """Write this replica's changed node records to the directory."""
        if self.directory is None:
            return
        nodes = self._changed_records()
        if not nodes:
            return
        for n in nodes:  # before the write: a write that times out may still land
            if n.state != EXPIRED:
                self._promised[n.node_id] = max(n.deadline, self._promised.get(n.node_id, 0.0))
        try:
            await self.directory.publish(nodes)
        except Exception:
            self._removed.extend(n for n in nodes if n.state == EXPIRED and n.node_id not in self._published)
            raise
        known = {r.node_id for r in self.registry}
        for node_id in [k for k in self._published if k not in known]:
            del self._published[node_id]
        for node_id in [k for k in self._promised if k not in known]:
            del self._promised[node_id]
        for n in nodes:
            self._published[n.node_id] = (_signature(n), n.deadline)

    async def read(self) -> None:
        """Refresh the view of every replica's node records."""
        if self.directory is None:
            return
        view = await self.directory.fetch_all()
        models: dict[str, float] = {}
        for n in view.values():
            if n.state in ("active", "hash_mismatch") and n.deadline > models.get(n.model, 0.0):
                models[n.model] = n.deadline
        self.shared, self._shared_models = view, models
        if self.pools is not None:
            for n in self.remote_nodes():
                self.pools.shared(n.node_id, n.pools, n.publisher)
        self._reclaim_dead(view)

    def _reclaim_dead(self, view: dict[str, SharedNode]) -> None:
        """Remove the entries of nodes whose owner died: another replica's record past its deadline (and
        a grace as long again as the slack, for clocks), of a node this replica does not hold. Guarded by
        the record's fencing token: the backend removes nothing if the node was claimed since (it came
        back), and fences that token out, so a late owner cannot resume writing on top of the removal."""
        grace = self._slack()
        now_wall = time.time()
        for node_id, n in view.items():
            key = (node_id, n.fence)
            mine = self.registry.get(node_id)
            if (n.owner == self.replica_id or not n.fence or n.deadline + grace > now_wall
                    or (mine is not None and not mine.expired) or key in self._reclaim_tried):
                continue
            if len(self._reclaim_tried) >= 100_000:
                self._reclaim_tried.clear()
            self._reclaim_tried.add(key)
            self.keep(asyncio.get_running_loop().create_task(
                self._reclaim_node(n), name=f"kvcoord-reclaim-{node_id}"))

    async def _reclaim_node(self, n: SharedNode) -> None:
        fencing = self.index.fencing
        if fencing is None:
            return  # one process: nobody else wrote the node
        try:
            done = await fencing.reclaim_node(n.node_id, n.fence)
        except Exception as exc:
            self._reclaim_tried.discard((n.node_id, n.fence))  # tried again at the next read
            log.debug("reclaiming node %s failed: %s", n.node_id, exc)
            return
        if done:
            log.info("node %s: its replica %s stopped publishing (deadline passed %.1fs ago); its "
                     "entries were reclaimed", n.node_id, n.owner, time.time() - n.deadline)

    def live_node(self, node_id: str, model: str, now: float, now_wall: float,
                  rank: int | None = None) -> tuple[NodeLoad, str, str, str] | None:
        """``(load, serving url, trust, trust cause)`` of ``node_id`` if lookups of ``model`` may report it
        now: this replica's record, or (replicas) another replica's that outranks it (a later claim, or
        heard it later). With ``rank``, the trust is that dp rank's (``NodeRecord.rank_trust``; another
        replica's record has the node's only)."""
        rec = self.registry.get(node_id)
        other = self.shared.get(node_id) if self.directory is not None else None
        if rec is not None and (
            other is None
            or other.owner == self.replica_id
            or not other.outranks(fence_token(self.index, node_id), now_wall - (now - rec.last_heard))
        ):
            if rec.model == model and rec.live(now, self.registry.lease):
                trust = rec.trust if rank is None else rec.rank_trust(rank)
                return rec.load, rec.serving_url, trust.state, trust.cause
            return None
        if (other is not None and other.model == model and other.live(now_wall)
                and self._same_generation(other)):
            return other.load, other.url, other.trust, other.trust_cause
        return None

    def _same_generation(self, other: SharedNode) -> bool:
        """Whether ``other`` was published in the index generation this replica accepted (records of
        replicas that predate the field count as the same): see ``SharedNode.generation``."""
        mine = self.generation()
        return not other.generation or not mine or other.generation == mine

    def remote_nodes(self) -> list[SharedNode]:
        """Nodes whose stream another replica holds, as last read from the directory (a node this
        replica also knows counts as remote only when the other replica's record outranks its own)."""
        out: list[SharedNode] = []
        if self.directory is None:
            return out
        now, now_wall = time.monotonic(), time.time()
        for node_id, other in self.shared.items():
            if other.owner == self.replica_id:
                continue
            rec = self.registry.get(node_id)
            mine = now_wall - (now - rec.last_heard) if rec is not None else 0.0
            if rec is not None and not other.outranks(fence_token(self.index, node_id), mine):
                continue
            out.append(other)
        return out

    def has_live(self, model: str) -> bool:
        if self.registry.has_live(model):
            return True
        return self.directory is not None and self._shared_models.get(model, 0.0) >= time.time()

    async def loop(self) -> None:
        """Publish changed records every ``PUBLISH_SECONDS``, read the others' every ``REFRESH_SECONDS``."""
        next_read = 0.0
        while True:
            try:
                await self.publish()
                if time.monotonic() >= next_read:
                    next_read = time.monotonic() + REFRESH_SECONDS
                    await self.read()
            except Exception as exc:
                self.log_once("directory-fail", logging.WARNING, "node directory unavailable: %s", exc)
            await asyncio.sleep(PUBLISH_SECONDS)

    async def close(self) -> None:
        if self.directory is not None:
            await self.directory.close()
