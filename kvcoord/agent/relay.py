"""The relay: one real engine's ZMQ KV-event stream -> a mirror of its blocks -> the reporter.

It subscribes to the engine's PUB socket, decodes every batch with
:func:`kvcoord.events.decode_vllm_batch`, and keeps the stream whole:

- a sequence gap (HWM drop, slow joiner, a paused agent) is filled from the engine's replay
  ROUTER socket (:class:`kvcoord.agent.zmq_wire.ReplayClient`); the first message also counts,
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
- a malformed frame or batch is counted by kind, logged once per kind, and skipped.

Every good batch updates the :class:`BlockMirror` (what the index should hold for this node) and
is forwarded to an :class:`EventSink` (the reporter), whose snapshot requests the mirror answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import zmq
import zmq.asyncio

from kvcoord.agent.zmq_wire import (
    FrameError,
    ReplayClient,
    ReplayError,
    offset_endpoint_port,
    parse_pub_frames,
    subscribe_socket,
)
from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEvent,
    KVEventBatch,
    Tier,
    decode_vllm_batch,
    normalize_medium,
)
from kvcoord.hashing import UINT64_MASK, BlockHash64, to_block_hash64

if TYPE_CHECKING:
    from kvcoord.agent.reporter import Reporter

log = logging.getLogger(__name__)

Snapshot = dict[int, list[tuple[BlockHash64, Tier]]]
"""``{dp_rank: [(uint64 hash, tier), ...]}``: a node's blocks, as the reporter sends them."""


class EventSink(Protocol):
    """Where the relay forwards batches (the reporter). ``submit`` must not block."""

    def submit(self, dp_rank: int, events: Sequence[KVEvent], ts: float) -> None: ...


# (is_store, tier bit, hashes, group_idx, indexable)
_Op = tuple[int, int, tuple[BlockHash64, ...], int | None, bool]
_CLEAR = 2


_TIER_BITS: dict[str | None, int] = {}


def _tier_bit(medium: str | None) -> int:
    bit = _TIER_BITS.get(medium)
    if bit is None:
        bit = 1 << normalize_medium(medium)  # ValueError for an unknown medium
        if len(_TIER_BITS) < 256:
            _TIER_BITS[medium] = bit
    return bit


def _hashes64(hashes: Sequence[int | bytes]) -> tuple[BlockHash64, ...]:
    """uint64 keys; all-int lists (the common case) are range-checked at C speed."""
    ints: Any = hashes
    try:
        if not ints or (min(ints) >= 0 and max(ints) <= UINT64_MASK):
            return tuple(ints)
    except TypeError:  # bytes among them
        pass
    return tuple(to_block_hash64(h) for h in hashes)


class BlockMirror:
    """The blocks one node holds: ``{dp_rank: {hash64: tier bitmask}}``.

    Follows the index's semantics: stores are idempotent, removing an unknown block is a no-op,
    ``AllBlocksCleared`` drops the rank. Events of groups that are not prefix-indexable (sliding
    window, Mamba) are ignored, as the index ignores them; a removal is matched to its group by the
    ``group_idx`` the group's stores announced.
    """

    __slots__ = ("_blocks", "_skip_groups")

    def __init__(self) -> None:
        self._blocks: dict[int, dict[BlockHash64, int]] = {}
        self._skip_groups: dict[int, set[int]] = {}

    @staticmethod
    def prepare(events: Sequence[KVEvent]) -> list[_Op]:
        """Validate a whole batch (tiers, hashes) without touching the mirror; ValueError if bad."""
        ops: list[_Op] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                ops.append((1, _tier_bit(ev.medium), _hashes64(ev.block_hashes), ev.group_idx,
                            ev.is_prefix_indexable()))
            elif isinstance(ev, BlockRemoved):
                ops.append((0, _tier_bit(ev.medium), _hashes64(ev.block_hashes), ev.group_idx, True))
            elif isinstance(ev, AllBlocksCleared):
                ops.append((_CLEAR, 0, (), None, True))
            else:
                raise ValueError(f"not a KV event: {type(ev).__name__}")
        return ops

    def commit(self, dp_rank: int, ops: Sequence[_Op]) -> None:
        """Apply prepared operations (cannot fail)."""
        blocks = self._blocks.setdefault(dp_rank, {})
        skip = self._skip_groups.setdefault(dp_rank, set())
        for kind, bit, hashes, group, indexable in ops:
            if kind == 1:
                if not indexable:
                    if group is not None:
                        skip.add(group)
                    continue
                if group is not None:
                    skip.discard(group)
                for h in hashes:
                    blocks[h] = blocks.get(h, 0) | bit
            elif kind == 0:
                if group is not None and group in skip:
                    continue
                for h in hashes:
                    mask = blocks.get(h)
                    if mask is not None:
                        mask &= ~bit
                        if mask:
                            blocks[h] = mask
                        else:
                            del blocks[h]
            else:
                blocks.clear()

    def apply(self, dp_rank: int, events: Sequence[KVEvent]) -> None:
        self.commit(dp_rank, self.prepare(events))

    def clear(self, dp_rank: int) -> None:
        self._blocks.pop(dp_rank, None)
        self._skip_groups.pop(dp_rank, None)

    def ranks(self) -> list[int]:
        return sorted(self._blocks)

    def num_blocks(self, dp_rank: int | None = None) -> int:
        if dp_rank is None:
            return sum(len(b) for b in self._blocks.values())
        return len(self._blocks.get(dp_rank, ()))

    def rank_entries(self, dp_rank: int) -> list[tuple[BlockHash64, Tier]]:
        """Every (hash, tier) held on one rank (the reporter's snapshot provider)."""
        entries: list[tuple[BlockHash64, Tier]] = []
        for h, mask in self._blocks.get(dp_rank, {}).items():
            for tier in Tier:
                if mask & (1 << tier):
                    entries.append((h, tier))
        return entries

    def snapshot(self) -> Snapshot:
        """Every (hash, tier) held, per DP rank."""
        out: Snapshot = {}
        for dp, blocks in self._blocks.items():
            entries: list[tuple[BlockHash64, Tier]] = []
            for h, mask in blocks.items():
                for tier in Tier:
                    if mask & (1 << tier):
                        entries.append((h, tier))
            out[dp] = entries
        return out


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
    malformed: Counter[str] = field(default_factory=Counter)


class Relay:
    """One engine stream (one PUB endpoint, i.e. one vLLM DP rank) -> mirror + sink."""

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
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sink = sink
        self.mirror = mirror if mirror is not None else BlockMirror()
        self.stats = RelayStats()
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self._replay_timeout = replay_timeout
        self._signed = signed_hashes
        self._default_dp = default_dp_rank
        self._hwm = hwm
        self._idle_probe = idle_probe
        self._allowed = allowed_ranks
        self._expected = 0
        self._last_live: int | None = None
        self._last_payload: bytes | None = None
        self._ranks_seen: set[int] = set()
        self._started = False
        """A batch was applied since the relay started or the engine last restarted."""
        self._logged: set[str] = set()
        self._replay: ReplayClient | None = None
        self.ready = asyncio.Event()
        """Set once the SUB socket is connected (a test can start publishing then)."""

    @property
    def expected_seq(self) -> int:
        """The next sequence number the relay will apply."""
        return self._expected

    def snapshot(self) -> Snapshot:
        """The reporter's snapshot provider."""
        return self.mirror.snapshot()

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set (reacts within ~0.1 s)."""
        sub = subscribe_socket(self._ctx, self.endpoint, self.topic, hwm=self._hwm)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # synchronous view for non-blocking drains
        if self.replay_endpoint:
            self._replay = ReplayClient(self._ctx, self.replay_endpoint, timeout=self._replay_timeout)
        self.ready.set()
        loop = asyncio.get_running_loop()
        try:
            await self._probe()  # catch up on what the engine published before we joined
            idle_since = loop.time()
            while not stop.is_set():
                if not await sub.poll(timeout=100):
                    if loop.time() - idle_since >= self._idle_probe:
                        await self._probe()  # a quiet stream may hide a dropped tail
                        idle_since = loop.time()
                    continue
                idle_since = loop.time()
                # Drain what is queued without going back through the event loop each time.
                while not stop.is_set():
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self.on_frames(frames)
        finally:
            sub.close(linger=0)
            if self._replay is not None:
                self._replay.close()

    async def on_frames(self, frames: list[bytes]) -> None:
        """Handle one live PUB message ``[topic, seq, payload]``."""
        self.stats.frames += 1
        try:
            seq, payload = parse_pub_frames(frames)
        except FrameError as exc:
            self._malformed(exc.kind, str(exc))
            return
        if self._last_live is not None and seq <= self._last_live:
            self._restart(f"sequence went back to {seq} after {self._last_live}")
        self._last_live = seq
        if seq < self._expected:
            self.stats.duplicates += 1  # already applied from a replay
            return
        if seq > self._expected:
            await self._heal(seq)
            if seq < self._expected:
                return
        self.handle_payload(seq, payload)

    def handle_payload(self, seq: int, payload: bytes) -> KVEventBatch | None:
        """Decode, validate, apply to the mirror and forward one batch; None if it was malformed."""
        self._expected = seq + 1
        self._last_payload = payload
        try:
            batch = decode_vllm_batch(payload, signed_hashes=self._signed)
            ops = self.mirror.prepare(batch.events)
        except EventDecodeError as exc:
            self._malformed(exc.kind, f"seq {seq}: {exc}")
            return None
        except ValueError as exc:
            self._malformed("bad_event", f"seq {seq}: {exc}")
            return None
        dp = batch.data_parallel_rank if batch.data_parallel_rank is not None else self._default_dp
        if self._allowed is not None and dp not in self._allowed:
            self._malformed("dp_rank", f"seq {seq}: batch of DP rank {dp}, stream carries {self._allowed}")
            return None
        self._ranks_seen.add(dp)
        self._started = True
        self.mirror.commit(dp, ops)
        self.sink.submit(dp, batch.events, batch.ts)
        st = self.stats
        st.batches += 1
        st.events += len(batch.events)
        for ev in batch.events:
            if not isinstance(ev, AllBlocksCleared):
                st.block_events += len(ev.block_hashes)
        return batch

    async def _probe(self) -> None:
        """Catch up from the replay socket; quiet on failure (the engine may be down)."""
        if self._replay is None:
            return
        try:
            await self._catch_up()
        except ReplayError as exc:
            self.stats.replay_failures += 1
            log.debug("%s: replay probe failed: %s", self.endpoint, exc)

    async def _catch_up(self, live_seq: int | None = None) -> None:
        """Apply every buffered batch from ``expected`` on, checking it is still the same engine.

        ``live_seq``: the live batch that revealed a gap (it is applied by the caller).

        The request starts one batch early: the engine must send back exactly the payload we
        applied last. No answer for it, or a different payload, means the engine restarted (and
        may already have published past our position, which sequence numbers alone cannot show).
        """
        assert self._replay is not None
        anchor = self._expected - 1
        items = await self._replay.fetch(max(anchor, 0))
        if (anchor >= 0 and self._last_payload is not None
                and (not items or (items[0][0] == anchor and items[0][1] != self._last_payload))):
            self._restart(f"the replay buffer no longer matches batch {anchor}")
            items = await self._replay.fetch(0)
        for seq, payload in items:
            if seq < self._expected:
                continue
            if seq > self._expected:
                if live_seq is not None and seq > live_seq:
                    # The buffer starts past the live batch in hand: only the batches before it are
                    # lost; it and the ones queued behind it on the SUB socket come next.
                    self._lost(live_seq - self._expected, f"the replay buffer now starts at {seq}")
                    return
                self._lost(seq - self._expected, f"the replay buffer now starts at {seq}")
            self.stats.replayed_batches += 1
            self.handle_payload(seq, payload)

    async def _heal(self, live_seq: int) -> None:
        start = self._expected
        lost_before = self.stats.lost_batches
        self.stats.gaps += 1
        if self._replay is None:
            self._lost(live_seq - start, "no replay endpoint")
            return
        try:
            await self._catch_up(live_seq)
        except ReplayError as exc:
            self.stats.replay_failures += 1
            self._lost(live_seq - self._expected, f"replay failed: {exc}")
            return
        if self._expected < live_seq:
            self._lost(live_seq - self._expected, f"replay ended at {self._expected - 1}, before {live_seq}")
        elif self.stats.lost_batches == lost_before:
            self.stats.healed_gaps += 1
            log.info("%s: gap %d..%d healed from the replay buffer", self.endpoint, start, live_seq - 1)

    def _lost(self, n: int, why: str) -> None:
        """Skip ``n`` batches that cannot be had; if the stream had started, distrust the mirror.

        The lost batches may have removed blocks the mirror still holds, so the ranks are cleared
        (and the clear forwarded) before the stream goes on: the index then under-reports until the
        engine stores those blocks again, which costs cache hits, never correctness. A relay that
        joins late without the engine's history loses nothing it had, so nothing is cleared then.
        """
        first = self._expected
        self.stats.lost_batches += n
        self._expected += n
        if not self._started:
            log.warning("%s: stream (re)joined at batch %d; the %d earlier batch(es) are gone (%s)",
                        self.endpoint, self._expected, n, why)
            return
        self.stats.unrecoverable_gaps += 1
        cleared = 0
        now = time.time()
        for dp in sorted(self._ranks_seen):
            cleared += self.mirror.num_blocks(dp)
            self.mirror.clear(dp)
            self.sink.submit(dp, (AllBlocksCleared(),), now)
        log.warning("%s: batches %d..%d are lost (%s); cleared the %d block(s) of DP rank(s) %s, which "
                    "refill as the engine stores blocks again (unrecoverable gap #%d, %d batch(es) lost "
                    "in all)",
                    self.endpoint, first, first + n - 1, why, cleared, sorted(self._ranks_seen),
                    self.stats.unrecoverable_gaps, self.stats.lost_batches)

    def _restart(self, why: str) -> None:
        self.stats.restarts += 1
        log.warning("%s: engine restarted (%s): clearing its blocks and resyncing", self.endpoint, why)
        now = time.time()
        for dp in sorted(self._ranks_seen):
            self.mirror.clear(dp)
            self.sink.submit(dp, (AllBlocksCleared(),), now)
        self._expected = 0
        self._last_payload = None
        self._last_live = None
        self._started = False

    def _malformed(self, kind: str, message: str) -> None:
        self.stats.malformed[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("%s: skipping malformed KV event frame (%s; logged once per kind): %s",
                      self.endpoint, kind, message)


# ------------------------------------------------------------------------- kvcoord agent


def _coordinators(values: Sequence[str]) -> list[str]:
    out = [c.strip() for v in values for c in v.split(",") if c.strip()]
    if not out:
        raise ValueError("--coordinator needs at least one HOST:PORT")
    for c in out:
        host, _, port = c.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator {c!r} is not HOST:PORT")
    return out


def _dp_ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--dp-ranks {text!r} is not a comma-separated list of ints") from None
    if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"--dp-ranks {text!r} must be distinct non-negative ints")
    return ranks


def build_relays(args: argparse.Namespace, sink: EventSink, mirror: BlockMirror) -> list[Relay]:
    """One relay per DP rank, on vLLM's per-rank port offsets of the rank-0 endpoints."""
    relays = []
    for rank in _dp_ranks(args.dp_ranks):
        endpoint = offset_endpoint_port(args.zmq_endpoint, rank)
        assert endpoint is not None
        relays.append(Relay(
            endpoint, sink,
            replay_endpoint=offset_endpoint_port(args.replay_endpoint, rank),
            topic=args.topic, mirror=mirror, signed_hashes=args.signed_hashes, default_dp_rank=rank,
            replay_timeout=args.replay_timeout, allowed_ranks={rank},
        ))
    return relays


def agent_status(relays: Sequence[Relay], reporter: Reporter) -> dict[str, Any]:
    """What ``kvcoord agent --stats-file`` writes: each relay's position and counters, the reporter's acks."""
    rs = reporter.stats()
    return {
        "node_id": rs.node_id,
        "relays": [{"endpoint": r.endpoint, "expected_seq": r.expected_seq,
                    **{k: (dict(v) if isinstance(v, Counter) else v) for k, v in asdict(r.stats).items()}}
                   for r in relays],
        "mirror_blocks": {str(dp): relays[0].mirror.num_blocks(dp) for dp in relays[0].mirror.ranks()}
        if relays else {},
        "reporter": {"epoch": rs.epoch, "last_seq": rs.last_seq, "events_submitted": rs.events_submitted,
                     "links": [asdict(link) for link in rs.links]},
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` (a reader never sees half a file)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


async def _write_stats(path: Path, interval: float, relays: Sequence[Relay], reporter: Reporter,
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            _write_json(path, agent_status(relays, reporter))
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


async def _agent_main(args: argparse.Namespace) -> int:
    from kvcoord.agent.reporter import ChannelSecurity, Reporter

    mirror = BlockMirror()
    ranks = _dp_ranks(args.dp_ranks)
    token = args.token or os.environ.get("KVCOORD_TOKEN") or None
    security = ChannelSecurity(token=token, root_ca=args.tls_ca)
    rep = Reporter(_coordinators(args.coordinator), node_id=args.node_id, model=args.model,
                   snapshot=mirror.rank_entries, dp_ranks=ranks, security=security)
    relays = build_relays(args, rep, mirror)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await rep.start()
    tasks = [asyncio.create_task(r.run(stop), name=f"relay-{r.endpoint}") for r in relays]
    if args.stats_file:
        tasks.append(asyncio.create_task(
            _write_stats(Path(args.stats_file), args.stats_interval, relays, rep, stop), name="stats-file"))
    log.info("agent %s: relaying %s to %s", args.node_id, ", ".join(r.endpoint for r in relays),
             ", ".join(_coordinators(args.coordinator)))
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopper and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        stop.set()
        stopper.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 0.5)
        await rep.close(timeout=0.5)
        if args.stats_file:  # the final word: streams closed, counters complete
            try:
                _write_json(Path(args.stats_file), agent_status(relays, rep))
            except OSError as exc:
                log.warning("cannot write %s: %s", args.stats_file, exc)
    log.info("agent %s: stopped", args.node_id)
    return 0


def run_agent(args: argparse.Namespace) -> int:
    """Body of ``kvcoord agent``."""
    _coordinators(args.coordinator)
    _dp_ranks(args.dp_ranks)
    if not args.stats_interval > 0:
        raise ValueError("--stats-interval must be > 0")
    return asyncio.run(_agent_main(args))
