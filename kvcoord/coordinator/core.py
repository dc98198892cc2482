"""The coordinator's shared state and background work (lease sweeps, index stats and health).

Index outages (e.g. Redis unreachable): the first failed call marks the index down, which flips gRPC
health to NOT_SERVING at once. Ingest sessions keep their batch unacked and retry it with backoff
(``CoordinatorState.wait_index``); lookups answer UNAVAILABLE. The index is declared up again only
after a ping *and* a generation check succeed, so a backend that came back empty is noticed before
anything is written to it or read from it: every node is then marked resyncing and asked for a
snapshot. A backend that came back intact resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.engines import RelayedNode
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.registry import EXPIRED, NodeRecord, NodeRegistry
from kvcoord.coordinator.shared import PUBLISH_SECONDS, REFRESH_SECONDS, NodeDirectory, SharedNode
from kvcoord.coordinator.verify import HashVerifier
from kvcoord.index.base import FencedWrite, Index, IndexStats, InvalidEvent, fence_token, ping
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.tokenize import TokenizeError, TokenizerCache
from kvcoord.validate import shown

log = logging.getLogger("kvcoord.coordinator")

HealthHook = Callable[[bool], Awaitable[None]]
Push = Callable[[pb.CoordinatorMessage], None]
"""Queues a message on one ingest stream (its outbox)."""
_T = TypeVar("_T")
RETRY_INITIAL = 0.05
RETRY_MAX = 1.0
"""Backoff bounds (seconds) of index calls retried through an outage."""
DOWN_PROBE_SECONDS = 0.2
"""While the index is down, how often the refresh loop probes it."""
EXACT_STATS_SECONDS = 5.0
"""How long the Stats RPC reuses an exact index count."""


def wall_of(mono: float) -> float:
    """A ``time.monotonic()`` instant as wall-clock time (replicas compare wall clocks)."""
    return time.time() - (time.monotonic() - mono)


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
        self.directory = directory
        """Shared node records (replicas on one Redis); None: this process alone decides liveness."""
        self.replica_id = uuid.uuid4().hex[:12]
        self.shared: dict[str, SharedNode] = {}
        """Other replicas' node records as last read (see :mod:`kvcoord.coordinator.shared`)."""
        self._shared_models: dict[str, float] = {}
        """model -> the latest deadline of a served shared record (``has_live`` without a scan)."""
        self._published: dict[str, tuple[object, float]] = {}
        self._removed: list[SharedNode] = []
        self.index_down_reason = ""
        self.staged_snapshot_blocks = 0
        """Snapshot blocks held by unfinished snapshots over all streams (``max_staged_snapshot_blocks``)."""
        self.relayed_nodes: Callable[[], dict[str, RelayedNode]] | None = None
        """The registered engines this replica relays, with their status (``ListNodes`` shows the ones in no
        answer); None: it relays none."""
        self.local_feeds = 0
        """In-process ingest feeds (engines registered over HTTP, relayed here): each counts as an ingest
        stream, in the ``streams`` gauge and against ``max_streams``."""
        self._gen_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()
        self.registry = NodeRegistry(config.lease_seconds)
        self.metrics = metrics if metrics is not None else Metrics()
        self.verifier = HashVerifier(config.verify, self.metrics.hash_verified)
        self.index_up = True
        self.last_stats: IndexStats | None = None
        self.stats_stale = False
        """The last index stats call failed: ``last_stats`` is what was known before."""
        self._stats_failures = 0
        self._exact: tuple[float, IndexStats] | None = None
        self._exact_lock = asyncio.Lock()
        self.on_health: HealthHook | None = None
        self._logged: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._push: dict[str, tuple[int, Push]] = {}
        self._reclaim_tried: set[tuple[str, int]] = set()
        """(node, fencing token) of dead owners' nodes this replica tried to reclaim (once each)."""
        self.index_generation: str | None = None
        self.metrics.index_up.labels(index.backend).set(1)
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

    async def check_generation(self) -> None:
        """Compare the backend's generation with the last one seen; a change means it lost its data.
        Raises (ConnectionError) when the backend is unreachable."""
        index = self.index
        if index.remote is None:
            return  # in-process: its contents live exactly as long as it does
        async with self._gen_lock:  # a slow stale answer must not overwrite a newer one
            gen = await index.remote.generation()
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

    # --- index availability -----------------------------------------------------------------
    async def _set_up(self, up: bool) -> None:
        if up == self.index_up:
            return
        self.index_up = up
        if up:
            log.warning("index backend %s is up again", self.index.backend)
            self.index_down_reason = ""
        else:
            log.warning("index backend %s is DOWN (%s)", self.index.backend, self.index_down_reason)
        self.metrics.index_up.labels(self.index.backend).set(1 if up else 0)
        if self.on_health is not None:
            await self.on_health(up)

    async def index_down(self, reason: str) -> None:
        """An index call failed for lack of a backend: NOT_SERVING until a probe succeeds."""
        if self.index_up:
            self.index_down_reason = reason
        await self._set_up(False)

    async def probe_index(self) -> bool:
        """True when the index serves. When it was down: ping, then check its generation (a backend
        back empty makes every node resync before anything else touches it), then SERVING again."""
        if self.index_up:
            return True
        async with self._probe_lock:
            if self.index_up:
                return True
            try:
                ok = await asyncio.wait_for(ping(self.index), timeout=2.0)
                if ok:
                    await self.check_generation()
            except Exception as exc:
                log.debug("index probe failed: %s", exc)
                return False
            if ok:
                await self._set_up(True)
            return ok

    async def call_index(self, fn: Callable[[], Awaitable[_T]], what: str, keep_alive: NodeRecord | None,
                         still_wanted: Callable[[], bool] | None = None) -> tuple[bool, _T | None]:
        """Run an index call, retrying through outages with backoff until it succeeds.

        ``InvalidEvent`` propagates (bad input, never retried). Any other failure marks the index
        down and retries once a probe says it is back; meanwhile ``keep_alive``'s lease is renewed
        (its stream is open, it is the coordinator that stalls it). ``still_wanted`` is asked before
        each retry; when it says no (e.g. the backend came back empty and the node now resyncs, or the
        stream was superseded) the call is abandoned: returns ``(False, None)``. So is a write the
        backend refused because another replica took the node over (fencing): see :meth:`fenced_out`.
        """
        backoff = RETRY_INITIAL
        while True:
            try:
                return True, await fn()
            except (asyncio.CancelledError, InvalidEvent):
                raise
            except FencedWrite as exc:
                self.fenced_out(exc, keep_alive)
                return False, None
            except Exception as exc:
                self.log_once(
                    f"index-fail:{type(exc).__name__}",
                    logging.WARNING,
                    "index %s failed (%s: %s); keeping the work unacked and retrying (logged once per kind)",
                    what,
                    type(exc).__name__,
                    exc,
                )
                await self.index_down(f"{type(exc).__name__}: {exc}")
            while True:
                if keep_alive is not None:
                    self.registry.heard(keep_alive)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX)
                if still_wanted is not None and not still_wanted():
                    return False, None
                if await self.probe_index():
                    break
            if still_wanted is not None and not still_wanted():
                return False, None

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
            self.node_removed(rec)
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

    def drop_node(self, node_id: str) -> None:
        """Forget ``node_id`` now (RemoveNode, an unregistered engine): out of lookups at once, its record
        withdrawn from the other replicas, its entries reclaimed in the background."""
        rec = self.registry.remove(node_id)
        if rec is not None:
            self.node_removed(rec)
        self.remove_in_background(node_id)
        self.update_node_gauges()

    def remove_in_background(self, node_id: str, *, heard: float | None = None) -> None:
        """Reclaim a node's index entries off the request path; the registry already hides it.

        Retried through index outages (entries left behind would outlive the node). With replicas,
        ``heard`` (the expired record's last-heard monotonic time) makes it skip the removal when
        another replica took the node over since: that replica's snapshot must not be wiped.
        """

        async def remove() -> None:
            if heard is not None and self.directory is not None:
                try:
                    other = await self.directory.fetch(node_id)
                except Exception:
                    other = None
                mine = fence_token(self.index, node_id)
                if (other is not None and other.owner != self.replica_id
                        and other.outranks(mine, wall_of(heard))):
                    log.info("node %s: owned by replica %s now; its entries stay", node_id, other.owner)
                    return
            # Under the node's lock, like every index write for it: an apply already waiting on the
            # backend lands first and is then removed, instead of landing after the removal and
            # leaving orphan entries (Redis would allocate a fresh live location for them).
            async with self.registry.lock(node_id):
                await self.call_index(
                    lambda: self.index.remove_node(node_id), f"remove_node({node_id})", None
                )

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
            self.remove_in_background(rec.node_id, heard=rec.last_heard)
        if expired:
            self.update_node_gauges()
        return expired

    async def refresh(self) -> None:
        """Ping the index and refresh size gauges; flip health when the backend goes up or down."""
        if self.index_up:
            try:
                up = await asyncio.wait_for(ping(self.index), timeout=max(0.5, self.config.stats_interval))
            except Exception:
                up = False
            if not up:
                await self.index_down("ping failed")
            else:
                try:
                    await self.check_generation()
                except Exception as exc:
                    await self.index_down(f"generation check failed: {exc}")
        else:
            await self.probe_index()
        if self.index_up:
            index = self.index
            try:
                # The cheap figures: an exact distinct-block count can mean scanning millions of
                # fields on a sharded backend, not something to do every stats interval.
                stats = await index.stats(exact=False)
            except Exception as exc:
                self.stats_failed(exc)
            else:
                self.stats_ok()
                self.last_stats = stats
                self.metrics.set_index_stats(stats)
        self.update_node_gauges()

    def stats_failed(self, exc: BaseException) -> None:
        """An index stats call failed: the figures kept are stale (said in Stats), warned once per run
        of failures."""
        self.stats_stale = True
        self.log_once(
            f"stats-fail:{self._stats_failures}",
            logging.WARNING,
            "index stats failed (%s: %s); Stats and the size gauges keep the last figures, marked stale",
            type(exc).__name__,
            exc,
        )

    def stats_ok(self) -> None:
        if self.stats_stale:
            self.stats_stale = False
            self._stats_failures += 1  # a later failure warns again

    async def exact_stats(self) -> tuple[IndexStats | None, bool]:
        """Stats for the Stats RPC: current entries and bytes, and an exact distinct-block count.

        Where the exact count is expensive (a sharded backend's cheap figure is an upper bound), the
        exact one is computed here, not in the refresh loop, and reused for ``EXACT_STATS_SECONDS`` (a
        burst of Stats calls shares one scan). Returns (stats, stale): stale when the index failed and
        the figures are the last known.
        """
        index = self.index
        try:
            stats = await index.stats(exact=False)
            if stats.blocks_upper_bound:
                async with self._exact_lock:
                    cached = self._exact
                    if cached is None or time.monotonic() - cached[0] >= EXACT_STATS_SECONDS:
                        cached = self._exact = (time.monotonic(), await index.stats())
                stats = dataclasses.replace(
                    stats,
                    blocks=cached[1].blocks,
                    blocks_by_model=cached[1].blocks_by_model,
                    blocks_upper_bound=cached[1].blocks_upper_bound,
                )
        except Exception as exc:
            self.stats_failed(exc)
            return self.last_stats, True
        self.stats_ok()
        self.last_stats = stats
        return stats, False

    # --- shared node records (replicas) -----------------------------------------------------
    def _shared_record(self, rec: NodeRecord, now: float, now_wall: float) -> SharedNode:
        lease = self.registry.lease
        state = rec.state
        if state != EXPIRED and now - rec.last_heard > lease:
            state = EXPIRED
        heard = now_wall - (now - rec.last_heard)
        # Published with slack: readers keep the node until at least the owner's own deadline, and a
        # heartbeat republishes only once the true deadline moved by half the slack.
        trust, reason, cause = rec.trust
        return SharedNode(rec.node_id, rec.model, rec.dp_ranks, state, rec.epoch,
                          heard + lease + self._slack(), self.replica_id, heard,
                          rec.load, rec.serving_url, fence_token(self.index, rec.node_id), trust, reason,
                          cause)

    def _slack(self) -> float:
        return min(2.0, self.registry.lease / 2)

    def node_removed(self, rec: NodeRecord) -> None:
        """Publish that ``rec`` is gone (it is no longer in the registry to be published from)."""
        if self.directory is not None:
            node = self._shared_record(rec, time.monotonic(), time.time())
            node.state = EXPIRED
            self._removed.append(node)

    def _changed_records(self) -> list[SharedNode]:
        now, now_wall = time.monotonic(), time.time()
        out, self._removed = self._removed, []
        half = self._slack() / 2
        for rec in self.registry:
            node = self._shared_record(rec, now, now_wall)
            other = self.shared.get(rec.node_id)
            if (other is not None and other.owner != self.replica_id
                    and other.outranks(node.fence, node.heard)):
                continue  # moved to another replica; our record is stale
            sig = (node.model, node.dp_ranks, node.state, node.epoch, node.load, node.fence, node.trust,
                   node.trust_cause)
            last = self._published.get(rec.node_id)
            if last is None or last[0] != sig or node.deadline - last[1] > half:
                out.append(node)
        return out

    async def publish_nodes(self) -> None:
        """Write this replica's changed node records to the directory."""
        if self.directory is None:
            return
        nodes = self._changed_records()
        if not nodes:
            return
        try:
            await self.directory.publish(nodes)
        except Exception:
            self._removed.extend(n for n in nodes if n.state == EXPIRED and n.node_id not in self._published)
            raise
        known = {r.node_id for r in self.registry}
        for node_id in [k for k in self._published if k not in known]:
            del self._published[node_id]
        for n in nodes:
            sig = (n.model, n.dp_ranks, n.state, n.epoch, n.load, n.fence, n.trust, n.trust_cause)
            self._published[n.node_id] = (sig, n.deadline)

    async def read_shared(self) -> None:
        """Refresh the view of every replica's node records."""
        if self.directory is None:
            return
        view = await self.directory.fetch_all()
        models: dict[str, float] = {}
        for n in view.values():
            if n.state in ("active", "hash_mismatch") and n.deadline > models.get(n.model, 0.0):
                models[n.model] = n.deadline
        self.shared, self._shared_models = view, models
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
            self._keep(asyncio.get_running_loop().create_task(
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
        if other is not None and other.model == model and other.live(now_wall):
            return other.load, other.url, other.trust, other.trust_cause
        return None

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

    def start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._keep(loop.create_task(self._lease_loop(), name="kvcoord-leases"))
        self._keep(loop.create_task(self._refresh_loop(), name="kvcoord-refresh"))
        if self.directory is not None:
            self._keep(loop.create_task(self._directory_loop(), name="kvcoord-directory"))
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
            # Probe a down index often: ingest and lookups wait for it.
            if self.index_up:
                await asyncio.sleep(self.config.stats_interval)
            else:
                await asyncio.sleep(min(DOWN_PROBE_SECONDS, self.config.stats_interval))

    async def _directory_loop(self) -> None:
        next_read = 0.0
        while True:
            try:
                await self.publish_nodes()
                if time.monotonic() >= next_read:
                    next_read = time.monotonic() + REFRESH_SECONDS
                    await self.read_shared()
            except Exception as exc:
                self.log_once("directory-fail", logging.WARNING, "node directory unavailable: %s", exc)
            await asyncio.sleep(PUBLISH_SECONDS)

    async def stop_background(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.directory is not None:
            await self.directory.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.tokenizers.aclose(), timeout=1.0)
