"""One ingest stream's snapshot staging: chunks held as they arrive until the final one, bounded per
snapshot and over all streams (``max_staged_snapshot_blocks``). The session applies the whole."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import grpc

from kvcoord.coordinator.config import Limits
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.reclaim import release_memory
from kvcoord.coordinator.registry import NodeRecord
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import Hashes, InvalidEvent, OverLimit, check_node_entries, shown
from kvcoord.wire import snapshot_from_proto

log = logging.getLogger("kvcoord.coordinator.ingest")

LOST_CHARS = 200
"""Characters of an agent's lost-history reason the node's ``trust_reason`` keeps (see :func:`shown`)."""


class IngestAbort(Exception):
    """End the stream with this status; raised before anything of the message is applied."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_events(rec: NodeRecord, carries: bool = True) -> None:
    """A node whose Hello said its engine publishes no KV events sends none (nor snapshot blocks or
    marks): INVALID_ARGUMENT, nothing applied, so an ``approximate`` node never holds entries."""
    if rec.no_kv_events and carries:
        raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"node {shown(rec.node_id)} said in its Hello that its engine publishes no KV "
                          "events (no_kv_events): it may send heartbeats and empty snapshots only")


TRIM_BLOCKS = 1 << 16
"""A snapshot this large (512 KB of hashes and up) that ends or is dropped asks for a reclaim."""


@dataclass(slots=True)
class PendingSnapshot:
    epoch: int
    seq: int
    hashes: dict[int, list[Hashes]] = field(default_factory=dict)
    """Each rank's chunks as they arrived (views of the messages' bytes), joined once when applied:
    staging copies nothing (growing one array re-copied it all, and boxing every hash into it took ~4 ms
    a 65,536-block chunk: 8 flooding streams stalled lookups by 40-300 ms)."""
    tiers: dict[int, bytearray] = field(default_factory=dict)
    count: int = 0
    lost: dict[int, str] = field(default_factory=dict)
    """Ranks whose chunks carried ``history_lost``."""

    def joined(self, rank: int) -> Hashes:
        """``rank``'s staged hashes as one flat uint64 view."""
        parts = cast("list[memoryview]", self.hashes.get(rank, []))
        flat = memoryview(parts[0]) if len(parts) == 1 else memoryview(b"".join(parts)).cast("Q")
        return cast("Hashes", flat)


class SnapshotStage:
    """The stream's unfinished snapshot, counted in ``CoordinatorState.staged_snapshot_blocks``."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.pending: PendingSnapshot | None = None

    def drop(self) -> None:
        """Forget the unfinished snapshot (before any error is raised, so no traceback keeps it)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            count = pending.count
            del pending
            self.release(count)

    def release(self, count: int) -> None:
        """``count`` staged blocks were applied or abandoned: no longer staged."""
        self.state.staged_snapshot_blocks -= count
        if count >= TRIM_BLOCKS:
            release_memory()

    def add(self, snap: pb.Snapshot, epoch: int, dp_ranks: tuple[int, ...], rec: NodeRecord | None,
            node_id: str) -> PendingSnapshot:
        """Check one chunk of the stream's Hello (``epoch``, ``dp_ranks``, ``rec``) and add it to the
        pending snapshot (packed, as it arrived)."""
        if snap.epoch != epoch:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot epoch {snap.epoch} does not match the Hello's epoch {epoch}",
            )
        if snap.dp_rank not in dp_ranks:
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot dp_rank {snap.dp_rank} is not in the Hello's {list(dp_ranks)}",
            )
        try:
            hashes, tiers = snapshot_from_proto(snap)
        except InvalidEvent as exc:
            raise IngestAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if rec is not None:  # a lost-history mark would make the node degraded: refused as well
            check_events(rec, len(hashes) > 0 or snap.HasField("history_lost"))
        pending = self.pending
        if pending is None:
            pending = self.pending = PendingSnapshot(snap.epoch, snap.seq)
        elif pending.seq != snap.seq:
            first, pending = pending.seq, None
            self.drop()
            raise IngestAbort(
                grpc.StatusCode.INVALID_ARGUMENT, f"snapshot chunks disagree on seq ({first} then {snap.seq})"
            )
        st, limits = self.state, self.state.config.limits
        pending.count += len(hashes)
        st.staged_snapshot_blocks += len(hashes)
        refusal = self._over_budget(pending.count, limits, node_id)
        if refusal is not None:
            pending = None  # nothing in this frame may keep the staged blocks alive
            self.drop()
            raise IngestAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        rank = snap.dp_rank
        if snap.HasField("history_lost"):
            pending.lost[rank] = shown(snap.history_lost, LOST_CHARS, quote=False)
        held = pending.hashes.setdefault(rank, [])
        held_tiers = pending.tiers.setdefault(rank, bytearray())
        if tiers:
            before = sum(len(part) for part in held)
            if len(held_tiers) < before:
                held_tiers.extend(bytes(before - len(held_tiers)))  # earlier chunks were all GPU
        held.append(hashes)  # unpack_u64's flat buffer: kept, not copied
        if tiers or held_tiers:
            held_tiers.extend(tiers or bytes(len(hashes)))
        return pending

    def _over_budget(self, count: int, limits: Limits, node_id: str) -> str | None:
        """Why the snapshot being staged (``count`` blocks so far) must be refused, if it must."""
        if count > limits.max_snapshot_blocks:
            return f"snapshot exceeds max_snapshot_blocks ({limits.max_snapshot_blocks})"
        try:
            check_node_entries(count, limits.max_entries_per_node)
        except OverLimit as exc:
            return f"snapshot: {exc}"
        staged = self.state.staged_snapshot_blocks
        if staged > limits.max_staged_snapshot_blocks:
            self.state.metrics.stream_refused("snapshot_budget")
            log.warning("node %s: snapshot refused: %d blocks staged over all streams "
                        "(max_staged_snapshot_blocks %d)", node_id, staged,
                        limits.max_staged_snapshot_blocks)
            return (f"snapshot staging is full: {staged} blocks of unfinished snapshots over all streams, "
                    f"max_staged_snapshot_blocks is {limits.max_staged_snapshot_blocks}; retry later")
        return None
