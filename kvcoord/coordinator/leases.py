"""Node leases: the sweep that expires silent nodes, and removing a node's entries off the request path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvcoord.coordinator.health import IndexHealth
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.registry import NodeRecord, NodeRegistry
from kvcoord.coordinator.replicas import Keep, Replicas
from kvcoord.index.base import Index

log = logging.getLogger("kvcoord.coordinator")

CLOCK_MARGIN = 0.25
"""Seconds past a published deadline before the owner removes the node's entries: readers judge the
deadline by their own wall clocks, assumed this close to the owner's."""


class Leases:
    """Expires nodes whose lease ran out and reclaims the index entries of nodes that left."""

    def __init__(self, index: Index, registry: NodeRegistry, metrics: Metrics, health: IndexHealth,
                 replicas: Replicas, keep: Keep, update_gauges: Callable[[], None]) -> None:
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self.replicas = replicas
        self.keep = keep
        self.update_gauges = update_gauges

    def drop(self, node_id: str) -> None:
        """Forget ``node_id`` now (RemoveNode, an unregistered engine): out of lookups at once, its record
        withdrawn from the other replicas, its entries reclaimed in the background."""
        rec = self.registry.remove(node_id)
        if rec is not None:
            self.replicas.node_removed(rec)
        self.remove_in_background(node_id)
        self.update_gauges()

    def remove_in_background(self, node_id: str, *, heard: float | None = None,
                             not_before: float = 0.0) -> None:
        """Reclaim a node's index entries off the request path; the registry already hides it.

        Retried through index outages (entries left behind would outlive the node). With replicas,
        ``heard`` (the expired record's last-heard monotonic time) makes it skip the removal when
        another replica took the node over since: that replica's snapshot must not be wiped.
        ``not_before`` (wall clock; an expiry passes ``Replicas.served_until``) delays it, plus
        :data:`CLOCK_MARGIN`, until the other replicas stopped answering the node from this one's record.
        """

        async def remove() -> None:
            if not_before:
                await asyncio.sleep(max(0.0, not_before + CLOCK_MARGIN - time.time()))
            if heard is not None and await self.replicas.taken_over(node_id, heard):
                return
            # Under the node's lock, like every index write for it: an apply already waiting on the
            # backend lands first and is then removed, instead of landing after the removal and
            # leaving orphan entries (Redis would allocate a fresh live location for them).
            async with self.registry.lock(node_id):
                await self.health.call(
                    lambda: self.index.remove_node(node_id), f"remove_node({node_id})", None
                )

        task = asyncio.get_running_loop().create_task(remove(), name=f"kvcoord-remove-{node_id}")
        self.registry.track_removal(node_id, task)
        self.keep(task)

    def sweep(self) -> list[NodeRecord]:
        expired = self.registry.expire_due()
        for rec in expired:
            self.metrics.lease_expired()
            log.warning(
                "node %s: no heartbeat for %.1fs (lease %.1fs); dropped from lookups, entries "
                "reclaimed; it returns with a new hello and snapshot",
                rec.node_id,
                time.monotonic() - rec.last_heard,
                self.registry.lease,
            )
            self.remove_in_background(rec.node_id, heard=rec.last_heard,
                                      not_before=self.replicas.served_until(rec.node_id))
        if expired:
            self.update_gauges()
        return expired

    async def loop(self) -> None:
        period = min(1.0, max(0.02, self.registry.lease / 5))
        while True:
            await asyncio.sleep(period)
            try:
                self.sweep()
            except Exception:
                log.exception("lease sweep failed")
