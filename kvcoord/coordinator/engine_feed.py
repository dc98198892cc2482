"""The reporter's in-process twin, for engines the coordinator relays itself (``POST /register``).

A :class:`LocalFeed` is the relays' :class:`~kvcoord.engine.relay.EventSink`, like the
:class:`~kvcoord.agent.reporter.Reporter`, but it feeds this process's ingest: the relay's validated ops
go straight into an :class:`~kvcoord.coordinator.ingest.IngestSession`, with no protobuf per event and no
gRPC. The session is the one a stream gets: the same Hello and Welcome, per-epoch seqs, bounds, acks,
snapshots (from the relay's mirror), verification samples, heartbeats and metrics. What the network made
necessary is gone: nothing is ever lost between the two, so there is no resend queue; a refused stream
(the session aborts it) is opened again with a snapshot, as a reporter reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.node import SnapshotProvider, check_node, snapshot_chunks
from kvcoord.agent.stream import AGENT_VERSION, PERMANENT
from kvcoord.coordinator.auth import AGENT, Principal
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.incoming import LocalBatch
from kvcoord.coordinator.ingest import IngestSession
from kvcoord.coordinator.snapshots import IngestAbort
from kvcoord.engine.zmq_wire import Wakeup
from kvcoord.events import CLEAR, REMOVE, STORE
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import Op, known_runs
from kvcoord.wire import Sample, TokenSampler, as_received, load_to_proto

log = logging.getLogger("kvcoord.coordinator.engine_feed")

__all__ = ["LocalFeed"]

_PRINCIPAL = Principal(AGENT, frozenset({"*"}))
"""The coordinator's own relays may publish for any node (as their private token over gRPC may)."""

_Item = tuple[int, Sequence[Op], float, tuple[int, int, int, int], list[Sample], str | None]
"""``(dp_rank, ops, ts, events per kind, verification samples, history_lost)`` of one submitted batch
(or, with no ops, of a lost-history mark: see :meth:`LocalFeed.history_lost`)."""


class LocalFeed:
    """One node's relayed batches into this coordinator's ingest. Use inside the coordinator's loop:
    ``await start()``, ``submit(...)`` from that loop (the relays run there), ``await close()``."""

    def __init__(self, state: CoordinatorState, *, node_id: str, model: str, snapshot: SnapshotProvider,
                 dp_ranks: Sequence[int], serving_url: str = "", options: ReporterOptions | None = None,
                 epoch: int | None = None, answered: Callable[[], float | None] | None = None,
                 load: Callable[[], NodeLoad] | None = None, pools: Sequence[str] = (),
                 pool_publisher: str = "", role: str = "") -> None:
        check_node(node_id, model, dp_ranks)
        self.pools, self.pool_publisher, self.role = tuple(pools), pool_publisher, role
        """Said in the Hello: shared pools the engine reaches, or the pool it publishes for; its P/D role."""
        self._answered = answered
        """When the engine last answered (``time.monotonic()``, None: never), as its relays saw it; None:
        always there. The node's lease runs from that moment: the feed says Hello only once the engine
        answered within the lease, and its heartbeats stop when it no longer does, so a dead engine leaves
        lookups as an agent's node does when its heartbeats stop."""
        self._load = load
        """The engine's load for every heartbeat (its ``/metrics``, scraped); None: unknown."""
        self.unreachable = False
        """The engine has not answered within the lease (logged once each time it goes)."""
        self.state = state
        self.node_id, self.model, self.serving_url = node_id, model, serving_url
        self.dp_ranks: tuple[int, ...] = tuple(dp_ranks)
        self.epoch = int(epoch) if epoch is not None else time.time_ns()
        self.options = options or ReporterOptions()
        self.sampler = TokenSampler()
        self.last_seq = 0
        self.events_submitted = 0
        self.snapshots_sent = 0
        self.overflows = 0
        """Times the queue passed ``max_unacked_batches`` and was replaced by a snapshot."""
        self.last_error = ""
        self.refused = ""
        """Non-empty: the coordinator refused this node for good (as ``LinkStats.refused``)."""
        self._snapshot = snapshot
        self._queue: deque[_Item] = deque()
        self._lost: dict[int, str] = {}
        """Ranks whose history the relay lost, until their next AllBlocksCleared (as the reporter's)."""
        self._need_snapshot = True
        self._wake = Wakeup()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- the relays' side --
    def submit(self, dp_rank: int, events: Sequence[Any], ts: float | None = None,
               ops: Sequence[Op] | None = None, spans: Sequence[int] | None = None) -> None:
        """Queue one rank's batch (see :meth:`Reporter.submit`); from the coordinator's loop only. The
        ops go to the index as they are; ``spans`` (events per op) count the events and find the stores
        to sample, per op rather than per event."""
        if dp_rank not in self.dp_ranks:
            raise ValueError(f"dp_rank {dp_rank} is not one of this node's ranks {list(self.dp_ranks)}")
        if not events or self._closing:
            return
        if ops is None:
            events, ops, spans = known_runs(events)
        elif spans is None:
            spans = [1] * len(ops)
        counts = [0, 0, 0]  # stored, removed, cleared: STORE, REMOVE, CLEAR
        samples: list[Sample] = []
        e = 0
        for op, span in zip(ops, spans, strict=True):
            kind = op[0]
            counts[kind] += span
            if kind == CLEAR:
                self._lost.pop(dp_rank, None)
            if kind == STORE and self.sampler.active:
                samples += self._samples(events[e:e + span])
            e += span
        self.events_submitted += len(events)
        stamp = time.time() if ts is None else float(ts)
        self._enqueue((dp_rank, ops, stamp, (counts[STORE], counts[REMOVE], counts[CLEAR], 0), samples, None))

    def history_lost(self, dp_rank: int, reason: str) -> None:
        """The relay lost batches of ``dp_rank`` it cannot recover (see :meth:`Reporter.history_lost`):
        the mark follows the batches queued so far, and snapshots carry it until the rank is cleared."""
        if dp_rank not in self.dp_ranks:
            raise ValueError(f"dp_rank {dp_rank} is not one of this node's ranks {list(self.dp_ranks)}")
        if self._closing:
            return
        self._lost[dp_rank] = reason
        self._enqueue((dp_rank, [], time.time(), (0, 0, 0, 0), [], reason))

    def _enqueue(self, item: _Item) -> None:
        if len(self._queue) >= self.options.max_unacked_batches:
            # The index is stalled (an outage the session rides out): drop the queue, the mirror holds
            # this batch and every queued one, and a snapshot replaces them all once it is back.
            self._queue.clear()
            self._need_snapshot = True
            self.overflows += 1
            if self.overflows == 1:
                log.warning("node %s: %d batches queued for the index; dropping them, a snapshot will "
                            "follow", self.node_id, self.options.max_unacked_batches)
        else:
            self._queue.append(item)
        self._wake.set()

    # -- lifecycle --
    async def start(self) -> None:
        self._task = asyncio.create_task(self._counted(), name=f"kvcoord-local-feed-{self.node_id}")

    async def close(self, timeout: float = 0.5) -> None:
        """Apply what is queued (for up to ``timeout``), then stop."""
        if self._task is None or self._closing:
            return
        self._closing = True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    def settled(self) -> bool:
        """Everything submitted so far has reached the index (or a snapshot that covers it)."""
        return not self._queue and not self._need_snapshot

    # -- the stream --
    async def _counted(self) -> None:
        """:meth:`_run`, counted as an ingest stream (the gauge, ``max_streams``) while it runs: until
        closed, or refused for good."""
        self.state.local_feeds += 1
        self.state.metrics.streams.inc()
        try:
            await self._run()
        finally:
            self.state.local_feeds -= 1
            self.state.metrics.streams.dec()

    def answered_at(self) -> float | None:
        """When the engine last answered, if within the lease; None when it has not (or not yet)."""
        now = time.monotonic()
        if self._answered is None:
            return now
        at = self._answered()
        if at is None or now - at > self.state.config.lease_seconds:
            return None
        return at

    async def _until_answered(self) -> bool:
        """Wait until the engine answers (False: closed first): a node is announced only once its engine
        is there, so a registration of an address where nothing listens is never in a lookup answer."""
        poll = min(0.25, self.state.config.lease_seconds / 8)
        while not self._closing:
            if self.answered_at() is not None:
                return True
            self._wake.clear()
            await self._wake.wait(poll)
        return False

    async def _run(self) -> None:
        backoff = self.options.backoff_initial
        while True:
            if not await self._until_answered():
                return
            session = IngestSession(self.state, _PRINCIPAL, self._push, self._ack)
            welcomed = False
            try:
                await self._hello(session)
                welcomed = True
                backoff = self.options.backoff_initial
                await self._pump(session)
                return
            except IngestAbort as exc:  # refused: like a reporter, come back with a snapshot
                self.last_error = f"{exc.code.name}: {exc.message}"
                if not welcomed and exc.code in PERMANENT:
                    self.refused = self.last_error
                    log.error("node %s refused for good (%s); not retrying", self.node_id, self.refused)
                    return
                log.warning("node %s: ingest refused (%s); resyncing", self.node_id, self.last_error)
            except Exception as exc:  # a bug or a snapshot provider failure: keep relaying
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("node %s: local ingest failed; resyncing", self.node_id)
            finally:
                session.close()
            self._need_snapshot = True
            if self._closing:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.options.backoff_max)

    async def _hello(self, session: IngestSession) -> None:
        hello = pb.Hello(node_id=self.node_id, model=self.model, dp_ranks=self.dp_ranks, epoch=self.epoch,
                         agent_version=AGENT_VERSION, next_seq=self.last_seq + 1,
                         serving_url=self.serving_url, pools=self.pools, pool_publisher=self.pool_publisher,
                         role=self.role)
        welcome = (await session.handle(pb.AgentMessage(hello=hello)))[0].welcome
        if welcome.HasField("verify"):
            self.sampler.configure(welcome.verify)
        if welcome.hash_mismatch:
            self._mismatch(welcome.hash_mismatch)
        self._need_snapshot = True  # nothing is queued for resending: a (re)connect always resyncs

    async def _pump(self, session: IngestSession) -> None:
        """Feed batches and snapshots until closed (and drained); heartbeats keep the lease."""
        interval = self.state.config.lease_seconds / 4.0
        next_hb = time.monotonic() + interval
        while True:
            self._wake.clear()
            if self._need_snapshot:
                await self._send_snapshot(session)
            elif self._queue:
                self._replies(await session.batches([self._next_batch()]))
                if self._queue:
                    await asyncio.sleep(0)  # an in-process index never suspends: let lookups in between
            elif self._closing:
                return
            elif time.monotonic() >= next_hb:
                await self._heartbeat(session)
                next_hb = time.monotonic() + interval
            else:
                await self._wake.wait(next_hb - time.monotonic())

    async def _heartbeat(self, session: IngestSession) -> None:
        """Renew the lease from when the engine last answered, with its load; none while it does not."""
        answered = self.answered_at()
        if answered is None:
            if not self.unreachable:
                self.unreachable = True
                log.warning("node %s: its engine answered neither events nor replay probes within the lease "
                            "(%.1f s): it leaves lookup answers until it answers again", self.node_id,
                            self.state.config.lease_seconds)
            return
        if self.unreachable:
            self.unreachable = False
            log.info("node %s: its engine answers again", self.node_id)
        load = self._load() if self._load is not None else None
        await session.handle(pb.AgentMessage(heartbeat=pb.AgentHeartbeat(
            load=load_to_proto(load) if load is not None else None)))
        if self._answered is not None and session.rec is not None:
            self.state.registry.heard(session.rec, at=answered)

    async def _send_snapshot(self, session: IngestSession) -> None:
        """The mirror now, at the last seq: it already holds every batch still queued (a relay commits
        to the mirror before it submits), so those are superseded and dropped."""
        self._need_snapshot = False
        self._queue.clear()
        chunks = snapshot_chunks(self._snapshot, self.dp_ranks, self.epoch, self.last_seq,
                                 self.options.snapshot_chunk_entries, self._lost)
        for c in chunks:
            self._replies(await session.handle(pb.AgentMessage(snapshot=c)))
        self.snapshots_sent += 1

    def _next_batch(self) -> LocalBatch:
        """Queued batches of one rank as one numbered batch, within the reporter's bounds (a batch
        alone past them is cut into several; its counts and samples go with the first). A lost-history
        mark ends the batch it joins: what was queued after it must be applied after it."""
        opts = self.options
        q = self._queue
        rank, _, ts, _, _, _ = q[0]
        ops: list[Op] = []
        samples: list[Sample] = []
        stored = removed = cleared = blocks = 0
        lost: str | None = None
        while (lost is None and q and q[0][0] == rank and len(ops) < opts.max_batch_events
               and blocks < opts.max_batch_blocks):
            _, item_ops, item_ts, (s, r, c, _), item_samples, lost = q[0]
            room = opts.max_batch_events - len(ops)
            if len(item_ops) > room:
                q[0] = (rank, item_ops[room:], item_ts, (0, 0, 0, 0), [], lost)
                item_ops, lost = item_ops[:room], None
            else:
                q.popleft()
            blocks += sum(len(op[2]) for op in item_ops)
            ops += item_ops
            samples += item_samples
            stored, removed, cleared = stored + s, removed + r, cleared + c
        self.last_seq += 1
        return LocalBatch(self.last_seq, rank, ts, ops, (stored, removed, cleared, 0), samples, lost)

    def _samples(self, stores: Sequence[Any]) -> list[Sample]:
        """The stored events the Welcome's rule picks for verification, as the coordinator reads them."""
        pick = self.sampler.pick
        out = []
        for ev in stores:
            sample = pick(ev)
            if sample is not None:
                out.append(as_received(sample))
        return out

    def _replies(self, replies: Sequence[pb.CoordinatorMessage]) -> None:
        for msg in replies:
            self._push(msg)

    def _push(self, msg: pb.CoordinatorMessage) -> None:
        """A message the session sends this stream (a reply, or the coordinator's own request)."""
        kind = msg.WhichOneof("msg")
        if kind == "snapshot_request":
            log.info("node %s: the coordinator asks for a snapshot: %s", self.node_id,
                     msg.snapshot_request.reason)
            self._need_snapshot = True
            self._wake.set()
        elif kind == "notice":
            if msg.notice.state == "hash_mismatch":
                self._mismatch(msg.notice.message)
            else:
                log.info("node %s is %s: %s", self.node_id, msg.notice.state, msg.notice.message)

    def _ack(self, epoch: int, seq: int) -> None:
        """Acks need no answer here: nothing waits to be resent."""

    def _mismatch(self, message: str) -> None:
        log.error("node %s: its block hashes do not match its profile, so its cache will not be found by "
                  "token lookups: %s", self.node_id, message)
