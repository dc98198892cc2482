"""The agent side of the ``Ingest`` stream: batch, number, stream, resend, and answer snapshot requests.

Stream semantics (the coordinator implements the same):

- The agent opens ``Ingest`` and sends ``Hello{node_id, model, dp_ranks, epoch, hash_profile, next_seq}``;
  a token travels as ``authorization: Bearer <token>`` metadata.
- The coordinator answers ``Welcome{epoch, acked_seq, lease_seconds, snapshot_required}``. When a snapshot
  is required (or the agent knows it lost batches the coordinator never saw), the agent sends a
  ``Snapshot`` taken at the last seq it assigned, chunked, ``final`` on the very last chunk; batches up to
  that seq are superseded. Otherwise it resends its unacked batches after ``acked_seq``.
- Batch seqs start at 1 per epoch and grow by one per batch, across dp ranks. ``Ack{seq}`` is cumulative.
  When batches queue up (the stream is behind), they go out several per ``EventBatches`` message; the
  coordinator handles each exactly as if sent alone.
  ``SnapshotRequest`` is answered like a required snapshot. ``AgentHeartbeat`` goes out every lease/3.

The engine never waits for the network: :meth:`Reporter.submit` only converts and queues. Each
coordinator has its own stream and bounded unacked queue; when a queue overflows it is dropped and the
coordinator gets a fresh snapshot instead (counted in ``overflows``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvcoord.agent.link import (
    CoordinatorEndpoint,
    Link,
    Pending,
    ReporterOptions,
    ReporterStats,
    Sealed,
    run_piece,
)
from kvcoord.agent.node import (
    LoadProvider,
    ProfileLike,
    SnapshotProvider,
    check_node,
    hash_profile_to_proto,
    snapshot_chunks,
)
from kvcoord.agent.stream import Streams
from kvcoord.events import CLEAR, REMOVE, STORE
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.transport import ChannelSecurity
from kvcoord.validate import Op, known_runs, pack_u64
from kvcoord.waits import wait_event
from kvcoord.wire import Sample, TokenSampler, fill_event

__all__ = ["Reporter"]

log = logging.getLogger(__name__)

# --- the reporter ----------------------------------------------------------------------------
class Reporter:
    """Streams one node's KV events to one or more coordinators. Use inside a running asyncio loop:
    ``await start()``, ``submit(...)`` from the loop or any thread, ``await close()``."""

    def __init__(
        self,
        coordinators: Sequence[str | CoordinatorEndpoint],
        *,
        node_id: str,
        model: str,
        snapshot: SnapshotProvider,
        dp_ranks: Sequence[int] = (0,),
        epoch: int | None = None,
        hash_profile: pb.HashProfile | ProfileLike | None = None,
        load: LoadProvider | None = None,
        security: ChannelSecurity | None = None,
        options: ReporterOptions | None = None,
        serving_url: str = "",
        kv_events: bool = True,
        pools: Sequence[str] = (),
        pool_publisher: str = "",
        role: str = "",
    ) -> None:
        if not coordinators:
            raise ValueError("at least one coordinator address is needed")
        check_node(node_id, model, dp_ranks)
        self.node_id = node_id
        self.model = model
        self.dp_ranks: tuple[int, ...] = tuple(dp_ranks)
        self.epoch = int(epoch) if epoch is not None else time.time_ns()
        if not 0 < self.epoch < 1 << 64:
            raise ValueError(f"epoch must be a positive uint64, got {self.epoch}")
        if hash_profile is None or isinstance(hash_profile, pb.HashProfile):
            self._profile = hash_profile
        else:
            self._profile = hash_profile_to_proto(hash_profile)
        self._snapshot = snapshot
        self._load = load
        self.serving_url = serving_url
        """The engine's OpenAI-compatible base URL, announced in the Hello for routers."""
        self.kv_events = kv_events
        """False: the engine publishes no KV events, and the Hello says so (the node is ``approximate``)."""
        self.pools = tuple(pools)
        """Shared pools the engine loads blocks from, announced in the Hello (kvcoord.coordinator.pools)."""
        self.pool_publisher = pool_publisher
        """Set: this publisher is that pool's storage daemon, not a routable engine (id ``pool:NAME``)."""
        self.role = role
        """The engine's P/D role (``prefill``, ``decode``, ``both``; "" none), announced in the Hello."""
        self.options = options or ReporterOptions()
        default_sec = security or ChannelSecurity()
        self._endpoints = [c if isinstance(c, CoordinatorEndpoint) else CoordinatorEndpoint(c)
                           for c in coordinators]
        self._default_security = default_sec
        self._links: list[Link] = []
        self._pending: dict[int, Pending] = {}
        self._lost: dict[int, str] = {}
        """Ranks whose history the relay lost (``history_lost``), until their next AllBlocksCleared."""
        self._last_seq = 0
        self._events_submitted = 0
        self._batches_sealed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._closing = False
        self._closed = False
        self._ack_event: asyncio.Event | None = None
        self.refused = asyncio.Event()
        """Set once every coordinator refused this node for good (see ``LinkStats.refused``)."""
        self.sampler = TokenSampler()
        """Which stored events carry token ids for hash verification (set by the coordinator's Welcome)."""
        self._streams = Streams(self)

    # -- lifecycle --
    async def start(self) -> None:
        """Open one stream per coordinator (they connect, and reconnect, in the background)."""
        if self._loop is not None:
            raise RuntimeError("reporter already started")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._ack_event = asyncio.Event()
        for ep in self._endpoints:
            link = Link(ep, ep.security or self._default_security)
            self._links.append(link)
            link.task = asyncio.create_task(self._streams.run(link), name=f"kvcoord-reporter-{ep.address}")

    async def __aenter__(self) -> Reporter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, timeout: float = 1.0) -> None:
        """Flush, give connected coordinators up to half of ``timeout`` to ack, then stop everything."""
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        self._seal_all()
        grace = timeout / 2
        if any(link.stats.connected for link in self._links):
            with contextlib.suppress(TimeoutError):
                await self.wait_acked(grace, connected_only=True)
        self._closing = True
        tasks = [link.task for link in self._links if link.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.05, timeout - grace))

    # -- engine side --
    def submit(self, dp_rank: int, events: Sequence[Any], ts: float | None = None,
               ops: Sequence[Op] | None = None, spans: Sequence[int] | None = None) -> None:
        """Queue one dp rank's events (engine timestamp ``ts``, default now). Never blocks on the network.

        ``events`` are model events or the relay's views; ``ops`` their validated form when the caller
        has it already: ``kvcoord.validate.known_runs(events)``'s ops and ``spans`` (the events each op
        stands for; a run goes on the wire as one event, ``KVEvent.events``), with its events (those of
        unknown media left out). Raises
        ``ValueError`` (queueing nothing) for an unknown rank or an invalid event. Thread-safe: from
        another thread the events are handed to the reporter's loop.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("reporter is not running")
        if dp_rank not in self.dp_ranks:
            raise ValueError(f"dp_rank {dp_rank} is not one of this node's ranks {list(self.dp_ranks)}")
        if not events:
            return
        if ops is None:  # events of unknown media are skipped (see kvcoord.validate.known_runs)
            events, ops, spans = known_runs(events, merge=False)
        if spans is None:
            spans = [1] * len(ops)
        stamp = time.time() if ts is None else float(ts)
        if threading.get_ident() == self._loop_thread:
            self._add(dp_rank, events, ops, spans, stamp)
        else:
            self._loop.call_soon_threadsafe(self._add, dp_rank, events, ops, spans, stamp)

    def history_lost(self, dp_rank: int, reason: str) -> None:
        """The relay lost batches of ``dp_rank`` it cannot recover: tell the coordinator, after the
        events submitted so far, that the rank's history is incomplete (``reason``, one line). The
        mark stays with the rank (snapshots carry it too) until an AllBlocksCleared of it is submitted.
        Thread-safe, as :meth:`submit`."""
        if self._loop is None or self._closed:
            raise RuntimeError("reporter is not running")
        if dp_rank not in self.dp_ranks:
            raise ValueError(f"dp_rank {dp_rank} is not one of this node's ranks {list(self.dp_ranks)}")
        if threading.get_ident() == self._loop_thread:
            self._mark_lost(dp_rank, reason)
        else:
            self._loop.call_soon_threadsafe(self._mark_lost, dp_rank, reason)

    def _mark_lost(self, rank: int, reason: str) -> None:
        """The mark goes on the rank's pending batch (or an empty one), sealed at once: events submitted
        later (an engine's AllBlocksCleared among them) must come after it."""
        if self._closing:
            return
        self._lost[rank] = reason
        p = self._pending.get(rank)
        if p is None:
            p = self._pending[rank] = Pending(time.time(), rank)
        p.msg.history_lost = reason
        self._seal(rank)

    async def flush(self) -> None:
        """Seal every partial batch now (their seqs are assigned; sending follows)."""
        self._seal_all()

    async def wait_acked(self, timeout: float, *, connected_only: bool = False) -> None:
        """Until every coordinator acked everything sealed so far (``TimeoutError`` after ``timeout``)."""
        assert self._ack_event is not None, "start() first"
        deadline = time.monotonic() + timeout
        self._seal_all()
        while True:
            links = [lk for lk in self._links if lk.stats.connected or not connected_only]
            if all(lk.settled() for lk in links):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("coordinators did not ack in time")
            self._ack_event.clear()
            await wait_event(self._ack_event, min(left, 0.05))

    async def wait_connected(self, timeout: float) -> None:
        """Until every coordinator has welcomed the stream and acked everything (``TimeoutError``)."""
        deadline = time.monotonic() + timeout
        while not all(lk.stats.connected for lk in self._links):
            if time.monotonic() > deadline:
                raise TimeoutError("coordinators did not welcome the stream in time")
            await asyncio.sleep(0.005)
        await self.wait_acked(max(0.0, deadline - time.monotonic()))

    def stats(self) -> ReporterStats:
        links = []
        for lk in self._links:
            s = lk.stats
            s.unacked = len(lk.unacked)
            links.append(dataclasses.replace(s))
        return ReporterStats(self.node_id, self.epoch, self._last_seq, self._events_submitted,
                             self._batches_sealed, links)

    @property
    def last_seq(self) -> int:
        return self._last_seq

    # -- batching (event loop only) --
    def _add(self, rank: int, events: Sequence[Any], ops: Sequence[Op], spans: Sequence[int],
             ts: float) -> None:
        """The events into the rank's pending batch, each run of like events (an op of ``op_runs``) as
        one wire event standing for them all, cut only at the batch bounds and (stores) around a sampled
        event. Seals at the bounds, and at once when a stream waits for work; otherwise a partial batch
        waits for a writer to finish (or ``flush_interval``)."""
        if self._closing:
            return
        pick = self.sampler.pick if self.sampler.active else None
        self._events_submitted += len(events)
        opts, pending = self.options, self._pending
        e = 0
        for op, span in zip(ops, spans, strict=True):
            kind = op[0]
            if kind == REMOVE:  # most events: a removal run that fits the batch goes whole, no slicing
                p = pending.get(rank)
                if p is None:
                    p = pending[rank] = Pending(ts, rank)
                blocks = max(1, len(op[2]))
                if span <= opts.max_batch_events - p.events and blocks < opts.max_batch_blocks - p.blocks:
                    fill_event(p.msg.events.add(), op, events[e], None, pack_u64(op[2]), span)
                    p.events += span
                    p.blocks += blocks
                    e += span
                    if p.events >= opts.max_batch_events:
                        self._seal(rank)
                    continue
            run = events[e:e + span] if span > 1 else (events[e],)
            e += span
            if kind == CLEAR:
                self._lost.pop(rank, None)  # the engine starts from nothing: its history is whole again
            samples = [pick(ev) for ev in run] if pick is not None and kind == STORE else None
            self._add_run(rank, ts, op, run, pack_u64(op[2]), samples)
        p = self._pending.get(rank)
        if p is None:
            return
        linger = self.options.linger
        if not linger and any(link.idle for link in self._links):
            self._seal(rank)  # a stream waits for work: send now, no timer (a wakeup less per batch)
        elif p.timer is None:
            # lingering, or the streams are busy writing: what arrives meanwhile goes in the next message,
            # sealed when a writer runs out of work (not lingering) or by this timer
            assert self._loop is not None
            p.timer = self._loop.call_later(linger or self.options.flush_interval, self._seal, rank)

    def _add_run(self, rank: int, ts: float, op: Op, run: Sequence[Any], packed: bytes,
                 samples: list[Sample | None] | None) -> None:
        """One run (``op``, its events and packed hashes) as wire events (see :func:`run_piece`)."""
        opts = self.options
        i = pos = 0
        while i < len(run):
            p = self._pending.get(rank)
            if p is None:
                p = self._pending[rank] = Pending(ts, rank)
            if len(run) == 1:  # most store ops: one event, which always goes whole
                j, end = 1, len(packed)
            else:
                j, end = run_piece(run, i, pos, len(packed), op[0] == STORE, samples,
                                   opts.max_batch_events - p.events, opts.max_batch_blocks - p.blocks)
            sample = samples[i] if samples is not None and j == i + 1 else None
            piece = packed if pos == 0 and end == len(packed) else packed[pos:end]
            fill_event(p.msg.events.add(), op, run[i], sample, piece, j - i)
            if sample is not None:
                p.msg.sampled = True
            p.events += j - i
            p.blocks += max(1, len(piece) >> 3)
            if p.events >= opts.max_batch_events or p.blocks >= opts.max_batch_blocks:
                self._seal(rank)
            i, pos = j, end

    def _seal(self, rank: int) -> None:
        p = self._pending.pop(rank, None)
        if p is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        if not p.msg.events and not p.msg.HasField("history_lost"):
            return
        self._last_seq += 1
        self._batches_sealed += 1
        seq = self._last_seq
        p.msg.seq = seq
        sealed = Sealed(seq, p.msg.SerializeToString(), p.blocks)
        limit = self.options.max_unacked_batches
        for link in self._links:
            if len(link.unacked) >= limit:
                link.unacked.clear()
                link.stats.overflows += 1
                link.force_snapshot = True
                if link.stats.overflows == 1:
                    log.warning("coordinator %s: %d unacked batches; dropping them, a snapshot will follow",
                                link.endpoint.address, limit)
            link.unacked.append(sealed)
            link.wakeup.set()
            link.idle = False

    def _seal_all(self) -> None:
        for rank in list(self._pending):
            self._seal(rank)

    # -- snapshot --
    def _take_snapshot(self) -> list[pb.Snapshot]:
        """Seal pending batches, then read the whole state synchronously (atomic in the loop)."""
        self._seal_all()
        return snapshot_chunks(self._snapshot, self.dp_ranks, self.epoch, self._last_seq,
                               self.options.snapshot_chunk_entries, self._lost)

    def refusals(self) -> list[str]:
        """``address: reason`` of every coordinator that refused this node for good."""
        return [f"{lk.endpoint.address}: {lk.stats.refused}" for lk in self._links if lk.stats.refused]
