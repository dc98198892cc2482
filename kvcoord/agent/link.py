"""One coordinator as a reporter sees it: its options, counters, unacked queue and the message framing.

Split from :mod:`kvcoord.agent.reporter` (which runs the streams): the data a stream carries and keeps,
without the asyncio and gRPC machinery.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import attrgetter, indexOf, is_not
from typing import Any

from kvcoord.engine.zmq_wire import Wakeup
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.transport import ChannelSecurity
from kvcoord.wire import stated_once

__all__ = [
    "MAX_GROUP_BATCHES",
    "CoordinatorEndpoint",
    "Link",
    "LinkStats",
    "Pending",
    "ReporterOptions",
    "ReporterStats",
    "Sealed",
    "batch_message",
    "batches_message",
    "run_piece",
]

@dataclass(frozen=True, slots=True)
class CoordinatorEndpoint:
    address: str
    security: ChannelSecurity | None = None
    """None: the reporter's default security."""


@dataclass(frozen=True, slots=True)
class ReporterOptions:
    max_batch_events: int = 512
    max_batch_blocks: int = 1024
    flush_interval: float = 0.01
    """Seconds a partial batch may wait for more events while every stream is busy writing (or down). With
    a stream waiting for work, events go at once: a wakeup (a timer) less per batch, and no added lag."""
    linger: float = 0.0
    """Seconds a batch waits for more events even with a stream free (0: none). An engine publishes a
    batch per scheduler step, and each message costs both sides a few thread wakeups; lingering sends
    several steps a message, for that much more index lag (benchmarks/README.md, "Agent CPU")."""
    max_unacked_batches: int = 8192
    """Per coordinator; beyond it the queue is dropped and a snapshot replaces it."""
    snapshot_chunk_entries: int = 16384
    """Blocks per Snapshot message (128 KB of hashes): gRPC holds about two and a half messages of each
    stream in flight, so this sets what a snapshot stream costs the coordinator beyond its staged blocks."""
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    welcome_timeout: float = 5.0
    default_lease_seconds: float = 10.0
    max_message_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("max_batch_events", "max_batch_blocks", "max_unacked_batches", "snapshot_chunk_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.flush_interval < 0 or self.linger < 0 or self.backoff_initial <= 0 or (
                self.backoff_max < self.backoff_initial):
            raise ValueError("flush_interval and linger must be >= 0 and 0 < backoff_initial <= backoff_max")


@dataclass(slots=True)
class LinkStats:
    """Counters of one coordinator stream."""

    address: str
    connected: bool = False
    batches_sent: int = 0
    batches_acked: int = 0
    batches_resent: int = 0
    snapshots_sent: int = 0
    snapshot_requests: int = 0
    heartbeats_sent: int = 0
    reconnects: int = 0
    overflows: int = 0
    unacked: int = 0
    acked_seq: int = 0
    last_error: str = ""
    refused: str = ""
    """Non-empty: the coordinator refused this node for good (a token not allowed for it, an unknown model
    in strict mode, an invalid Hello); the link stopped retrying. The status and message."""
    hash_mismatch: str = ""
    """The coordinator says this node's hashes cannot match its own (seed, algorithm, block size, style)."""


@dataclass(slots=True)
class ReporterStats:
    node_id: str
    epoch: int
    last_seq: int
    events_submitted: int
    batches_sealed: int
    links: list[LinkStats] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(int(getattr(link, name)) for link in self.links)


# --- internals -------------------------------------------------------------------------------
class Sealed:
    """A numbered batch, serialized once (``EventBatch`` bytes) and shared by every coordinator's queue."""

    __slots__ = ("blocks", "body", "seq")

    def __init__(self, seq: int, body: bytes, blocks: int) -> None:
        self.seq = seq
        self.body = body
        self.blocks = blocks


class Pending:
    """A batch being filled: the events go straight into its message (no copy at sealing). ``events``
    counts the engine's events in it (a wire event may stand for a run of them)."""

    __slots__ = ("blocks", "events", "msg", "timer")

    def __init__(self, ts: float, rank: int) -> None:
        self.msg = pb.EventBatch(ts=ts, dp_rank=rank)
        self.blocks = 0
        self.events = 0
        self.timer: asyncio.TimerHandle | None = None


class Link:
    """One coordinator: its stream task, unacked queue (contiguous seqs) and counters."""

    __slots__ = ("endpoint", "force_snapshot", "high_sent", "idle", "security", "snap_wait",
                 "snapshot_requested", "stats", "task", "unacked", "wakeup")

    def __init__(self, endpoint: CoordinatorEndpoint, security: ChannelSecurity) -> None:
        self.endpoint = endpoint
        self.security = security
        self.unacked: deque[Sealed] = deque()
        self.stats = LinkStats(endpoint.address)
        self.wakeup = Wakeup()
        self.snapshot_requested = False
        self.force_snapshot = False
        self.high_sent = 0
        self.snap_wait = -1
        """Seq of a snapshot sent but not yet acked (-1: none)."""
        self.task: asyncio.Task[None] | None = None
        self.idle = False
        """The stream's writer is connected and waiting for something to send (cleared when woken)."""

    def settled(self) -> bool:
        """Nothing sealed or snapshotted is waiting for this coordinator's ack."""
        return (not self.unacked and not self.force_snapshot and not self.snapshot_requested
                and self.snap_wait < 0)

    def on_ack(self, seq: int) -> None:
        self.stats.batches_acked += self.drop_through(seq)
        self.stats.acked_seq = max(self.stats.acked_seq, seq)
        if seq >= self.snap_wait:
            self.snap_wait = -1

    def drop_through(self, seq: int) -> int:
        n = 0
        q = self.unacked
        while q and q[0].seq <= seq:
            q.popleft()
            n += 1
        return n

    def group_after(self, cursor: int, max_bytes: int) -> list[Sealed]:
        """The queued batches after ``cursor`` that fit one message (at least one; contiguous seqs)."""
        q = self.unacked
        pos = max(0, cursor - q[0].seq + 1)
        out = [q[pos]]
        size = len(q[pos].body)
        for i in range(pos + 1, min(len(q), pos + MAX_GROUP_BATCHES)):
            size += len(q[i].body) + 8
            if size > max_bytes:
                break
            out.append(q[i])
        return out

    def next_after(self, cursor: int) -> Sealed | None:
        q = self.unacked
        if not q:
            return None
        pos = cursor - q[0].seq + 1
        if pos < 0:
            pos = 0
        return q[pos] if pos < len(q) else None


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited protobuf field: ``tag``, the length as a varint, the bytes."""
    return b"".join((tag, _varint(len(body)), body))


_BATCH_TAG = b"\x12"
"""``AgentMessage.batch`` (field 2, length-delimited)."""
_BATCHES_TAG = b"\x2a"
"""``AgentMessage.batches`` (field 5, length-delimited)."""
_GROUP_ITEM_TAG = b"\x0a"
"""``EventBatches.batches`` (field 1, length-delimited)."""


def batch_message(body: bytes) -> bytes:
    """``AgentMessage{batch}`` around one sealed ``EventBatch``: framed as bytes (an embedded message is
    its tag, length and serialized bytes), not parsed and serialized again."""
    return _field(_BATCH_TAG, body)


def batches_message(bodies: Sequence[bytes]) -> bytes:
    """``AgentMessage{batches}`` around several sealed ``EventBatch``es (consecutive seqs), framed as
    :func:`batch_message` is."""
    return _field(_BATCHES_TAG, b"".join([_field(_GROUP_ITEM_TAG, body) for body in bodies]))


MAX_GROUP_BATCHES = 64
"""At most this many queued batches go out in one ``EventBatches`` message (also bounded by bytes)."""


_HASHES = attrgetter("block_hashes")


def run_piece(run: Sequence[Any], i: int, pos: int, size: int, stores: bool, samples: Sequence[object] | None,
              room_events: int, room_blocks: int) -> tuple[int, int]:
    """Where the wire event that starts at ``run[i]`` of a run of like events ends: ``(j, end)``, it
    stands for ``run[i:j]``, whose hashes end at byte ``end`` of the run's ``size`` packed bytes (``pos``:
    where they start). A removal run that fits the batch's room goes whole without per-event work;
    otherwise the cut falls where the batch fills (``room_events`` events, or ``room_blocks`` blocks),
    and a store run is also cut around a sampled event (of ``samples``, one per event), which goes alone
    with its tokens, and where what a wire event states once (:data:`kvcoord.wire.stated_once`) changes.
    The scans run in C (``map``, ``indexOf``): no Python step per event."""
    n = len(run)
    stop = min(n, i + max(1, room_events))
    if not stores:
        if n - i <= room_events and max(1, (size - pos) >> 3) < room_blocks:
            return n, size
    elif samples is not None and samples[i] is not None:
        stop = i + 1
    else:
        if samples is not None:
            stop = i + 1 + _first(map(is_not, samples[i + 1:stop], repeat(None)), stop - i - 1)
        stop = i + _first(map(stated_once(run[i]).__ne__, map(stated_once, run[i:stop])), stop - i)
    blocks = list(accumulate(map(len, map(_HASHES, run[i:stop]))))  # cumulative
    k = min(len(blocks), bisect_left(blocks, room_blocks) + 1) if room_blocks > 1 else 1
    return i + k, pos + 8 * blocks[k - 1]


def _first(flags: Iterable[bool], default: int) -> int:
    """The index of the first true flag, or ``default``."""
    try:
        return indexOf(flags, True)
    except ValueError:
        return default
