"""A numbered batch as an ingest session applies it, whatever carried it: off the gRPC stream
(:class:`WireBatch`, converted from protobuf only when asked) or from the coordinator's own relays
(:class:`LocalBatch`, ops validated in this process, no protobuf). Both go through the same
``IngestSession`` code: ordering, bounds, apply, accounting and verification exist once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import Op
from kvcoord.wire import Sample, event_counts, ops_from_proto, samples_from_proto

__all__ = ["KINDS", "Incoming", "LocalBatch", "WireBatch"]

KINDS = ("block_stored", "block_removed", "all_blocks_cleared", "unknown")
"""The event kinds batches are counted by (``Incoming.kinds`` gives one count each)."""


class Incoming(Protocol):
    """One numbered batch as the session applies it, whatever carried it: :class:`WireBatch` (an
    ``EventBatch`` off the gRPC stream) or :class:`LocalBatch` (ops the coordinator's own relays
    validated). Every batch goes through the same :meth:`IngestSession.batches`."""

    @property
    def seq(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def ts(self) -> float: ...
    @property
    def sampled(self) -> bool: ...
    @property
    def history_lost(self) -> str | None:
        """Set: the rank's history is incomplete after this batch (why, as the agent said it)."""
        ...
    def size(self) -> int:
        """What ``max_events_per_batch`` is checked against: engine events off the wire, ops from the
        coordinator's own relays."""
        ...
    def ops(self) -> Sequence[Op]:
        """The validated ops; a run of like events may be one op (``InvalidEvent`` names the first bad
        event)."""
        ...
    def kinds(self) -> tuple[int, int, int, int]:
        """Events per :data:`KINDS` entry."""
        ...
    def samples(self) -> Sequence[Sample]:
        """Its hash-verification samples (``InvalidEvent`` for an unusable one)."""
        ...


class WireBatch:
    """An ``EventBatch`` off the gRPC stream (converted only when asked)."""

    __slots__ = ("_kinds", "_ops", "dp_rank", "history_lost", "msg", "sampled", "seq", "ts")

    def __init__(self, msg: pb.EventBatch) -> None:
        self.msg = msg
        self.seq, self.dp_rank, self.ts, self.sampled = msg.seq, msg.dp_rank, msg.ts, msg.sampled
        self.history_lost = msg.history_lost if msg.HasField("history_lost") else None
        self._kinds: tuple[int, int, int, int] | None = None
        self._ops: Sequence[Op] | None = None

    def size(self) -> int:
        """Engine events: a wire event standing for a run counts its ``events``."""
        return sum(self.kinds())

    def ops(self) -> Sequence[Op]:
        """Converted once: a group that falls back to one by one asks again."""
        if self._ops is None:
            self._ops = ops_from_proto(self.msg.events, merge=True)
        return self._ops

    def kinds(self) -> tuple[int, int, int, int]:
        if self._kinds is None:
            self._kinds = event_counts(self.msg.events)
        return self._kinds

    def samples(self) -> Sequence[Sample]:
        return [s for _, s in samples_from_proto(self.msg.events)]


@dataclass(slots=True)
class LocalBatch:
    """A batch of ops validated in this process (the coordinator's own relays): no protobuf."""

    seq: int
    dp_rank: int
    ts: float
    op_list: list[Op]
    counts: tuple[int, int, int, int]
    sample_list: list[Sample]
    history_lost: str | None = None

    @property
    def sampled(self) -> bool:
        return bool(self.sample_list)

    def size(self) -> int:
        """Ops, not engine events (a run of like events is one op): these come from the coordinator's
        own relays, in batches the feed bounds itself, and ``max_events_per_batch`` guards against
        agents, so it must not cut a relay's engine batch of many one-block removals."""
        return len(self.op_list)

    def ops(self) -> Sequence[Op]:
        return self.op_list

    def kinds(self) -> tuple[int, int, int, int]:
        return self.counts

    def samples(self) -> Sequence[Sample]:
        return self.sample_list
