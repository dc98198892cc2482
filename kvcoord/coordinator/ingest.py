"""One agent ingest stream: Hello, then numbered batches, snapshots and heartbeats.

Ordering contract (shared with kvcoord.agent.reporter):

1. The agent opens with Hello; the coordinator answers Welcome. ``snapshot_required`` is false only
   when the coordinator still holds this exact (node, epoch) in sync (a reconnect after a blip);
   then ``acked_seq`` tells the agent what to resend. ``verify`` names the verification sample.
2. Batch seqs count 1, 2, 3, ... per (node, epoch) across dp ranks (an ``EventBatches`` message carries
   several in order, each handled exactly as if sent alone, and the message gets one Ack once all
   of them were handled). ``seq == last+1`` is applied and acked (acks are cumulative, so the
   stream's writer coalesces them: at most one per 5 ms per stream); ``seq <= last`` is a duplicate
   (dropped, last re-acked); ``seq > last+1`` is a gap: the coordinator sends SnapshotRequest and
   discards batches until the snapshot arrives.
3. Snapshot chunks accumulate per dp rank until one has ``final``; then every rank of the Hello is
   replaced (ranks absent from the snapshot become empty), ``last = seq`` and Ack(seq).
4. An invalid batch is not applied: counted, logged once per kind, answered with SnapshotRequest.
   Protocol violations abort the stream with a precise status; nothing of the offending message
   is applied.
5. When the index backend reports a new generation (it lost its contents, e.g. Redis restarted
   empty), every node is marked resyncing and each connected agent gets
   ``SnapshotRequest("index_reset: ...")`` (see ``IndexHealth.check_generation``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError

from kvcoord.coordinator.auth import Principal
from kvcoord.coordinator.core import CoordinatorState, Push
from kvcoord.coordinator.incoming import KINDS, Incoming, WireBatch
from kvcoord.coordinator.learn import LEARN_FIRST
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.pools import check_pool_hello
from kvcoord.coordinator.registry import CHANGES, AnnouncedProfile, NodeRecord
from kvcoord.coordinator.snapshots import (
    LOST_CHARS,
    IngestAbort,
    PendingSnapshot,
    SnapshotStage,
    check_events,
)
from kvcoord.coordinator.verify import compare_announced
from kvcoord.events import CLEAR
from kvcoord.index.base import ApplyResult
from kvcoord.media import MISFIT_STORES, UNKNOWN_MEDIA
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.roles import check_role
from kvcoord.validate import (
    InvalidEvent,
    Op,
    OverLimit,
    check_batch_bounds,
    check_model,
    check_node_id,
    shown,
)
from kvcoord.wire import Sample, check_ranks, load_from_proto

log = logging.getLogger("kvcoord.coordinator.ingest")

MAX_DP_RANKS = 1024


def account(m: Metrics, batch: Incoming) -> None:
    """Count an applied batch: its events by kind, and its lag behind the engine."""
    m.batch("applied")
    stored, removed, cleared, _ = batch.kinds()
    if stored:
        m.applied("block_stored", stored)
    if removed:
        m.applied("block_removed", removed)
    if cleared:
        m.applied("all_blocks_cleared", cleared)
    if batch.ts > 0:
        m.ingest_lag.observe(max(0.0, time.time() - batch.ts))


class IngestSession:
    """State of one ingest stream. ``handle`` returns the messages to send back, or raises IngestAbort."""

    def __init__(
        self,
        state: CoordinatorState,
        principal: Principal,
        push: Push | None = None,
        ack: Callable[[int, int], None] | None = None,
    ) -> None:
        self.state = state
        self.principal = principal
        self.push = push
        """Queues a message on this stream outside a reply (the coordinator's resync requests)."""
        self.ack = ack
        """Queues Ack(epoch, seq) on the stream (cheaper than a reply message per applied batch); when
        None, applied batches reply with an Ack message."""
        self.rec: NodeRecord | None = None
        self.gen = 0
        self.model = ""
        self.node_id = ""
        self.dp_ranks: tuple[int, ...] = ()
        self.epoch = 0
        self._snapshot_stage = SnapshotStage(state)

    async def handle_bytes(self, data: bytes) -> list[pb.CoordinatorMessage]:
        """``handle`` for a serialised AgentMessage; one that does not parse, or names a dp rank past
        uint32 (which protobuf would silently cut to its low bits), is INVALID_ARGUMENT."""
        try:
            msg = pb.AgentMessage.FromString(data)
            check_ranks(data, msg.WhichOneof("msg"))
        except InvalidEvent as exc:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed AgentMessage: {str(exc) or type(exc).__name__}"
            ) from None
        return await self.handle(msg)

    async def handle(self, msg: pb.AgentMessage) -> list[pb.CoordinatorMessage]:
        which = msg.WhichOneof("msg")
        if which == "hello":
            return await self._hello(msg.hello)
        if self.rec is None:
            raise IngestAbort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"'{which or 'empty message'}' before Hello: the first message must be Hello",
            )
        rec = self._owned()
        self.state.registry.heard(rec)
        if rec.no_kv_events and which in ("batch", "batches"):  # one attribute read per message
            check_events(rec)
        if which == "batch":
            return await self._batch(rec, WireBatch(msg.batch))
        if which == "batches":
            return await self._batches(rec, [WireBatch(b) for b in msg.batches.batches])
        if which == "snapshot":
            return await self._snapshot(rec, msg.snapshot)
        if which == "heartbeat":
            if msg.heartbeat.HasField("load"):
                rec.load = load_from_proto(msg.heartbeat.load)
            for tally, skipped in ((UNKNOWN_MEDIA, msg.heartbeat.unknown_media),
                                   (MISFIT_STORES, msg.heartbeat.misfit_stores)):
                for name, n in skipped.items():  # what the agent skipped, for the metric
                    tally.add(name[:64], n, fresh=False, where=f"node {shown(rec.node_id)}")
            return []
        raise IngestAbort(
            grpc.StatusCode.INVALID_ARGUMENT, "empty AgentMessage (no hello/batch/snapshot/heartbeat)"
        )

    async def batches(self, batches: Sequence[Incoming]) -> list[pb.CoordinatorMessage]:
        """Batches fed in-process (after a Hello through :meth:`handle`), exactly as if they had come
        in one ``EventBatches`` message (one alone: as one ``EventBatch``)."""
        if self.rec is None:
            raise IngestAbort(grpc.StatusCode.FAILED_PRECONDITION, "batch before Hello")
        rec = self._owned()
        check_events(rec)
        self.state.registry.heard(rec)
        if len(batches) == 1:
            return await self._batch(rec, batches[0])
        return await self._batches(rec, batches)

    def close(self) -> None:
        """The stream ended: forget how to reach it, and release its unfinished snapshot."""
        self._snapshot_stage.drop()
        if self.rec is not None:
            self.state.detach(self.rec.node_id, self.gen)

    def _owned(self) -> NodeRecord:
        rec = self.rec
        assert rec is not None
        if not self.state.registry.owns(rec, self.gen):
            current = self.state.registry.get(rec.node_id)
            if current is None or current.expired or rec.expired:
                raise IngestAbort(
                    grpc.StatusCode.ABORTED,
                    f"node {rec.node_id} expired or was removed; reconnect with Hello and a snapshot",
                )
            raise IngestAbort(
                grpc.StatusCode.ABORTED, f"node {rec.node_id}: superseded by a newer ingest stream"
            )
        return rec

    # --- hello ------------------------------------------------------------------------------
    def _check_hello(self, hello: pb.Hello) -> tuple[int, ...]:
        """The Hello's dp ranks, after every check that refuses the stream."""
        cfg = self.state.config
        if self.rec is not None:
            raise IngestAbort(grpc.StatusCode.FAILED_PRECONDITION, "second Hello on one stream")
        try:
            check_node_id(hello.node_id, "Hello.node_id")
            check_model(hello.model, "Hello.model")
        except InvalidEvent as exc:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        ranks = tuple(sorted(set(hello.dp_ranks))) or (0,)
        if len(ranks) != len(hello.dp_ranks) and hello.dp_ranks:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, "Hello.dp_ranks has duplicates")
        if len(ranks) > MAX_DP_RANKS:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Hello.dp_ranks: more than {MAX_DP_RANKS} ranks"
            )
        try:
            check_pool_hello(hello.node_id, hello.pool_publisher, hello.pools)
            check_role(hello.role, "Hello.role", publisher=hello.pool_publisher)
        except ValueError as exc:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, f"Hello: {exc}") from None
        if not self.principal.may_publish(hello.node_id):
            raise IngestAbort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token may not publish for node {shown(hello.node_id)}",
            )
        if hello.model not in cfg.models and cfg.strict_models:
            raise IngestAbort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {shown(hello.model)} (strict_models; configured: "
                f"{', '.join(sorted(cfg.models)) or 'none'})",
            )
        return ranks

    async def _hello(self, hello: pb.Hello) -> list[pb.CoordinatorMessage]:
        ranks = self._check_hello(hello)
        st, cfg = self.state, self.state.config
        profile = cfg.profile(hello.model)
        rec, resume = st.registry.hello(
            hello.node_id, hello.model, ranks, hello.epoch, index_ok=st.health.up, next_seq=hello.next_seq,
            no_kv_events=hello.no_kv_events,
        )
        if not resume and st.index.fencing is not None:  # a new owner: fence out earlier ones (a resumed
            await st.index.fencing.claim(rec.node_id)  # stream keeps its token)
        st.metrics.model_seen(hello.model)
        self.rec, self.gen = rec, rec.stream_gen
        rec.serving_url = "" if hello.pool_publisher else hello.serving_url  # a publisher is never routed to
        rec.role = check_role(hello.role)
        if hello.pool_publisher:
            st.pools.publisher(rec.node_id, hello.pool_publisher)
        else:
            st.metrics.unknown_pools.inc(len(st.pools.announce(rec.node_id, hello.pools)))
        if self.push is not None:
            st.attach(rec.node_id, rec.stream_gen, self.push)
        self.node_id, self.model, self.dp_ranks, self.epoch = hello.node_id, hello.model, ranks, hello.epoch
        rec.announced = None
        if hello.HasField("hash_profile"):
            hp = hello.hash_profile
            rec.announced = AnnouncedProfile(
                hp.algo, hp.block_size, hp.style, hp.none_hash_fingerprint, hp.engine_release
            )
            if profile is not None and not rec.no_kv_events:  # no hashes to mismatch: stays approximate
                reason = compare_announced(rec.announced, profile)
                if reason is not None:
                    st.mark_hash_mismatch(rec, reason, notify=False)  # said in the Welcome
        welcome = pb.Welcome(
            epoch=hello.epoch,
            acked_seq=rec.last_seq if resume else 0,
            lease_seconds=cfg.lease_seconds,
            snapshot_required=not resume,
            hash_mismatch=rec.hash_mismatch_reason if rec.hash_mismatch else "",
        )
        if profile is not None and cfg.verify.enabled:
            welcome.verify.CopyFrom(
                pb.VerifySample(first=cfg.verify.first, every=cfg.verify.sample_every,
                                block_size=profile.block_size)
            )
        elif not rec.no_kv_events and st.learner.wants_samples(st, hello.model):  # samples to learn from
            welcome.verify.CopyFrom(pb.VerifySample(first=max(cfg.verify.first, LEARN_FIRST),
                                                    every=cfg.verify.sample_every))
        if not resume:
            st.metrics.snapshot_requested("hello")
        st.update_node_gauges()
        log.info(
            "node %s (model %s, ranks %s) epoch %d: %s",
            hello.node_id,
            hello.model,
            list(ranks),
            hello.epoch,
            f"resumed after seq {rec.last_seq}" if resume else "snapshot required",
        )
        return [pb.CoordinatorMessage(welcome=welcome)]

    def _wanted(self, rec: NodeRecord, *, need_sync: bool) -> bool:
        """Whether a stalled index call of this stream is still worth retrying."""
        if not self.state.registry.owns(rec, self.gen):
            return False
        return not (need_sync and rec.resyncing)

    # --- batches ----------------------------------------------------------------------------
    def _request_snapshot(self, rec: NodeRecord, reason: str, detail: str) -> list[pb.CoordinatorMessage]:
        rec.resyncing = True
        self._snapshot_stage.drop()
        self.state.metrics.snapshot_requested(reason)
        req = pb.SnapshotRequest(epoch=self.epoch, reason=f"{reason}: {detail}")
        return [pb.CoordinatorMessage(snapshot_request=req)]

    def _count_rejected(self, batch: Incoming, reason: str) -> None:
        m = self.state.metrics
        for kind, n in zip(KINDS, batch.kinds(), strict=True):
            if n:
                m.rejected(kind, reason, n)

    def _reject(
        self, rec: NodeRecord, batch: Incoming, reason: str, detail: str
    ) -> list[pb.CoordinatorMessage]:
        m = self.state.metrics
        m.batch("rejected")
        self._count_rejected(batch, reason)
        if not batch.size():
            m.rejected("none", reason, 0)
        self.state.log_once(
            f"reject:{reason}",
            logging.WARNING,
            "node %s: batch %d rejected (%s): %s; asking for a snapshot (logged once per kind)",
            rec.node_id,
            batch.seq,
            reason,
            detail,
        )
        return self._request_snapshot(rec, "invalid_batch", f"batch {batch.seq} {reason}: {detail}")

    def _acked(self, seq: int, defer: bool) -> list[pb.CoordinatorMessage]:
        """Ack(seq): queued on the stream's writer (coalesced there), or returned as a reply."""
        if self.ack is not None and not defer:
            self.ack(self.epoch, seq)
            return []
        return [pb.CoordinatorMessage(ack=pb.Ack(epoch=self.epoch, seq=seq))]

    def _check_size(self, rec: NodeRecord, batch: Incoming) -> None:
        """Refuse a batch past ``max_events_per_batch`` before decoding it: INVALID_ARGUMENT, nothing
        applied. The node then lacks this batch, so it resyncs, as past the other bounds: its agent
        reconnects with a snapshot instead of sending the same batch again."""
        limit = self.state.config.limits.max_events_per_batch
        if batch.size() > limit:
            self.state.metrics.batch("too_large")
            rec.resyncing = True
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch {batch.seq} has {batch.size()} events; max_events_per_batch is {limit}",
            )

    def _ordering(
        self, rec: NodeRecord, batch: Incoming, defer_ack: bool
    ) -> list[pb.CoordinatorMessage] | None:
        """The reply when this batch is not the next one to apply (None: apply it)."""
        st = self.state
        if rec.resyncing:
            st.metrics.batch("awaiting_snapshot")
            return []
        last, seq = rec.last_seq, batch.seq
        if seq <= last:
            st.metrics.batch("duplicate")
            return self._acked(last, defer_ack)
        if seq > last + 1:
            st.metrics.batch("gap")
            st.log_once(f"gap:{rec.node_id}:{self.epoch}", logging.INFO,
                        "node %s: gap (expected seq %d, got %d); asking for a snapshot",
                        rec.node_id, last + 1, seq)
            return self._request_snapshot(rec, "gap", f"expected seq {last + 1}, got {seq}")
        if batch.dp_rank not in self.dp_ranks:
            return self._reject(rec, batch, "unknown_dp_rank",
                                f"dp_rank {batch.dp_rank} is not in the Hello's {list(self.dp_ranks)}")
        return None

    def _check_bounds(self, rec: NodeRecord, ops: Sequence[Op], batch: Incoming) -> None:
        """Refuse a valid batch past ``max_hashes_per_batch``, or one that could take the node past
        ``max_entries_per_node``: RESOURCE_EXHAUSTED, nothing applied. The node's entries now miss this
        batch, so it resyncs: its agent reconnects with a snapshot (bounded too), never this batch."""
        lim = self.state.config.limits
        try:
            check_batch_bounds(ops, rec.entries, max_hashes=lim.max_hashes_per_batch,
                               max_entries=lim.max_entries_per_node)
        except OverLimit as exc:
            m = self.state.metrics
            m.batch("too_large")
            per_batch = exc.limit == "max_hashes_per_batch"
            self._count_rejected(batch, "max_hashes_per_batch" if per_batch else "max_entries_per_node")
            rec.resyncing = True
            self.state.log_once(f"bound:{exc.limit}:{rec.node_id}", logging.WARNING,
                                "node %s: batch %d refused: %s (logged once per node)",
                                rec.node_id, batch.seq, exc)
            raise IngestAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"batch {batch.seq}: {exc}") from None

    async def _apply(self, rec: NodeRecord, dp_rank: int, ops: Sequence[Op]) -> bool:
        """Apply through index outages (the batch stays unacked and is retried; re-applying a batch that
        half-reached the backend is safe, events are idempotent). False: abandoned (a snapshot follows).
        Keeps ``rec.entries`` (what the node holds, for ``max_entries_per_node``) current."""
        st = self.state
        done, res = await st.health.call(
            lambda: st.index.apply(self.model, rec.node_id, dp_rank, ops),
            f"apply for node {rec.node_id}",
            rec,
            lambda: self._wanted(rec, need_sync=True),
        )
        if isinstance(res, ApplyResult):
            rec.entries = max(0, rec.entries + res.stored - res.removed - res.cleared)
        if not done:
            self._owned()  # fenced out by another replica (or superseded): the stream ends now
        return done

    async def _batch(
        self, rec: NodeRecord, batch: Incoming, *, defer_ack: bool = False
    ) -> list[pb.CoordinatorMessage]:
        """One numbered batch. ``defer_ack``: return the Ack as a reply (the group it belongs to sends
        one Ack) instead of queueing it at once."""
        st = self.state
        async with st.registry.lock(rec.node_id):
            rec = self._owned()
            self._check_size(rec, batch)
            early = self._ordering(rec, batch, defer_ack)
            if early is not None:
                return early
            try:
                ops = batch.ops()
            except InvalidEvent as exc:
                return self._reject(rec, batch, "invalid_event", str(exc))
            samples = self._samples(rec, batch)
            self._check_bounds(rec, ops, batch)
            if not await self._apply(rec, batch.dp_rank, ops):
                st.metrics.batch("awaiting_snapshot")
                return []
            rec = self._owned()
            rec.last_seq = batch.seq
            rec.indexed.add((self.model, batch.dp_rank))
            self._note_history(rec, batch.dp_rank, ops, batch.history_lost)
        account(self.state.metrics, batch)
        if samples:
            self._verify(rec, samples)
        return self._acked(batch.seq, defer_ack)

    async def _batches(
        self, rec: NodeRecord, batches: Sequence[Incoming]
    ) -> list[pb.CoordinatorMessage]:
        """Each batch on its own, in order, as if sent alone. Acks are cumulative: a group gets one
        Ack, for its last applied batch, after every batch of it was handled (and before any other
        reply that followed it, such as a SnapshotRequest)."""
        done = await self._group(rec, batches)
        if done is not None:
            return done
        out: list[pb.CoordinatorMessage] = []
        for batch in batches:
            replies = await self._batch(rec, batch, defer_ack=True)
            if replies and out and out[-1].HasField("ack") and replies[0].HasField("ack"):
                out.pop()
            out.extend(replies)
        return out

    async def _group(
        self, rec: NodeRecord, batches: Sequence[Incoming]
    ) -> list[pb.CoordinatorMessage] | None:
        """Several batches in one index call, when that ends exactly as applying them one by one would:
        consecutive seqs right after the last, one known dp rank, none too large or sampled, the node in
        sync, and every event valid. None: nothing was done, take them one by one."""
        first = batches[0] if batches else None
        if first is None or len(batches) < 2 or first.dp_rank not in self.dp_ranks:
            return None
        limit = self.state.config.limits.max_events_per_batch
        ops: list[Op] = []
        for k, b in enumerate(batches):
            if (b.seq != first.seq + k or b.dp_rank != first.dp_rank or b.sampled or b.size() > limit
                    or b.history_lost is not None):
                return None
            try:
                ops += b.ops()
            except InvalidEvent:
                return None  # one batch is bad: the one-by-one path applies those before it
        st = self.state
        async with st.registry.lock(rec.node_id):
            rec = self._owned()
            if rec.resyncing or first.seq != rec.last_seq + 1:
                return None
            lim = st.config.limits
            try:  # (the one-by-one path refuses the batch that is past a bound)
                check_batch_bounds(ops, rec.entries, max_hashes=lim.max_hashes_per_batch,
                                   max_entries=lim.max_entries_per_node)
            except OverLimit:
                return None
            if not await self._apply(rec, first.dp_rank, ops):
                st.metrics.batch("awaiting_snapshot")
                return []
            rec = self._owned()
            rec.last_seq = batches[-1].seq
            rec.indexed.add((self.model, first.dp_rank))
            self._note_history(rec, first.dp_rank, ops, None)
        for b in batches:
            account(self.state.metrics, b)
        return self._acked(batches[-1].seq, defer=True)

    def _note_history(self, rec: NodeRecord, rank: int, ops: Sequence[Op], lost: str | None) -> None:
        """Keep ``rank``'s lost-history mark (see ``trust_state``): an AllBlocksCleared among the applied
        ``ops`` ends it (the engine starts from nothing again); the batch's ``history_lost`` then sets it,
        as it stands for after the batch's events (a relay sends its own clear and the mark together)."""
        marks = rec.history_lost
        before = marks.get(rank)
        if before is not None and any(op[0] == CLEAR for op in ops):
            del marks[rank]
        if lost is not None:
            marks[rank] = shown(lost, LOST_CHARS, quote=False)
        if marks.get(rank) == before:
            return
        CHANGES.bump(rec.node_id)  # changed in place: lookups' views of the node are stale
        self.state.update_node_gauges()
        now = marks.get(rank)
        self.state.log_once(f"history:{rec.node_id}:{self.epoch}:{rank}:{now is None}", logging.WARNING,
                            "node %s dp rank %d: %s (logged once per node, rank and change)", rec.node_id,
                            rank, f"degraded: {now}" if now is not None else "history whole again: exact")

    def _samples(self, rec: NodeRecord, batch: Incoming) -> Sequence[Sample]:
        """A sampled batch's verification samples, read before anything is applied: one that cannot be
        read (the agent's fault, not the engine's) ends the stream with INVALID_ARGUMENT, nothing applied;
        the node then lacks the batch and resyncs, as past ``max_events_per_batch``."""
        if not batch.sampled:
            return ()
        try:
            return batch.samples()
        except InvalidEvent as exc:
            rec.resyncing = True
            self.state.metrics.batch("rejected")
            self._count_rejected(batch, "invalid_event")
            self.state.log_once(f"bad-sample:{rec.node_id}", logging.WARNING,
                                "node %s: batch %d refused, unusable verification sample: %s (logged once "
                                "per node)", rec.node_id, batch.seq, exc)
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"batch {batch.seq}: unusable verification sample: {exc}") from None

    def _verify(self, rec: NodeRecord, samples: Sequence[Sample]) -> None:
        """Hash verification of an applied batch's samples; a mismatch marks the node (and tells it)."""
        st = self.state
        profile = st.config.profile(self.model)
        if profile is None and not rec.hash_mismatch and st.verifier.cfg.enabled:
            st.learner.observe(st, rec, self.model, samples)
            return
        if profile is None or rec.hash_mismatch or not st.verifier.cfg.enabled:
            return
        reason = st.verifier.check(rec, self.model, profile, samples)
        if reason is not None:
            st.mark_hash_mismatch(rec, reason)

    # --- snapshots --------------------------------------------------------------------------
    async def _snapshot(self, rec: NodeRecord, snap: pb.Snapshot) -> list[pb.CoordinatorMessage]:
        pending = self._snapshot_stage.add(snap, self.epoch, self.dp_ranks, self.rec, self.node_id)
        if not snap.final:
            # Yield to the loop: a stream's buffered chunks are read without suspending, so 8 flooding
            # streams were staged back to back for 50-140 ms while lookups waited.
            await asyncio.sleep(0)
            return []
        self._snapshot_stage.pending = None  # detached, still counted as staged until applied or abandoned
        count = pending.count
        try:
            return await self._apply_snapshot(rec, pending)
        finally:
            del pending
            self._snapshot_stage.release(count)

    async def _apply_snapshot(self, rec: NodeRecord,
                              pending: PendingSnapshot) -> list[pb.CoordinatorMessage]:
        st = self.state
        reg = st.registry
        node_lock = reg.lock(rec.node_id)
        while True:
            # A pending removal takes the node's lock itself: wait for it outside the lock (inside, it
            # would deadlock), then make sure no new one was queued meanwhile.
            await reg.wait_removal(rec.node_id)
            await node_lock.acquire()
            if not reg.removal_pending(rec.node_id):
                break
            node_lock.release()
        try:
            rec = self._owned()
            keep = {(self.model, r) for r in self.dp_ranks}
            node_id, indexed = rec.node_id, set(rec.indexed)

            async def replace() -> None:
                for rank in self.dp_ranks:
                    await st.index.replace_node(self.model, node_id, rank, pending.joined(rank),
                                                bytes(pending.tiers.get(rank, b"")))
                for model, rank in sorted(indexed - keep):
                    await st.index.clear(model, node_id, rank)

            # Retried through an outage (a snapshot is a whole replacement: re-running it is exact).
            done, _ = await st.health.call(
                replace, f"snapshot for node {node_id}", rec, lambda: self._wanted(rec, need_sync=False)
            )
            rec = self._owned()
            if not done:
                return []
            rec.indexed = keep
            rec.entries = pending.count
            rec.last_seq = pending.seq
            rec.resyncing = False
            rec.history_lost = dict(pending.lost)  # the snapshot says it all, marks included
        finally:
            node_lock.release()
        st.metrics.snapshots_applied.inc()
        st.update_node_gauges()
        log.info("node %s epoch %d: snapshot applied at seq %d (%d blocks over %d ranks)",
                 rec.node_id, self.epoch, pending.seq, pending.count, len(self.dp_ranks))
        return [pb.CoordinatorMessage(ack=pb.Ack(epoch=self.epoch, seq=pending.seq))]


__all__ = ["IngestSession"]
