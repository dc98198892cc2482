"""One agent ingest stream: Hello, then numbered batches, snapshots and heartbeats.

Ordering contract (shared with kvcoord.agent.reporter):

1. The agent opens with Hello; the coordinator answers Welcome. ``snapshot_required`` is false only
   when the coordinator still holds this exact (node, epoch) in sync (a reconnect after a blip);
   then ``acked_seq`` tells the agent what to resend.
2. Batch seqs count 1, 2, 3, ... per (node, epoch) across dp ranks (an ``EventBatches`` message carries
   several in order, each handled exactly as if sent alone, and the message gets one Ack once all
   of them were handled). ``seq == last+1`` is applied and acked (acks are cumulative, so the
   stream's writer coalesces them: at most one per 5 ms per stream); ``seq <= last`` is a duplicate
   (dropped, last re-acked); ``seq > last+1`` is a gap: the
   coordinator sends SnapshotRequest and discards batches until the snapshot arrives.
3. Snapshot chunks accumulate per dp rank until one has ``final``; then every rank of the Hello is
   replaced (ranks absent from the snapshot become empty), ``last = seq`` and Ack(seq).
4. An invalid batch is not applied: counted, logged once per kind, answered with SnapshotRequest.
   Protocol violations abort the stream with a precise status; nothing of the offending message
   is applied.
5. When the index backend reports a new generation (it lost its contents, e.g. Redis restarted
   empty), every node is marked resyncing and each connected agent gets
   ``SnapshotRequest("index_reset: ...")`` (see ``CoordinatorState.check_generation``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast

import grpc
from google.protobuf.message import DecodeError

from kvcoord.coordinator.auth import Principal
from kvcoord.coordinator.core import CoordinatorState, Push
from kvcoord.coordinator.registry import AnnouncedProfile, Load, NodeRecord
from kvcoord.coordinator.verify import compare_announced
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.events_proto import events_for_index, raw_events_for_index
from kvcoord.hashing import BlockHash64, HashProfile
from kvcoord.index.base import ApplyResult, InvalidEvent, SnapshotEntry
from kvcoord.index.memory import RawEvent
from kvcoord.proto.v1 import kvcoord_pb2 as pb

try:
    from kvcoord import _wirescan
except ImportError:  # pragma: no cover - built whenever a compiler is present (CI requires it)
    _wirescan = None  # type: ignore[assignment]
_scan = _wirescan.scan if _wirescan is not None else None

StoredInfo: TypeAlias = tuple[int, int, int, "int | bytes | None", "str | None"]
"""A scanned BlockStored's ``(n_hashes, n_tokens, block_size, parent, kv_cache_spec_kind)``."""
ScannedBatch: TypeAlias = tuple[
    int, float, int, bool, int, int, int, int, list[RawEvent], list[StoredInfo], int, int
]
"""One EventBatch as ``kvcoord._wirescan.scan`` returns it: ``(seq, ts, dp_rank, dp_rank_absent,
n_events, n_stored, n_removed, n_cleared, raw_events, stored_info, start, end)``."""

log = logging.getLogger("kvcoord.coordinator.ingest")

BATCH_TAG = b"\x12"
"""The first byte of an ``AgentMessage{batch}`` (field 2, length-delimited); ``batches`` starts ``\x2a``."""
MAX_ID_LEN = 256
MAX_DP_RANKS = 1024
_TIERS = tuple(Tier)


class IngestAbort(Exception):
    """End the stream with this status; raised before anything of the message is applied."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def event_kind(ev: KVEvent) -> str:
    if isinstance(ev, BlockStored):
        return "block_stored"
    if isinstance(ev, BlockRemoved):
        return "block_removed"
    if isinstance(ev, AllBlocksCleared):
        return "all_blocks_cleared"
    return "unknown"


_PROTO_KINDS = {"stored": "block_stored", "removed": "block_removed", "cleared": "all_blocks_cleared"}


def proto_event_kind(ev: pb.KVEvent) -> str:
    return _PROTO_KINDS.get(ev.WhichOneof("event") or "", "unknown")


def load_from_proto(load: pb.Load) -> Load:
    kv = float(load.kv_usage)
    return Load(int(load.running_requests), int(load.waiting_requests), kv if 0.0 <= kv <= 1.0 else 0.0)


DirectApply = Callable[[str, str, int, Sequence[RawEvent]], ApplyResult]


def _direct_apply(index: object) -> DirectApply | None:
    """The index's ``apply_raw_sync`` (the memory backend's), unless the class overrides ``apply``
    below the one defining it (a wrapping or instrumented index keeps its own ``apply`` path)."""
    fn: DirectApply | None = getattr(index, "apply_raw_sync", None)
    if fn is None:
        return None
    mro = type(index).__mro__
    owner_raw = next((c for c in mro if "apply_raw_sync" in c.__dict__), None)
    owner_apply = next((c for c in mro if "apply" in c.__dict__), None)
    return fn if owner_raw is owner_apply else None


def _as_pb(batch: pb.EventBatch | ScannedBatch, data: bytes) -> pb.EventBatch:
    """The protobuf form of a batch (a scanned one is parsed from its span of ``data``)."""
    if isinstance(batch, pb.EventBatch):
        return batch
    return pb.EventBatch.FromString(data[batch[10] : batch[11]])


@dataclass(slots=True)
class _PendingSnapshot:
    epoch: int
    seq: int
    entries: dict[int, list[SnapshotEntry]]
    count: int = 0


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
        self._pending: _PendingSnapshot | None = None
        self._apply_raw = _direct_apply(state.index)
        """The in-process index's direct entry point (memory backend): batches skip event objects,
        the retry wrapper and a coroutine per batch (it cannot fail transiently). None: generic path."""
        takes_packed = self._apply_raw is not None and bool(getattr(state.index, "takes_packed", False))
        self._scan = _scan if takes_packed else None
        """``kvcoord._wirescan.scan`` when the index reads its packed hashes; None: always protobuf."""

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
        if which == "batch":
            return await self._batch(rec, msg.batch)
        if which == "batches":
            return await self._batches(rec, msg.batches.batches)
        if which == "snapshot":
            return await self._snapshot(rec, msg.snapshot)
        if which == "heartbeat":
            if msg.heartbeat.HasField("load"):
                rec.load = load_from_proto(msg.heartbeat.load)
            return []
        raise IngestAbort(
            grpc.StatusCode.INVALID_ARGUMENT, "empty AgentMessage (no hello/batch/snapshot/heartbeat)"
        )

    async def handle_bytes(self, data: bytes) -> list[pb.CoordinatorMessage]:
        """``handle`` for a serialised AgentMessage. After Hello, a batch message is read by
        ``kvcoord._wirescan`` when the index takes its packed hashes (the memory backend): that skips
        decoding token ids, which the index never reads. Whatever the scanner declines is parsed with
        protobuf; a message that does not parse raises ``IngestAbort`` (INVALID_ARGUMENT)."""
        if self._scan is not None and self.rec is not None:
            scanned = self._scan(data)
            if scanned is not None:
                return await self.handle_scanned(scanned, data)
        try:
            msg = pb.AgentMessage.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed AgentMessage: {str(exc) or type(exc).__name__}"
            ) from None
        return await self.handle(msg)

    async def handle_scanned(
        self, batches: Sequence[ScannedBatch], data: bytes
    ) -> list[pb.CoordinatorMessage]:
        """``handle`` for a ``batch``/``batches`` message read by ``kvcoord._wirescan`` (after Hello):
        the same checks, answers and effects, from the scanner's tuples instead of protobuf objects."""
        if self.rec is None:
            raise IngestAbort(
                grpc.StatusCode.FAILED_PRECONDITION, "'batch' before Hello: the first message must be Hello"
            )
        rec = self._owned()
        self.state.registry.heard(rec)
        if data[:1] == BATCH_TAG:
            return await self._batch(rec, batches[0], data)
        done = await self._group(rec, batches, data)
        if done is not None:
            return done
        return await self._batches(rec, batches, data)

    async def _group(
        self, rec: NodeRecord, batches: Sequence[ScannedBatch], data: bytes
    ) -> list[pb.CoordinatorMessage] | None:
        """Several scanned batches in one apply, when that ends exactly as applying them one by one
        would: consecutive seqs right after the last, one known dp rank, none too large, the node in
        sync, and every event valid (validation precedes any change). None: nothing was done, take
        them one by one. Then per-batch costs (lock, checks, index call, metrics) are paid once."""
        apply_raw = self._apply_raw
        st = self.state
        first = batches[0]
        dp_rank = first[2]
        if apply_raw is None or dp_rank not in self.dp_ranks:
            return None
        limit = st.config.limits.max_events_per_batch
        seq = first[0]
        raw: list[RawEvent] = []
        for b in batches:
            if b[0] != seq or b[2] != dp_rank or b[4] > limit:
                return None
            seq += 1
            raw += b[8]
        async with st.registry.lock(rec.node_id):
            rec = self._owned()
            if rec.resyncing or first[0] != rec.last_seq + 1:
                return None
            profile = st.config.profile(self.model)
            verify = profile is not None and not rec.hash_mismatch and st.verifier.cfg.enabled
            try:
                apply_raw(self.model, rec.node_id, dp_rank, raw)
            except InvalidEvent:
                return None  # one batch is bad: the one-by-one path applies those before it
            last = batches[-1][0]
            rec.last_seq = last
            rec.indexed.add((self.model, dp_rank))
        stored = removed = cleared = 0
        for b in batches:
            stored += b[5]
            removed += b[6]
            cleared += b[7]
            if b[1] > 0:
                st.metrics.ingest_lag.observe(max(0.0, time.time() - b[1]))
            if verify and profile is not None:
                verify = not self._verify(rec, profile, b, data)
        self._account_counts(0.0, stored, removed, cleared, batches=len(batches))
        return self._acked(last, defer=True)  # a group's one Ack is a reply, as in _batches

    async def _batches(
        self, rec: NodeRecord, batches: Sequence[pb.EventBatch | ScannedBatch], data: bytes = b""
    ) -> list[pb.CoordinatorMessage]:
        """Each batch on its own, in order, as if sent alone. Acks are cumulative: a group gets one
        Ack, for its last applied batch, after every batch of it was handled (and before any other
        reply that followed it, such as a SnapshotRequest)."""
        out: list[pb.CoordinatorMessage] = []
        for batch in batches:
            replies = await self._batch(rec, batch, data, defer_ack=True)
            if replies and out and out[-1].HasField("ack") and replies[0].HasField("ack"):
                out.pop()
            out.extend(replies)
        return out

    def close(self) -> None:
        """The stream ended: forget how to reach it."""
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
    async def _hello(self, hello: pb.Hello) -> list[pb.CoordinatorMessage]:
        cfg = self.state.config
        if self.rec is not None:
            raise IngestAbort(grpc.StatusCode.FAILED_PRECONDITION, "second Hello on one stream")
        if not hello.node_id or len(hello.node_id) > MAX_ID_LEN:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Hello.node_id must be 1..{MAX_ID_LEN} characters"
            )
        if not hello.model or len(hello.model) > MAX_ID_LEN:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Hello.model must be 1..{MAX_ID_LEN} characters"
            )
        ranks = tuple(sorted(set(hello.dp_ranks))) or (0,)
        if len(ranks) != len(hello.dp_ranks) and hello.dp_ranks:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, "Hello.dp_ranks has duplicates")
        if len(ranks) > MAX_DP_RANKS:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Hello.dp_ranks: more than {MAX_DP_RANKS} ranks"
            )
        if not self.principal.may_publish(hello.node_id):
            raise IngestAbort(
                grpc.StatusCode.PERMISSION_DENIED, f"this token may not publish for node {hello.node_id!r}"
            )
        profile = cfg.profile(hello.model)
        if profile is None and cfg.strict_models:
            raise IngestAbort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {hello.model!r} (strict_models; configured: "
                f"{', '.join(sorted(cfg.models)) or 'none'})",
            )
        reg = self.state.registry
        rec, resume = reg.hello(
            hello.node_id,
            hello.model,
            ranks,
            hello.epoch,
            index_ok=self.state.index_up,
            next_seq=hello.next_seq,
        )
        self.rec, self.gen = rec, rec.stream_gen
        self.state.metrics.model_seen(hello.model)
        if self.push is not None:
            self.state.attach(rec.node_id, rec.stream_gen, self.push)
        self.node_id, self.model, self.dp_ranks, self.epoch = hello.node_id, hello.model, ranks, hello.epoch
        if hello.HasField("hash_profile"):
            hp = hello.hash_profile
            rec.announced = AnnouncedProfile(
                hp.algo, hp.block_size, hp.style, hp.none_hash_fingerprint, hp.engine_release
            )
            if profile is not None:
                reason = compare_announced(rec.announced, profile)
                if reason is not None:
                    self.state.mark_hash_mismatch(rec, reason, notify=False)  # said in the Welcome
        else:
            rec.announced = None
        out = [
            pb.CoordinatorMessage(
                welcome=pb.Welcome(
                    epoch=hello.epoch,
                    acked_seq=rec.last_seq if resume else 0,
                    lease_seconds=cfg.lease_seconds,
                    snapshot_required=not resume,
                    batch_groups=True,
                    hash_mismatch=rec.hash_mismatch_reason if rec.hash_mismatch else "",
                )
            )
        ]
        if not resume:
            self.state.metrics.snapshot_requested("hello")
        log.info(
            "node %s (model %s, ranks %s) epoch %d: %s",
            hello.node_id,
            hello.model,
            list(ranks),
            hello.epoch,
            f"resumed after seq {rec.last_seq}" if resume else "snapshot required",
        )
        return out

    def _wanted(self, rec: NodeRecord, *, need_sync: bool) -> bool:
        """Whether a stalled index call of this stream is still worth retrying."""
        if not self.state.registry.owns(rec, self.gen):
            return False
        return not (need_sync and rec.resyncing)

    # --- batches ----------------------------------------------------------------------------
    def _request_snapshot(self, rec: NodeRecord, reason: str, detail: str) -> list[pb.CoordinatorMessage]:
        rec.resyncing = True
        self._pending = None
        self.state.metrics.snapshot_requested(reason)
        req = pb.SnapshotRequest(epoch=self.epoch, reason=f"{reason}: {detail}")
        return [pb.CoordinatorMessage(snapshot_request=req)]

    def _reject(
        self, rec: NodeRecord, batch: pb.EventBatch, reason: str, detail: str
    ) -> list[pb.CoordinatorMessage]:
        m = self.state.metrics
        m.batch("rejected")
        for ev in batch.events:
            m.rejected(proto_event_kind(ev), reason)
        if not batch.events:
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

    def _undecodable(
        self, rec: NodeRecord, batch: pb.EventBatch, exc: Exception
    ) -> list[pb.CoordinatorMessage]:
        kind = getattr(exc, "kind", None)
        return self._reject(rec, batch, f"undecodable_{kind}" if kind else "undecodable", str(exc))

    async def _batch(
        self,
        rec: NodeRecord,
        batch: pb.EventBatch | ScannedBatch,
        data: bytes = b"",
        *,
        defer_ack: bool = False,
    ) -> list[pb.CoordinatorMessage]:
        """One numbered batch, given as a protobuf message or as a ``kvcoord._wirescan`` tuple (read
        from ``data``; then the raw events and counts are already known). ``defer_ack``: return the
        Ack as a reply (the group it belongs to sends one Ack) instead of queueing it at once."""
        st = self.state
        raw: list[RawEvent] | None = None
        scanned = type(batch) is tuple
        if scanned:
            seq, ts, dp_rank, _, n_events, n_stored, n_removed, n_cleared, raw, _, _, _ = cast(
                "ScannedBatch", batch
            )
        else:
            assert isinstance(batch, pb.EventBatch)
            seq, ts, dp_rank, n_events = batch.seq, batch.ts, batch.dp_rank, len(batch.events)
        limit = st.config.limits.max_events_per_batch
        if n_events > limit:
            st.metrics.batch("too_large")
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch {seq} has {n_events} events; max_events_per_batch is {limit}",
            )
        async with st.registry.lock(rec.node_id):
            rec = self._owned()
            if rec.resyncing:
                st.metrics.batch("awaiting_snapshot")
                return []
            last = rec.last_seq
            if seq <= last:
                st.metrics.batch("duplicate")
                return self._acked(last, defer_ack)
            if seq > last + 1:
                st.metrics.batch("gap")
                st.log_once(
                    f"gap:{rec.node_id}:{self.epoch}",
                    logging.INFO,
                    "node %s: gap (expected seq %d, got %d); asking for a snapshot",
                    rec.node_id,
                    last + 1,
                    seq,
                )
                return self._request_snapshot(rec, "gap", f"expected seq {last + 1}, got {seq}")
            if dp_rank not in self.dp_ranks:
                return self._reject(
                    rec,
                    _as_pb(batch, data),
                    "unknown_dp_rank",
                    f"dp_rank {dp_rank} is not in the Hello's {list(self.dp_ranks)}",
                )
            profile = st.config.profile(self.model)
            verify = profile is not None and not rec.hash_mismatch and st.verifier.cfg.enabled
            apply_raw = self._apply_raw
            if apply_raw is not None:
                # In-process index: the events go straight from the protobuf messages (checked whole
                # first, exactly as the decoder does) to the index, which validates the whole batch
                # before mutating anything. No await between the ownership check and the apply.
                if raw is None:
                    assert isinstance(batch, pb.EventBatch)
                    try:
                        raw, n_stored, n_removed, n_cleared = raw_events_for_index(batch.events)
                    except (ValueError, TypeError, KeyError, OverflowError) as exc:
                        return self._undecodable(rec, batch, exc)
                try:
                    apply_raw(self.model, rec.node_id, dp_rank, raw)
                except InvalidEvent as exc:
                    detail, sent = str(exc), _as_pb(batch, data)
                    if scanned:  # the scanner merged runs of stores: word it as the events were sent
                        detail = self._exact_error(rec, sent, dp_rank) or detail
                    return self._reject(rec, sent, "invalid_event", detail)
            else:
                n_stored = -1
                batch = _as_pb(batch, data)
                try:
                    # Only the index reads every event: runs of stores collapse into one event each
                    # (see events_for_index) and token ids never become Python tuples. The whole batch
                    # is checked first. Hash verification samples from the messages afterwards and
                    # decodes just the events it samples.
                    events = events_for_index(batch.events)
                except (ValueError, TypeError, KeyError, OverflowError) as exc:
                    return self._undecodable(rec, batch, exc)
                try:
                    # Through an index outage the batch stays unacked and is retried here (the stream
                    # stalls; the agent keeps queueing). Re-applying a batch that half-reached the
                    # backend is safe: events are idempotent and the retry re-applies the whole batch
                    # in order, before any later batch. Abandoned (unacked, a snapshot follows) when
                    # the backend came back empty and the node now resyncs.
                    done, _ = await st.call_index(
                        lambda: st.index.apply(self.model, rec.node_id, dp_rank, events),
                        f"apply for node {rec.node_id}",
                        rec,
                        lambda: self._wanted(rec, need_sync=True),
                    )
                except InvalidEvent as exc:
                    return self._reject(rec, batch, "invalid_event", str(exc))
                rec = self._owned()
                if not done:
                    st.metrics.batch("awaiting_snapshot")
                    return []
            rec.last_seq = seq
            rec.indexed.add((self.model, dp_rank))
        if n_stored < 0:
            assert isinstance(batch, pb.EventBatch)
            self._account(batch)
        else:
            self._account_counts(ts, n_stored, n_removed, n_cleared)
        if verify and profile is not None:
            self._verify(rec, profile, batch, data)
        return self._acked(seq, defer_ack)

    def _acked(self, seq: int, defer: bool) -> list[pb.CoordinatorMessage]:
        """Ack(seq): queued on the stream's writer (coalesced there), or returned as a reply."""
        if self.ack is not None and not defer:
            self.ack(self.epoch, seq)
            return []
        return [pb.CoordinatorMessage(ack=pb.Ack(epoch=self.epoch, seq=seq))]

    def _verify(
        self, rec: NodeRecord, profile: HashProfile, batch: pb.EventBatch | ScannedBatch, data: bytes
    ) -> bool:
        """Hash verification of an applied batch; True when it found a mismatch (the node is marked).
        A scanned batch is parsed only when the verifier could act on it (rarely, once sampled)."""
        st = self.state
        if not isinstance(batch, pb.EventBatch) and not st.verifier.may_act(self.model, profile, batch[9]):
            return False
        reason = st.verifier.check(rec, self.model, profile, _as_pb(batch, data).events)
        if reason is None:
            return False
        st.mark_hash_mismatch(rec, reason)
        return True

    def _exact_error(self, rec: NodeRecord, batch: pb.EventBatch, dp_rank: int) -> str | None:
        """The error the unmerged events of a scanned batch give (validated only, never applied)."""
        check = getattr(self.state.index, "check_raw_sync", None)
        if check is None:
            return None
        try:
            check(self.model, rec.node_id, dp_rank, raw_events_for_index(batch.events)[0])
        except InvalidEvent as exc:
            return str(exc)
        except (ValueError, TypeError, KeyError, OverflowError):
            return None
        return None

    def _account(self, batch: pb.EventBatch) -> None:
        m = self.state.metrics
        m.batch("applied")
        counts: dict[str | None, int] = {}
        for ev in batch.events:  # the events as sent (the index may have seen merged ones)
            which: str | None = ev.WhichOneof("event")
            counts[which] = counts.get(which, 0) + 1
        for which, n in counts.items():
            m.applied(_PROTO_KINDS.get(which or "", "unknown"), n)
        if batch.ts > 0:
            m.ingest_lag.observe(max(0.0, time.time() - batch.ts))

    def _account_counts(self, ts: float, stored: int, removed: int, cleared: int, batches: int = 1) -> None:
        """``_account`` with the per-kind counts already known (the raw path counted them)."""
        m = self.state.metrics
        if batches:
            m.batch("applied", batches)
        if stored:
            m.applied("block_stored", stored)
        if removed:
            m.applied("block_removed", removed)
        if cleared:
            m.applied("all_blocks_cleared", cleared)
        if ts > 0:
            m.ingest_lag.observe(max(0.0, time.time() - ts))

    # --- snapshots --------------------------------------------------------------------------
    async def _snapshot(self, rec: NodeRecord, snap: pb.Snapshot) -> list[pb.CoordinatorMessage]:
        st = self.state
        if snap.epoch != self.epoch:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot epoch {snap.epoch} does not match the Hello's epoch {self.epoch}",
            )
        if snap.dp_rank not in self.dp_ranks:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot dp_rank {snap.dp_rank} is not in the Hello's {list(self.dp_ranks)}",
            )
        n = len(snap.block_hashes)
        if snap.tiers and len(snap.tiers) != n:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"snapshot has {n} block_hashes but {len(snap.tiers)} tiers"
            )
        if snap.tiers and (max(snap.tiers) >= len(_TIERS) or min(snap.tiers) < 0):
            bad = next(t for t in snap.tiers if not 0 <= t < len(_TIERS))
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, f"snapshot has an unknown tier {bad}")
        pending = self._pending
        if pending is None:
            pending = self._pending = _PendingSnapshot(snap.epoch, snap.seq, {})
        elif pending.seq != snap.seq:
            self._pending = None
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot chunks disagree on seq ({pending.seq} then {snap.seq})",
            )
        pending.count += n
        limit = st.config.limits.max_snapshot_blocks
        if pending.count > limit:
            self._pending = None
            raise IngestAbort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"snapshot exceeds max_snapshot_blocks ({limit})"
            )
        entries = pending.entries.setdefault(snap.dp_rank, [])
        if snap.tiers:
            entries.extend(
                (BlockHash64(h), _TIERS[t]) for h, t in zip(snap.block_hashes, snap.tiers, strict=True)
            )
        else:
            entries.extend((BlockHash64(h), Tier.GPU) for h in snap.block_hashes)
        if not snap.final:
            return []
        self._pending = None
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

            async def replace() -> None:
                for rank in self.dp_ranks:
                    await st.index.replace_node(self.model, node_id, rank, pending.entries.get(rank, []))
                for model, rank in sorted(indexed - keep):
                    await st.index.clear(model, node_id, rank)

            node_id, indexed = rec.node_id, set(rec.indexed)
            # Retried through an outage (a snapshot is a whole replacement: re-running it is exact).
            done, _ = await st.call_index(
                replace, f"snapshot for node {node_id}", rec, lambda: self._wanted(rec, need_sync=False)
            )
            rec = self._owned()
            if not done:
                return []
            rec.indexed = keep
            rec.last_seq = pending.seq
            rec.resyncing = False
        finally:
            node_lock.release()
        st.metrics.snapshots_applied.inc()
        log.info(
            "node %s epoch %d: snapshot applied at seq %d (%d blocks over %d ranks)",
            rec.node_id,
            self.epoch,
            pending.seq,
            pending.count,
            len(self.dp_ranks),
        )
        return [pb.CoordinatorMessage(ack=pb.Ack(epoch=self.epoch, seq=pending.seq))]
