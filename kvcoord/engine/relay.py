"""The relay: one real engine's KV-event stream -> a mirror of its blocks -> the reporter.

:class:`RelayCore` holds what every transport shares (the stream's position, the mirror and the sink, and the
rules below for lost, malformed and restarted streams); :class:`Relay` is its ZMQ transport and
:class:`kvcoord.engine.grpc_relay.GrpcRelay` its gRPC one (``SubscribeKvEvents``, whose gaps are healed by
resuming the stream instead of a replay socket).

The ZMQ relay subscribes to the engine's PUB socket, decodes every batch with
:func:`kvcoord.events.decode_vllm_views` (token ids stay undecoded: they travel only on the few events
sampled for verification), and keeps the stream whole:

- a sequence gap (HWM drop, slow joiner, a paused agent) is filled from the engine's replay
  ROUTER socket (:class:`kvcoord.engine.zmq_wire.ReplayClient`); the first message also counts,
  so an agent started after its engine first replays the engine's buffered history;
- a sequence that goes backwards on the live stream means the engine restarted: the mirror of
  that stream's DP ranks is cleared, an ``AllBlocksCleared`` is forwarded, and the new stream is
  replayed from 0;
- a gap that cannot be filled (the replay buffer rolled past it, no replay endpoint, the replay
  socket does not answer) makes the mirror untrustworthy: the lost batches may have removed
  blocks, and an index that kept them would send requests to a node that lacks them. The mirror
  of the stream's DP ranks is cleared and ``AllBlocksCleared`` forwarded (counted in
  ``unrecoverable_gaps``); it refills as the engine stores blocks again. Reporting too little
  costs a cache miss, reporting too much costs a misrouted request;
- whenever batches are lost for good (at a join the replay buffer no longer reaches back, or a gap),
  the sink is told (``history_lost``, after the clear): the coordinator marks the rank ``degraded``
  with the reason until the engine clears it (``AllBlocksCleared``) or a new epoch starts over;
- a malformed frame or batch is counted by kind, logged once per kind, and skipped; a batch that
  cannot be used is lost history like a gap's (cleared once the stream has started, marked either way),
  never a silent drop.

Every good batch updates the :class:`BlockMirror` (what the index should hold for this node) and
is forwarded to an :class:`EventSink` (the reporter), whose snapshot requests the mirror answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvcoord.engine.mirror import BlockMirror, EventSink, Snapshot
from kvcoord.engine.zmq_wire import (
    FrameError,
    FrameReader,
    PeerMonitor,
    ReplayClient,
    ReplayError,
    parse_pub_frames,
    subscribe_socket,
)
from kvcoord.events import AllBlocksCleared, EventDecodeError, decode_vllm_views

log = logging.getLogger(__name__)

__all__ = ["DRAIN_BURST", "MALFORMED_KINDS", "REPLAY_ONLY_PROBES_WARN", "Relay", "RelayCore", "RelayStats"]

MALFORMED_KINDS = (
    "frames", "seq",  # a PUB message that is not [topic, seq, payload] (zmq_wire.FrameError)
    "truncated", "msgpack", "bad_batch", "bad_event", "unknown_event", "missing_field", "bad_hash",
    "wrong_type", "bad_value", "event", "block_size",  # a payload that is no batch (events.EventDecodeError)
    "dp_rank", "protobuf",  # a batch of a rank the stream does not carry; a gRPC message that is no batch
)
"""Every reason a relay counts a frame or batch malformed (the ``reason`` label of
``kvcoord_relay_malformed_total``, whose series exist from the start at 0 so that the first one alerts)."""

DRAIN_BURST = 64
"""Frames a relay handles in a row before it lets the event loop run."""

REPLAY_ONLY_PROBES_WARN = 3
"""After this many probes fed by replay alone (no live frame yet), warn that PUB is not connected."""


@dataclass
class RelayStats:
    """Counters a relay keeps (exported by the agent; also what tests assert on)."""

    frames: int = 0
    """Messages received on the PUB socket (fewer than the engine sent: it or ZMQ dropped some)."""
    batches: int = 0
    events: int = 0
    block_events: int = 0
    gaps: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    unrecoverable_gaps: int = 0
    """Gaps after the stream had started that replay could not fill (each cleared the mirror)."""
    healed_gaps: int = 0
    duplicates: int = 0
    restarts: int = 0
    replay_failures: int = 0
    replay_partial: int = 0
    """Replay answers that arrived cut short (the ROUTER dropped messages) and were asked for again."""
    snapshot_chunks: int = 0
    """Snapshot chunks applied (a gRPC stream's in-band resyncs)."""
    replay_only_probes: int = 0
    """Replay probes that delivered batches while no live PUB frame had ever arrived (see the warning)."""
    malformed: Counter[str] = field(default_factory=Counter)


class RelayCore:
    """What every transport's relay shares: one engine stream's position, its batches through the mirror to
    the sink, and what a lost, malformed or restarted stream does to both (the rules of this module's
    docstring). A transport (:class:`Relay` for ZMQ, :class:`kvcoord.engine.grpc_relay.GrpcRelay` for
    ``SubscribeKvEvents``) receives, orders and heals; it hands each batch in order to :meth:`take`."""

    def __init__(self, endpoint: str, sink: EventSink, *, mirror: BlockMirror | None = None,
                 default_dp_rank: int = 0, allowed_ranks: set[int] | None = None,
                 on_malformed: Callable[[str], None] | None = None) -> None:
        self.endpoint = endpoint
        self.sink = sink
        self.mirror = mirror if mirror is not None else BlockMirror()
        self.stats = RelayStats()
        self._default_dp = default_dp_rank
        self._allowed = allowed_ranks
        self._on_malformed = on_malformed
        """Told the kind of every malformed frame or batch (the coordinator's metric of its relays)."""
        self._expected = 0
        self._ranks_seen: set[int] = set()
        self._started = False
        """A batch was applied since the relay started or the engine last restarted."""
        self._logged: set[str] = set()
        self.answered_at: float | None = None
        """``time.monotonic()`` when the engine last showed it is there (the transport says how); None:
        never. This is the relay's liveness."""

    @property
    def expected_seq(self) -> int:
        """The next sequence number the relay will apply."""
        return self._expected

    def snapshot(self) -> Snapshot:
        """The reporter's snapshot provider."""
        return self.mirror.snapshot()

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set: the transport's loop."""
        raise NotImplementedError

    def take(self, seq: int, decode: Callable[[], Any]) -> Any:
        """Decode (``decode()``: the transport's decoder, raising :class:`EventDecodeError` or
        ``ValueError``), validate, apply to the mirror and forward batch ``seq``, the next in order.
        Returns the batch; None if it was malformed (then handled as lost: :meth:`_bad_batch`)."""
        self._expected = seq + 1
        try:
            batch = decode()
            kept, ops, spans = self.mirror.prepare(batch.events)
        except EventDecodeError as exc:
            self._bad_batch(seq, exc.kind, str(exc))
            return None
        except ValueError as exc:
            self._bad_batch(seq, "bad_event", str(exc))
            return None
        dp = batch.data_parallel_rank if batch.data_parallel_rank is not None else self._default_dp
        if self._allowed is not None and dp not in self._allowed:
            self._bad_batch(seq, "dp_rank", f"batch of DP rank {dp}, stream carries {sorted(self._allowed)}")
            return None
        self._ranks_seen.add(dp)
        self._started = True
        self.mirror.commit(dp, ops)
        self.sink.submit(dp, kept, batch.ts, ops, spans)  # without the events of unknown media (skipped)
        st = self.stats
        st.batches += 1
        st.events += len(batch.events)
        st.block_events += sum(len(op[2]) for op in ops)
        return batch

    def _bad_hint(self, kind: str) -> str:
        """What to add to a malformed batch's log line (the transport's advice); "" none."""
        return ""

    def _bad_batch(self, seq: int, kind: str, why: str) -> None:
        """A batch that cannot be applied: counted and logged (once per kind) as malformed, then handled
        as lost, so the node is never ``exact`` while the index lacks what it held.

        Its events may have removed blocks, so once the stream has started the mirror cannot be
        trusted past it: the stream's ranks are cleared (and the clear forwarded), as for a gap
        replay cannot fill. Before the stream started there is nothing to distrust, only blocks it may
        have stored that the index lacks: the ranks are marked, nothing is cleared.
        """
        if self._started:
            then = "cleared the DP rank(s)' blocks and marked them degraded (history lost)"
        else:
            then = "marked the DP rank(s) degraded (history lost)"
        self._malformed(kind, f"seq {seq}: {why}; {then}{self._bad_hint(kind)}", what="batch")
        why = f"batch {seq} is malformed ({kind})"
        if self._started:
            self._expected = seq
            self._lost(1, why, quiet=True)
        else:
            self.stats.lost_batches += 1
            self._history_lost(1, seq, why, self._marked_ranks())

    def _marked_ranks(self) -> list[int]:
        """The ranks a loss before the stream started marks: the stream's, as far as they are known."""
        return sorted(self._allowed or self._ranks_seen | {self._default_dp})

    def _lost(self, n: int, why: str, *, quiet: bool = False) -> None:
        """Skip ``n`` batches that cannot be had; if the stream had started, distrust the mirror.

        The lost batches may have removed blocks the mirror still holds, so the ranks are cleared
        (and the clear forwarded) before the stream goes on: the index then under-reports until the
        engine stores those blocks again, which costs cache hits, never correctness. A relay that
        joins late without the engine's history loses nothing it had, so nothing is cleared then.
        Either way the sink is told the ranks' history is incomplete (:meth:`_history_lost`).
        """
        first = self._expected
        self.stats.lost_batches += n
        self._expected += n
        if not self._started:
            log.warning("%s: stream (re)joined at batch %d; the %d earlier batch(es) are gone (%s)",
                        self.endpoint, self._expected, n, why)
            self._history_lost(n, first, why, self._marked_ranks())
            return
        self.stats.unrecoverable_gaps += 1
        cleared = self._clear_ranks()
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "%s: batches %d..%d are lost (%s); cleared the %d block(s) of DP rank(s) %s, which "
                "refill as the engine stores blocks again (unrecoverable gap #%d, %d batch(es) lost in all)",
                self.endpoint, first, first + n - 1, why, cleared, sorted(self._ranks_seen),
                self.stats.unrecoverable_gaps, self.stats.lost_batches)
        self._history_lost(n, first, why, sorted(self._ranks_seen))

    def _clear_ranks(self) -> int:
        """Clear the mirror of every rank seen and forward the clear; the blocks dropped."""
        cleared = 0
        now = time.time()
        for dp in sorted(self._ranks_seen):
            cleared += self.mirror.num_blocks(dp)
            self.mirror.clear(dp)
            self.sink.submit(dp, (AllBlocksCleared(),), now)
        return cleared

    def _history_lost(self, n: int, first: int, why: str, ranks: list[int]) -> None:
        """Tell the sink the ranks' history is incomplete: the index lacks what the lost batches stored
        (at a join) or what the engine still holds from before the gap (after the clear)."""
        if n <= 0:
            return
        reason = f"history lost: {n} batch(es) from seq {first} are gone ({why})"
        for dp in ranks:
            self.sink.history_lost(dp, reason)

    def _restart(self, why: str) -> None:
        """The engine restarted: its blocks are gone, so the mirror's go too, and the stream starts over."""
        self.stats.restarts += 1
        log.warning("%s: engine restarted (%s): clearing its blocks and resyncing", self.endpoint, why)
        self._clear_ranks()
        self._expected = 0
        self._started = False

    def _malformed(self, kind: str, message: str, what: str = "frame") -> None:
        self.stats.malformed[kind] += 1
        if self._on_malformed is not None:
            self._on_malformed(kind)
        if kind not in self._logged:  # a stream of bad batches must not flood the log
            self._logged.add(kind)
            log.error("%s: skipping malformed KV event %s (%s; logged once per kind): %s",
                      self.endpoint, what, kind, message)


class Relay(RelayCore):
    """One engine's ZMQ stream (one PUB endpoint, i.e. one vLLM DP rank) -> mirror + sink."""

    def __init__(
        self,
        endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        mirror: BlockMirror | None = None,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        signed_hashes: bool = False,
        default_dp_rank: int = 0,
        hwm: int = 100_000,
        idle_probe: float = 1.0,
        allowed_ranks: set[int] | None = None,
        on_malformed: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(endpoint, sink, mirror=mirror, default_dp_rank=default_dp_rank,
                         allowed_ranks=allowed_ranks, on_malformed=on_malformed)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self._replay_timeout = replay_timeout
        self._signed = signed_hashes
        self._hwm = hwm
        self._idle_probe = idle_probe
        self._last_live: int | None = None
        self._last_payload: bytes | None = None
        self._replay: ReplayClient | None = None
        self._gap: tuple[int, bytes] | None = None
        """The live message the reader paused at, batches missing before it (the task heals them)."""
        self._last_frame = 0.0
        """``time.monotonic()`` of the last live message, or of the last replay probe (or the start)."""
        # answered_at: a live message, a replay answer, or (without a replay endpoint) its PUB socket's ZMTP
        # handshake or heartbeat while connected. PUB/SUB alone says nothing (ZMQ connects lazily).
        self._monitor: PeerMonitor | None = None
        """Without a replay endpoint: the SUB socket's peers (see :meth:`_probe`)."""
        self.ready = asyncio.Event()
        """Set once the SUB socket is connected (a test can start publishing then)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set (noticed within the idle probe interval, at most 1 s; owners that
        stop at once cancel the task as well).

        Batches in order are handled by the socket's reader callback (:class:`FrameReader`), with no task
        switch per batch. This task wakes at least once a second (for ``stop``), for a gap to heal or a
        failure of the reader, and probes the replay socket after ``idle_probe`` seconds without a live
        message; the reader is paused while it heals or probes."""
        # Without a replay socket to ask, the PUB connection itself says whether the engine is there.
        self._monitor = None if self.replay_endpoint else PeerMonitor(self._ctx)
        sub = subscribe_socket(self._ctx, self.endpoint, self.topic, hwm=self._hwm,
                               heartbeat=None if self.replay_endpoint else self._idle_probe,
                               monitor=self._monitor)
        reader = FrameReader(sub, self._take, burst=DRAIN_BURST)
        if self.replay_endpoint:
            self._replay = ReplayClient(self._ctx, self.replay_endpoint, timeout=self._replay_timeout)
        self.ready.set()
        try:
            await self._probe()  # catch up on what the engine published before we joined
            self._last_frame = time.monotonic()
            while not stop.is_set():
                reader.wake.clear()
                reader.resume()
                # Wake for the next idle probe, not more often: 8 idle relays polling every 100 ms cost
                # a coordinator ~2-4% of a core.
                quiet = time.monotonic() - self._last_frame
                await reader.wake.wait(min(max(self._idle_probe - quiet, 0.001), 1.0))
                if reader.error is not None:
                    raise reader.error
                gap, self._gap = self._gap, None
                if gap is not None:
                    await self._after_gap(*gap)
                elif time.monotonic() - self._last_frame >= self._idle_probe:
                    reader.pause()
                    await self._probe()  # a quiet stream may hide a dropped tail
                    self._last_frame = time.monotonic()
        finally:
            reader.close()
            sub.close(linger=0)
            if self._monitor is not None:
                self._monitor.close()
            if self._replay is not None:
                self._replay.close()

    def _take(self, frames: list[bytes]) -> bool:
        """The reader's callback: handle one live message; False (the reader pauses) at a gap to heal."""
        self._last_frame = self.answered_at = time.monotonic()
        self._gap = self._live(frames)
        return self._gap is None

    def _live(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """Handle one live PUB message ``[topic, seq, payload]``, unless batches are missing before it:
        then ``(seq, payload)``, for :meth:`_after_gap`."""
        self.stats.frames += 1
        try:
            seq, payload = parse_pub_frames(frames)
        except FrameError as exc:
            self._malformed(exc.kind, str(exc))
            return None
        if self._last_live is not None and seq <= self._last_live:
            self._restart(f"sequence went back to {seq} after {self._last_live}")
        self._last_live = seq
        if seq < self._expected:
            self.stats.duplicates += 1  # already applied from a replay
            return None
        if seq > self._expected:
            return seq, payload
        self.handle_payload(seq, payload)
        return None

    async def _after_gap(self, seq: int, payload: bytes) -> None:
        await self._heal(seq)
        if seq >= self._expected:
            self.handle_payload(seq, payload)

    def handle_payload(self, seq: int, payload: bytes) -> Any:
        """Decode, validate, apply to the mirror and forward one batch (returned, as views); None if it
        was malformed."""
        self._last_payload = payload
        return self.take(seq, lambda: decode_vllm_views(payload, signed_hashes=self._signed))

    def _bad_hint(self, kind: str) -> str:
        if kind == "bad_hash" and not self._signed:
            return ("; SGLang publishes signed int64 hashes: relay it with `kvcoord agent --signed-hashes` "
                    "or register it with \"engine\": \"sglang\"")
        return ""

    async def _probe(self) -> None:
        """Catch up from the replay socket; quiet on failure (the engine may be down). Without one, see
        whether the PUB endpoint still has its engine."""
        if self._replay is None:
            if self._monitor is not None and self._monitor.connected():
                self.answered_at = time.monotonic()
            return
        replayed = self.stats.replayed_batches
        try:
            await self._catch_up()
            self.answered_at = time.monotonic()
        except ReplayError as exc:
            self.stats.replay_failures += 1
            log.debug("%s: replay probe failed: %s", self.endpoint, exc)
        if self.stats.replayed_batches > replayed and self.stats.frames == 0:
            self._check_live_silence()

    def _check_live_silence(self) -> None:
        """Replay keeps delivering what PUB never does: most likely nobody binds the PUB endpoint.

        vLLM binds an endpoint only when it has a wildcard (``tcp://*:5557``); an engine given
        ``tcp://127.0.0.1:5557`` connects, and so does the relay, so no frame ever flows and the
        index is fed by replay polling alone (late, and lossy once the replay buffer rolls over).
        """
        self.stats.replay_only_probes += 1
        if self.stats.replay_only_probes == REPLAY_ONLY_PROBES_WARN:
            log.warning("%s: no live PUB frames: are both sides connecting? %d replay probes delivered "
                        "batches while the PUB socket received none; the engine must bind its PUB "
                        "endpoint (vLLM binds tcp://*:PORT and connects tcp://HOST:PORT) for the relay "
                        "to connect to it (counted in replay_only_probes)",
                        self.endpoint, self.stats.replay_only_probes)

    async def _catch_up(self, live_seq: int | None = None) -> None:
        """Apply every buffered batch from ``expected`` on, checking it is still the same engine.

        ``live_seq``: the live batch that revealed a gap (it is applied by the caller).

        The request starts one batch early: the engine must send back exactly the payload we
        applied last. No answer for it, or a different payload, means the engine restarted (and
        may already have published past our position, which sequence numbers alone cannot show).
        An answer cut short on the way (see :class:`ReplayClient`) is applied up to its first hole and
        asked for again from there, for as long as each answer brings something new (an answer that
        stalled before its first new batch is asked for once more).
        """
        assert self._replay is not None
        stalled = 0
        while True:
            start = max(self._expected - 1, 0)
            items, whole = await self._replay.fetch(start)
            if (self._expected > 0 and self._last_payload is not None
                    and (not items or (items[0][0] == start and items[0][1] != self._last_payload))):
                self._restart(f"the replay buffer no longer matches batch {start}")
                start = 0
                items, whole = await self._replay.fetch(0)
            before = self._expected
            ended = self._apply_replayed(items, start, live_seq)
            if ended is None:
                return
            if whole and ended:
                return
            stalled = stalled + 1 if self._expected == before else 0
            if stalled > 1:
                raise ReplayError(f"replay from {self._replay.endpoint} came incomplete twice, with nothing "
                                  "new")
            self.stats.replay_partial += 1

    def _apply_replayed(self, items: list[tuple[int, bytes]], start: int,
                        live_seq: int | None) -> bool | None:
        """Apply a replay answer's batches from ``expected`` on: True if all of them were, False at a hole
        in the answer (messages dropped on the way: it began at ``start``, so the buffer still held them),
        None where the buffer no longer reaches back (what it lacks is lost; see :meth:`_lost`)."""
        rolled = bool(items) and items[0][0] > start  # a cut answer lost its tail, never its first message
        for seq, payload in items:
            if seq < self._expected:
                continue
            if seq > self._expected:
                if not rolled:
                    return False
                if live_seq is not None and seq > live_seq:
                    # The buffer starts past the live batch in hand: only the batches before it are
                    # lost; it and the ones queued behind it on the SUB socket come next.
                    self._lost(live_seq - self._expected, f"the replay buffer now starts at {seq}")
                    return None
                self._lost(seq - self._expected, f"the replay buffer now starts at {seq}")
            rolled = False
            self.stats.replayed_batches += 1
            self.handle_payload(seq, payload)
        return True

    async def _heal(self, live_seq: int) -> None:
        start = self._expected
        lost_before = self.stats.lost_batches
        self.stats.gaps += 1
        if self._replay is None:
            self._lost(live_seq - start, "no replay endpoint")
            return
        try:
            await self._catch_up(live_seq)
            self.answered_at = time.monotonic()
        except ReplayError as exc:
            self.stats.replay_failures += 1
            self._lost(live_seq - self._expected, f"replay failed: {exc}")
            return
        if self._expected < live_seq:
            self._lost(live_seq - self._expected, f"replay ended at {self._expected - 1}, before {live_seq}")
        elif self.stats.lost_batches == lost_before:
            self.stats.healed_gaps += 1
            log.info("%s: gap %d..%d healed from the replay buffer", self.endpoint, start, live_seq - 1)

    def _restart(self, why: str) -> None:
        super()._restart(why)
        self._last_payload = None
        self._last_live = None
