"""The coordinator's shared state and background work (lease sweeps, index stats and health)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.registry import NodeRecord, NodeRegistry
from kvcoord.coordinator.verify import HashVerifier
from kvcoord.index.base import Generational, Index, IndexStats
from kvcoord.proto.v1 import kvcoord_pb2 as pb

log = logging.getLogger("kvcoord.coordinator")

HealthHook = Callable[[bool], Awaitable[None]]
Push = Callable[[pb.CoordinatorMessage], None]
"""Queues a message on one ingest stream (its outbox)."""


class CoordinatorState:
    """Everything the servicer and the ingest sessions share. Lives on one event loop."""

    def __init__(self, config: CoordinatorConfig, index: Index, metrics: Metrics | None = None) -> None:
        self.config = config
        self.index = index
        self.registry = NodeRegistry(config.lease_seconds)
        self.metrics = metrics if metrics is not None else Metrics()
        self.verifier = HashVerifier(config.verify)
        self.index_up = True
        self.last_stats: IndexStats | None = None
        self.on_health: HealthHook | None = None
        self._logged: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._push: dict[str, tuple[int, Push]] = {}
        self.index_generation: str | None = None
        self.metrics.index_up.labels(index.backend).set(1)

    # --- streams ----------------------------------------------------------------------------
    def attach(self, node_id: str, stream_gen: int, push: Push) -> None:
        """Remember how to reach the ingest stream that owns ``node_id`` (generation ``stream_gen``)."""
        self._push[node_id] = (stream_gen, push)

    def detach(self, node_id: str, stream_gen: int) -> None:
        cur = self._push.get(node_id)
        if cur is not None and cur[0] == stream_gen:
            del self._push[node_id]

    def resync_all(self, reason: str) -> int:
        """Every node's entries are untrustworthy: leave them out of lookups and ask each connected
        agent for a snapshot (the others get one asked at their next Hello). Returns nodes affected."""
        n = 0
        for rec in self.registry:
            if rec.expired:
                continue
            n += 1
            rec.resyncing = True
            self.metrics.snapshot_requested("index_reset")
            entry = self._push.get(rec.node_id)
            if entry is not None and entry[0] == rec.stream_gen:
                req = pb.SnapshotRequest(epoch=rec.epoch, reason=reason)
                entry[1](pb.CoordinatorMessage(snapshot_request=req))
        return n

    async def check_generation(self) -> None:
        """Compare the backend's generation with the last one seen; a change means it lost its data."""
        index = self.index
        if not isinstance(index, Generational):
            return
        gen = await index.generation()
        old, self.index_generation = self.index_generation, gen
        if old is not None and gen != old:
            n = self.resync_all(f"index_reset: the {index.backend} index lost its contents")
            log.warning(
                "index backend %s lost its contents (generation %s -> %s); asked %d nodes for snapshots",
                index.backend,
                old,
                gen,
                n,
            )

    # --- logging ----------------------------------------------------------------------------
    def log_once(self, key: str, level: int, msg: str, *args: object) -> None:
        """Log a recurring problem once per key, so a misbehaving agent cannot flood the log."""
        if key in self._logged:
            return
        if len(self._logged) < 10_000:
            self._logged.add(key)
        log.log(level, msg, *args)

    # --- nodes ------------------------------------------------------------------------------
    def mark_hash_mismatch(self, rec: NodeRecord, reason: str) -> None:
        if rec.hash_mismatch:
            return
        rec.hash_mismatch = True
        rec.hash_mismatch_reason = reason
        self.metrics.hash_mismatch(rec.model)
        self.log_once(
            f"hash-mismatch:{rec.node_id}:{rec.epoch}",
            logging.ERROR,
            "node %s (model %s): engine block hashes do not match the coordinator's hash profile; "
            "token lookups will not find this node's blocks. Likely cause: %s",
            rec.node_id,
            rec.model,
            reason,
        )

    def remove_in_background(self, node_id: str) -> None:
        """Reclaim a node's index entries off the request path; the registry already hides it."""

        async def remove() -> None:
            try:
                await self.index.remove_node(node_id)
            except Exception:
                log.exception("removing node %s from the index failed", node_id)

        task = asyncio.get_running_loop().create_task(remove(), name=f"kvcoord-remove-{node_id}")
        self.registry.track_removal(node_id, task)
        self._keep(task)

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- background loops -------------------------------------------------------------------
    def sweep_leases(self) -> list[NodeRecord]:
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
            self.remove_in_background(rec.node_id)
        if expired:
            self.metrics.set_nodes(self.registry.by_state())
        return expired

    async def refresh(self) -> None:
        """Ping the index and refresh size gauges; flip health when the backend goes up or down."""
        try:
            up = await asyncio.wait_for(self.index.ping(), timeout=max(0.5, self.config.stats_interval))
        except Exception:
            up = False
        if up != self.index_up:
            log.warning("index backend %s is %s", self.index.backend, "up again" if up else "DOWN")
            self.index_up = up
            self.metrics.index_up.labels(self.index.backend).set(1 if up else 0)
            if self.on_health is not None:
                await self.on_health(up)
        if up:
            try:
                await self.check_generation()
            except Exception:
                log.debug("index generation check failed", exc_info=True)
            try:
                stats = await self.index.stats()
            except Exception:
                log.debug("index stats failed", exc_info=True)
            else:
                self.last_stats = stats
                self.metrics.set_index_stats(stats)
        self.metrics.set_nodes(self.registry.by_state())

    def start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._keep(loop.create_task(self._lease_loop(), name="kvcoord-leases"))
        self._keep(loop.create_task(self._refresh_loop(), name="kvcoord-refresh"))

    async def _lease_loop(self) -> None:
        period = min(1.0, max(0.02, self.config.lease_seconds / 5))
        while True:
            await asyncio.sleep(period)
            try:
                self.sweep_leases()
            except Exception:
                log.exception("lease sweep failed")

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("index refresh failed")
            await asyncio.sleep(self.config.stats_interval)

    async def stop_background(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
