"""The coordinator's shared state: the parts the servicer and the ingest sessions share, by concept.

``health`` (:mod:`~kvcoord.coordinator.health`): whether the index serves, and index calls retried through its
outages. ``stats`` (:mod:`~kvcoord.coordinator.stats`): the index's size figures. ``replicas``
(:mod:`~kvcoord.coordinator.replicas`): node records shared with the other replicas. ``leases``
(:mod:`~kvcoord.coordinator.leases`): expiring silent nodes and reclaiming their entries. What stays here: the
ingest streams, per-node notices and the background tasks that drive the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.engines import RelayedNode
from kvcoord.coordinator.health import IndexHealth
from kvcoord.coordinator.learn import ProfileLearner
from kvcoord.coordinator.leases import Leases
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.pools import Pools
from kvcoord.coordinator.registry import NodeRecord, NodeRegistry
from kvcoord.coordinator.replicas import Replicas
from kvcoord.coordinator.reservation_sync import ReservationSync, ReservationSyncCollector
from kvcoord.coordinator.reservations import ReservationCollector, Reservations
from kvcoord.coordinator.shared import NodeDirectory
from kvcoord.coordinator.stats import IndexFigures
from kvcoord.coordinator.verify import HashVerifier
from kvcoord.index.base import FencedWrite, Index, fence_token
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.tokenize import TokenizerCache
from kvcoord.tokenize.base import TokenizeError
from kvcoord.validate import shown

log = logging.getLogger("kvcoord.coordinator")

Push = Callable[[pb.CoordinatorMessage], None]
"""Queues a message on one ingest stream (its outbox)."""
DOWN_PROBE_SECONDS = 0.2
"""While the index is down, how often the refresh loop probes it."""


class CoordinatorState:
    """Everything the servicer and the ingest sessions share. Lives on one event loop."""

    def __init__(
        self,
        config: CoordinatorConfig,
        index: Index,
        metrics: Metrics | None = None,
        directory: NodeDirectory | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.staged_snapshot_blocks = 0
        """Snapshot blocks held by unfinished snapshots over all streams (``max_staged_snapshot_blocks``)."""
        self.relayed_nodes: Callable[[], dict[str, RelayedNode]] | None = None
        """The registered engines this replica relays, with their status (``ListNodes`` shows the ones in no
        answer); None: it relays none."""
        self.local_feeds = 0
        """In-process ingest feeds (engines registered over HTTP, relayed here): each counts as an ingest
        stream, in the ``streams`` gauge and against ``max_streams``."""
        self.registry = NodeRegistry(config.lease_seconds)
        self.pools = Pools(config.pools)
        """Shared pools: who reaches which, who publishes for which (kvcoord.coordinator.pools)."""
        self.metrics = metrics if metrics is not None else Metrics()
        self.verifier = HashVerifier(config.verify, self.metrics.hash_verified)
        self.learner = ProfileLearner()
        """Learns the hash profile of models configured without one from their events."""
        self._logged: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._push: dict[str, tuple[int, Push]] = {}
        self.health = IndexHealth(index, self.metrics, self.log_once, on_reset=self.resync_all,
                                  on_fenced=self.fenced_out, heard=self.registry.heard)
        self.stats = IndexFigures(index, self.metrics, self.log_once)
        self.replicas = Replicas(index, self.registry, directory, self._keep, self.log_once,
                                 lambda: self.health.generation, self.pools)
        self.leases = Leases(index, self.registry, self.metrics, self.health, self.replicas, self._keep,
                             self.update_node_gauges)
        self.reservations = Reservations(hold_seconds=config.reservation_hold_seconds)
        """Routers' picks not yet reported by events (:mod:`kvcoord.coordinator.reservations`)."""
        with contextlib.suppress(ValueError):  # Metrics shared with an earlier state: its collector stays
            self.metrics.registry.register(ReservationCollector(self.reservations))
        feed = index.reservation_feed
        self.reservation_sync = (None if feed is None else ReservationSync(
            self.reservations, feed, self.replicas.replica_id, self.log_once, config.replica_silent_seconds))
        """Replicas on one Redis share their routers' reservations
        (:mod:`~kvcoord.coordinator.reservation_sync`); None: one process."""
        if self.reservation_sync is not None:
            with contextlib.suppress(ValueError):
                self.metrics.registry.register(ReservationSyncCollector(self.reservation_sync))
        self.tokenizers = TokenizerCache({m.name: m.tokenizer for m in config.models.values() if m.tokenizer})
        """The models' tokenizers (lookups by prompt or chat), each opened on first use."""

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

    def fenced_out(self, exc: FencedWrite, rec: NodeRecord | None) -> None:
        """Another replica claimed ``exc.node_id`` after this one (this one was paused or cut off): the
        backend refused the write and counted it. Let the node go without touching its entries (they are
        the new owner's now): out of the registry, so that the stream of ``rec`` ends at once (its agent
        reconnects, wherever its address leads, and a replica it lands on claims the node again), and its
        record withdrawn (the new owner's, a later claim, is kept: see ``SharedNode.outranks``)."""
        node_id = exc.node_id
        self.log_once(f"fenced:{node_id}:{fence_token(self.index, node_id)}", logging.WARNING,
                      "node %s: %s; dropping the node from this replica (logged once per stale token)",
                      node_id, exc)
        if rec is not None and self.registry.get(node_id) is rec:
            self.registry.remove(node_id)
            self.replicas.node_removed(rec)
            self.update_node_gauges()

    # --- logging ----------------------------------------------------------------------------
    def log_once(self, key: str, level: int, msg: str, *args: object) -> None:
        """Log a recurring problem once per key, so a misbehaving agent cannot flood the log."""
        if key in self._logged:
            return
        if len(self._logged) < 10_000:
            self._logged.add(key)
        log.log(level, msg, *args)

    # --- nodes ------------------------------------------------------------------------------
    def mark_hash_mismatch(self, rec: NodeRecord, reason: str, *, notify: bool = True) -> None:
        """The node's hashes cannot match this coordinator's: mark it, count it, log it once, and (with
        ``notify``) tell its agent, which logs it too."""
        if rec.hash_mismatch:
            return
        rec.hash_mismatch = True
        rec.hash_mismatch_reason = reason
        self.metrics.hash_mismatch(rec.model)
        self.update_node_gauges()
        entry = self._push.get(rec.node_id)
        if notify and entry is not None and entry[0] == rec.stream_gen:
            notice = pb.NodeNotice(state="hash_mismatch", message=reason)
            entry[1](pb.CoordinatorMessage(notice=notice))
        self.log_once(
            f"hash-mismatch:{rec.node_id}:{rec.epoch}",
            logging.ERROR,
            "node %s (model %s): engine block hashes do not match the coordinator's hash profile; "
            "token lookups will not find this node's blocks. Likely cause: %s",
            rec.node_id,
            rec.model,
            reason,
        )

    def update_node_gauges(self) -> None:
        """``kvcoord_nodes{state}`` and ``kvcoord_nodes_by_trust{trust}`` from this replica's registry."""
        self.metrics.set_nodes(self.registry.by_state(), self.registry.by_trust())

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- background loops -------------------------------------------------------------------
    async def refresh(self) -> None:
        """Ping the index and refresh size gauges; flip health when the backend goes up or down."""
        await self.health.check(max(0.5, self.config.stats_interval))
        if self.health.up:
            await self.stats.refresh()
        self.update_node_gauges()

    def start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._keep(loop.create_task(self.leases.loop(), name="kvcoord-leases"))
        self._keep(loop.create_task(self._refresh_loop(), name="kvcoord-refresh"))
        if self.replicas.directory is not None:
            self._keep(loop.create_task(self.replicas.loop(), name="kvcoord-directory"))
        if self.reservation_sync is not None:
            self._keep(loop.create_task(self.reservation_sync.loop(), name="kvcoord-reservation-sync"))
        if self.tokenizers.models():
            self._keep(loop.create_task(self._warm_tokenizers(), name="kvcoord-tokenizers"))

    async def _warm_tokenizers(self) -> None:
        """Open every model's tokenizer at start and tokenize one short prompt, so the first lookups by
        text are not slower than a router's deadline; one line each, whether it answered or not yet."""
        for model in self.tokenizers.models():
            try:
                took = await self.tokenizers.warm(model)
            except TokenizeError as exc:
                log.info("%s: lookups by text fail until it answers (tried at start)", exc)
            else:
                log.info("tokenizer for model %s warm in %.0f ms", shown(model), took * 1000)

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("index refresh failed")
            # Probe a down index often: ingest and lookups wait for it.
            if self.health.up:
                await asyncio.sleep(self.config.stats_interval)
            else:
                await asyncio.sleep(min(DOWN_PROBE_SECONDS, self.config.stats_interval))

    async def stop_background(self) -> None:
        await cancel_all(list(self._tasks))
        if self.reservation_sync is not None:
            await self.reservation_sync.close()
        await self.replicas.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.tokenizers.aclose(), timeout=1.0)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again until each is done: Python 3.11's
    ``asyncio.wait_for`` can swallow a cancellation that lands as its inner wait completes, and a loop
    built on it would then run on and hold shutdown forever."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.debug("background task %s ended with %r", task.get_name(), task.exception())
