"""The relay against real ZMQ sockets: a vLLM-exact publisher on free ports, gaps, restarts, bad frames."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcoord.engine.mirror import BlockMirror
from kvcoord.engine.relay import REPLAY_ONLY_PROBES_WARN, Relay
from kvcoord.engine.zmq_wire import (
    END_SEQ,
    EndpointError,
    FrameReader,
    ReplayClient,
    ZmqEventPublisher,
    offset_endpoint_port,
)
from kvcoord.events import (
    CLEAR,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    Tier,
    to_model,
)
from tests.procs import free_port

DEADLINE = 10.0


class RecordingSink:
    """A real consumer: keeps every batch the relay forwards, in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, tuple[KVEvent, ...], float]] = []
        self.lost: list[tuple[int, str]] = []

    def submit(self, dp_rank: int, events: Sequence[Any], ts: float | None = None,
               ops: Sequence[Any] | None = None, spans: Sequence[int] | None = None) -> None:
        self.batches.append((dp_rank, tuple(to_model(ev) for ev in events), ts or 0.0))

    def history_lost(self, dp_rank: int, reason: str) -> None:
        self.lost.append((dp_rank, reason))


class DroppingPublisher(ZmqEventPublisher):
    """Never puts the given sequence numbers on the PUB socket (they stay in the replay buffer)."""

    def __init__(self, *args: Any, drop: set[int], **kwargs: Any) -> None:
        self.drop = drop
        super().__init__(*args, **kwargs)

    def _send(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        if int.from_bytes(seq_bytes, "big") not in self.drop:
            super()._send(topic, seq_bytes, payload)


class TopicReplayPublisher(ZmqEventPublisher):
    """A replay server that puts the topic frame in its replies: ``[id, b"", topic, seq, payload]``."""

    def _service_replay(self) -> None:
        assert self._replay is not None
        client, _, start = self._replay.recv_multipart()
        for seq, payload in list(self._buffer):
            if seq >= int.from_bytes(start, "big"):
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self._topic, END_SEQ, b""))


class CorruptingPublisher(ZmqEventPublisher):
    """Replaces what goes on the wire for chosen sequence numbers with broken frames."""

    def __init__(self, *args: Any, corrupt: dict[int, Callable[[bytes, bytes, bytes], list[bytes]]],
                 **kwargs: Any) -> None:
        self.corrupt = corrupt
        super().__init__(*args, **kwargs)

    def _send(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        make = self.corrupt.get(int.from_bytes(seq_bytes, "big"))
        if make is None:
            super()._send(topic, seq_bytes, payload)
        else:
            self._pub.send_multipart(make(topic, seq_bytes, payload))


class BrokenBuffer(collections.deque[tuple[int, bytes]]):
    """A replay buffer that keeps chosen batches truncated, as an engine that encoded them badly would."""

    def __init__(self, broken: set[int], maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.broken = broken

    def append(self, item: tuple[int, bytes]) -> None:
        seq, payload = item
        super().append((seq, payload[:-2] if seq in self.broken else payload))


def make_batches(n: int, seed: int, dp: int | None = None, base: int = 0) -> list[KVEventBatch]:
    """Stores and removals over a small hash space, like an engine's prefix cache churning."""
    rng = random.Random(seed)
    held: list[int] = []
    out = []
    for i in range(n):
        events: list[KVEvent] = []
        new = [base + rng.randrange(1, 2**64 - 1) for _ in range(rng.randint(1, 4))]
        events.append(BlockStored(tuple(new), held[-1] if held else None, tuple(range(4 * len(new))), 4,
                                  None, rng.choice(["GPU", "CPU", None]), None))
        held.extend(new)
        if held and rng.random() < 0.4:
            gone = held.pop(rng.randrange(len(held)))
            events.append(BlockRemoved((gone,), "GPU"))
        out.append(KVEventBatch(1000.0 + i, tuple(events), dp))
    return out


def expected_mirror(batches: Sequence[KVEventBatch], dp_default: int = 0) -> dict[int, list[Any]]:
    m = BlockMirror()
    for b in batches:
        m.apply(b.data_parallel_rank if b.data_parallel_rank is not None else dp_default, b.events)
    return {k: sorted(v) for k, v in m.snapshot().items()}


def snapshot_of(relay: Relay) -> dict[int, list[Any]]:
    return {k: sorted(v) for k, v in relay.snapshot().items()}


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Ports:
    def __init__(self) -> None:
        self.pub = free_port()
        self.replay = free_port()

    def publisher(self, cls: type[ZmqEventPublisher] = ZmqEventPublisher, **kw: Any) -> ZmqEventPublisher:
        return cls(0, f"tcp://*:{self.pub}", f"tcp://127.0.0.1:{self.replay}", **kw)


async def rebind(ports: Ports) -> ZmqEventPublisher:
    """A new publisher on the same ports, once libzmq has released them (it closes asynchronously)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while True:
        try:
            return ports.publisher()
        except EndpointError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture
def ports() -> Ports:
    return Ports()


@contextlib.asynccontextmanager
async def running_relay(ports: Ports, sink: RecordingSink, **kw: Any) -> AsyncIterator[Relay]:
    relay = Relay(f"tcp://127.0.0.1:{ports.pub}", sink, replay_endpoint=f"tcp://127.0.0.1:{ports.replay}",
                  replay_timeout=0.5, idle_probe=0.2, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await wait_for(relay.ready.is_set, "relay ready")
        yield relay
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)


async def publish_all(pub: ZmqEventPublisher, batches: Sequence[KVEventBatch]) -> None:
    for b in batches:
        pub.publish(b)
    await asyncio.to_thread(pub.flush)


@contextlib.contextmanager
def inproc_pair(n: int) -> Any:
    """A PUSH -> PULL pair in one context with ``n`` messages ``[b"%d"]`` already queued on the PULL side."""
    ctx: zmq.Context[Any] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://reader")
        push.connect("inproc://reader")
        for i in range(n):
            push.send_multipart([b"%d" % i])
        yield pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


async def test_frame_reader_pauses_where_take_says_and_resumes_there() -> None:
    taken: list[int] = []

    def take(frames: list[bytes]) -> bool:
        taken.append(int(frames[0]))
        return taken[-1] != 4

    with inproc_pair(10) as pull:
        reader = FrameReader(pull, take)
        reader.resume()
        assert await reader.wake.wait(DEADLINE)
        assert taken == [0, 1, 2, 3, 4] and reader.paused and reader.error is None
        for _ in range(10):  # the rest is queued on the socket already: a reader that read on would have
            await asyncio.sleep(0)
        assert taken == [0, 1, 2, 3, 4]  # it waits there while paused
        reader.wake.clear()
        reader.resume()
        await wait_for(lambda: len(taken) == 10, "the rest taken")
        assert taken == list(range(10)) and not reader.wake.is_set()
        reader.close()


async def test_frame_reader_lets_the_loop_run_between_bursts() -> None:
    taken: list[bytes] = []
    seen: list[int] = []

    def take(frames: list[bytes]) -> bool:
        taken.append(frames[0])
        return True

    with inproc_pair(200) as pull:
        reader = FrameReader(pull, take, burst=16)
        reader.resume()
        while len(taken) < 200:
            await asyncio.sleep(0)
            seen.append(len(taken))
        reader.close()
    # This task ran between bursts while the backlog was read, and one chain of reads ran at a time (the
    # FD's callback does not start a second one beside the queued read).
    steps = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    assert len(seen) >= 200 // 16 and max(steps) <= 16, steps


async def test_frame_reader_closed_with_a_read_queued_reads_nothing_more() -> None:
    taken: list[bytes] = []
    errors: list[dict[str, Any]] = []

    def take(frames: list[bytes]) -> bool:
        taken.append(frames[0])
        return True

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        with inproc_pair(3) as pull:
            reader = FrameReader(pull, take)
            reader.resume()  # queues a read
            reader.close()
        for _ in range(5):  # the socket is closed now: a read left queued would fail in the loop
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert taken == [] and errors == []


async def test_frame_reader_hands_an_exception_to_its_task() -> None:
    def take(frames: list[bytes]) -> bool:
        if frames[0] == b"2":
            raise ValueError("bad sink")
        return True

    with inproc_pair(5) as pull:
        reader = FrameReader(pull, take)
        reader.resume()
        assert await reader.wake.wait(DEADLINE)
        assert isinstance(reader.error, ValueError) and reader.paused
        assert pull.recv_multipart(zmq.NOBLOCK) == [b"3"]  # nothing past the failure was taken
        reader.close()


def test_offset_endpoint_port() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError, match="tcp"):
        offset_endpoint_port("ipc:///tmp/x", 1)


async def test_wire_frames_and_replay_are_vllm_exact(ports: Ports) -> None:
    """Frames on PUB and on replay, seen by plain sockets: [topic, seq BE, payload]; replay ends at -1."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{ports.pub}")
    pub = ports.publisher(topic="kv", buffer_steps=3)
    try:
        batches = make_batches(5, seed=1)
        # Publish until the subscription is live, then check frames of what follows.
        for _ in range(200):
            pub.publish(batches[0])
            if await sub.poll(timeout=50):
                break
        frames = await sub.recv_multipart()
        assert frames[0] == b"kv" and len(frames[1]) == 8 and len(frames) == 3
        client = ReplayClient(ctx, f"tcp://127.0.0.1:{ports.replay}", timeout=2.0)
        items, whole = await client.fetch(0)
        assert whole
        # buffer_steps=3: only the last three batches are kept.
        seqs = [s for s, _ in items]
        assert len(seqs) == min(3, pub.next_seq) and seqs == sorted(seqs) and seqs[-1] == pub.next_seq - 1
        assert await client.fetch(pub.next_seq) == ([], True)
        client.close()
    finally:
        pub.shutdown()
        sub.close(linger=0)


async def test_steady_stream_and_late_join(ports: Ports) -> None:
    """Batches published before the agent joined come from replay; the rest live; mirror is exact."""
    pub = ports.publisher()
    sink = RecordingSink()
    try:
        early, late = make_batches(20, seed=2), make_batches(200, seed=3)
        await publish_all(pub, early)
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, late)
            await wait_for(lambda: relay.expected_seq == 220, "all batches")
            assert snapshot_of(relay) == expected_mirror(early + late)
            assert [b[1] for b in sink.batches] == [b.events for b in early + late]
            assert relay.stats.lost_batches == 0 and not relay.stats.malformed
            assert relay.stats.replayed_batches >= 20
            assert relay.stats.block_events == sum(len(e.block_hashes) for b in early + late
                                                   for e in b.events if not isinstance(e, AllBlocksCleared))
    finally:
        pub.shutdown()


class CuttingReplayPublisher(ZmqEventPublisher):
    """Answers each replay request with its first ``keep`` batches and nothing after them (no end marker),
    then a hole of one: what a ROUTER whose pipe filled up sends, every time."""

    keep = 900

    def _service_replay(self) -> None:
        assert self._replay is not None
        client, _, start = self._replay.recv_multipart()
        items = [(seq, payload) for seq, payload in self._buffer if seq >= int.from_bytes(start, "big")]
        end = len(items) <= self.keep
        if not end:
            items = [*items[:self.keep], items[self.keep + 1]]
        for seq, payload in items:
            self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        if end:
            self._replay.send_multipart((client, b"", END_SEQ, b""))


@pytest.mark.parametrize("cls", [ZmqEventPublisher, CuttingReplayPublisher], ids=["vllm", "cut_answers"])
async def test_replay_answer_longer_than_the_router_pipe(ports: Ports, cls: type[ZmqEventPublisher]) -> None:
    """A relay joining 4,000 batches late. vLLM's ROUTER answers with all of them and drops what does not fit
    its peer's pipe (about a thousand, end marker included) when the relay does not read fast enough; the
    relay applies each answer up to its first hole and asks again from there. Nothing is lost (this was an
    unrecoverable gap, or a replay timeout). ``cut_answers`` cuts every long answer, so the asking again
    is certain to happen."""
    batches = make_batches(4000, seed=12)
    pub = ports.publisher(cls)
    sink = RecordingSink()
    try:
        await publish_all(pub, batches)
        async with running_relay(ports, sink) as relay:
            await wait_for(lambda: relay.expected_seq == len(batches), "the whole backlog", timeout=60)
            assert relay.stats.lost_batches == 0 and relay.stats.unrecoverable_gaps == 0 and not sink.lost
            if cls is CuttingReplayPublisher:
                assert relay.stats.replay_partial >= 4000 // CuttingReplayPublisher.keep - 1
            assert snapshot_of(relay) == expected_mirror(batches)
            assert [b[1] for b in sink.batches] == [b.events for b in batches]
    finally:
        pub.shutdown()


async def test_replay_answer_with_holes_is_asked_again() -> None:
    """A replay server that drops messages from the middle of its answer (as a full ROUTER pipe does), end
    marker included: the client returns what arrived, marked incomplete; the next ask is whole."""
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = ReplayClient(ctx, f"tcp://127.0.0.1:{port}", timeout=2.0, settle=2.0)
    asks = 0

    async def serve() -> None:
        nonlocal asks
        while True:
            ident, _, start_bytes = await router.recv_multipart()
            start, asks = int.from_bytes(start_bytes, "big"), asks + 1
            for seq in range(start, 10):
                if asks > 1 or seq not in (6, 7):
                    await router.send_multipart((ident, b"", seq.to_bytes(8, "big"), b"p%d" % seq))
            if asks > 1:
                await router.send_multipart((ident, b"", END_SEQ, b""))

    task = asyncio.create_task(serve())
    try:
        items, whole = await client.fetch(2)
        assert not whole and [s for s, _ in items] == [2, 3, 4, 5, 8, 9]
        items, whole = await client.fetch(5)
        assert whole and [s for s, _ in items] == [5, 6, 7, 8, 9]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        client.close()
        router.close(linger=0)


class StallingReplayPublisher(DroppingPublisher):
    """The first answer from each start seq stops after its first batch (the relay's anchor), with no end
    marker: an answer that stalled before anything new arrived. Asked again from there, it answers whole."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stalled: set[int] = set()
        super().__init__(*args, **kwargs)

    def _service_replay(self) -> None:
        assert self._replay is not None
        client, _, start_bytes = self._replay.recv_multipart()
        start = int.from_bytes(start_bytes, "big")
        items = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        stall = len(items) > 1 and start not in self.stalled
        if stall:
            self.stalled.add(start)
            items = items[:1]
        for seq, payload in items:
            self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        if not stall:
            self._replay.send_multipart((client, b"", END_SEQ, b""))


async def test_an_answer_stalled_before_anything_new_is_asked_again(ports: Ports) -> None:
    """A gap whose first replay answer stops after the anchor (nothing new, no end marker) is asked for once
    more rather than given up: nothing is lost (this cleared the ranks as an unrecoverable gap)."""
    batches = make_batches(40, seed=13)
    pub = ports.publisher(StallingReplayPublisher, drop={5, 6, 20})
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, batches)
            await wait_for(lambda: relay.expected_seq == 40, "healed stream")
            assert relay.stats.lost_batches == 0 and relay.stats.unrecoverable_gaps == 0 and not sink.lost
            assert pub.stalled and relay.stats.replay_partial >= 1
            assert snapshot_of(relay) == expected_mirror(batches)
            assert [b[1] for b in sink.batches] == [b.events for b in batches]
    finally:
        pub.shutdown()


@pytest.mark.parametrize("cls", [ZmqEventPublisher, TopicReplayPublisher], ids=["vllm_reply", "topic_reply"])
async def test_dropped_frames_healed_by_replay(ports: Ports, cls: type[ZmqEventPublisher]) -> None:
    batches = make_batches(60, seed=4)
    drop = {5, 6, 7, 30, 59}
    pub: ZmqEventPublisher
    if cls is ZmqEventPublisher:
        pub = ports.publisher(DroppingPublisher, drop=drop, topic="t")
    else:
        class DropTopic(TopicReplayPublisher, DroppingPublisher):
            pass
        pub = ports.publisher(DropTopic, drop=drop, topic="t")
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink, topic="t") as relay:
            await publish_all(pub, batches)
            # 59 is the last one: only the idle probe can find it.
            await wait_for(lambda: relay.expected_seq == 60, "healed stream")
            assert snapshot_of(relay) == expected_mirror(batches)
            assert [b[1] for b in sink.batches] == [b.events for b in batches]
            # Healed from the replay socket (through a detected gap, or the idle probe if the
            # subscription joined late): nothing lost.
            assert relay.stats.replayed_batches >= len(drop) and relay.stats.lost_batches == 0
    finally:
        pub.shutdown()


async def test_paused_subscriber_with_tiny_hwm(ports: Ports) -> None:
    """A subscriber that stops reading while a tiny-HWM publisher floods: drops, then replay heals."""
    batches = make_batches(400, seed=5)
    pub = ports.publisher(hwm=2)
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink, hwm=2) as relay:
            await publish_all(pub, batches[:10])
            await wait_for(lambda: relay.expected_seq == 10, "first batches")
            # Block the relay's event loop (the "paused" agent) while the engine keeps publishing.
            for b in batches[10:]:
                pub.publish(b)
            pub.flush()
            await wait_for(lambda: relay.expected_seq == 400, "healed stream")
            # Frames were really dropped, and replay healed them (noticed by a later frame's seq, a
            # gap, or by the idle replay probe when no later frame got through).
            assert relay.stats.frames < 400 and relay.stats.replayed_batches > 0
            assert snapshot_of(relay) == expected_mirror(batches)
            assert relay.stats.lost_batches == 0
    finally:
        pub.shutdown()


async def test_engine_restart_clears_then_resyncs(ports: Ports) -> None:
    first, second = make_batches(30, seed=6), make_batches(8, seed=7)
    sink = RecordingSink()
    pub = ports.publisher()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, first)
            await wait_for(lambda: relay.expected_seq == 30, "first engine's batches")
            assert snapshot_of(relay) == expected_mirror(first)
            pub.shutdown()
            pub = await rebind(ports)  # same ports, sequence starts at 0 again
            await publish_all(pub, second)
            await wait_for(lambda: relay.stats.restarts == 1 and relay.expected_seq == 8, "resync")
            assert snapshot_of(relay) == expected_mirror(second)
            cleared = [i for i, (_, evs, _) in enumerate(sink.batches) if evs == (AllBlocksCleared(),)]
            assert cleared == [30]
            assert [b[1] for b in sink.batches[31:]] == [b.events for b in second]
    finally:
        pub.shutdown()


async def test_malformed_frames_counted_and_skipped(ports: Ports, caplog: pytest.LogCaptureFixture) -> None:
    batches = make_batches(40, seed=8)
    garbage = msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]], 0])
    corrupt: dict[int, Callable[[bytes, bytes, bytes], list[bytes]]] = {
        10: lambda t, s, p: [t, s, p[:-3]],                 # truncated msgpack: skipped
        11: lambda t, s, p: [t, s, garbage],                # unknown event type: skipped
        12: lambda t, s, p: [t, s, garbage],                # same kind again: logged once
        20: lambda t, s, p: [t, s],                         # frame missing: the good one comes by replay
        25: lambda t, s, p: [t, s[:4], p],                  # short seq frame: the good one comes by replay
    }
    pub = ports.publisher(CorruptingPublisher, corrupt=corrupt)
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, batches)
            await wait_for(lambda: relay.expected_seq == 40, "stream end")
            # 10..12 cannot be applied: each may have removed blocks, so each clears the mirror (as a
            # lost batch does); 20 and 25 were only broken on the wire and come whole from replay.
            assert snapshot_of(relay) == expected_mirror(batches[13:])
            clear = (AllBlocksCleared(),)
            assert [b[1] for b in sink.batches] == [*(b.events for b in batches[:10]), clear, clear, clear,
                                                    *(b.events for b in batches[13:])]
            assert relay.stats.malformed == {"truncated": 1, "unknown_event": 2, "frames": 1, "seq": 1}
            assert relay.stats.lost_batches == 3 and relay.stats.unrecoverable_gaps == 3
            # each loss is also reported as lost history (the coordinator marks the rank degraded)
            assert [dp for dp, _ in sink.lost] == [0, 0, 0], sink.lost
            assert sorted(why.split(" are gone")[0] for _, why in sink.lost) == [
                f"history lost: 1 batch(es) from seq {seq}" for seq in (10, 11, 12)], sink.lost
            logged = [r.getMessage() for r in caplog.records if "skipping malformed" in r.getMessage()]
            assert len(logged) == 4  # once per kind, each batch's saying what became of the rank
            assert sum("cleared the DP rank(s)' blocks and marked them degraded" in m for m in logged) == 2
            lost = [r for r in caplog.records if r.levelname == "WARNING" and "are lost" in r.getMessage()]
            assert not lost  # no second line per bad batch
    finally:
        pub.shutdown()


async def test_unknown_medium_events_are_skipped_and_the_batch_applies(ports: Ports) -> None:
    """A batch mixing GPU blocks with blocks of a medium no map knows: the GPU blocks apply, the others are
    skipped (not mirrored, not forwarded, counted), and the stream goes on: nothing malformed, no gap,
    nothing cleared."""
    from kvcoord.media import UNKNOWN_MEDIA

    good = make_batches(3, seed=9)
    mixed = KVEventBatch(5.0, (BlockStored((77,), None, (1,), 1, None, "GPU", None),
                               BlockStored((78,), None, (1,), 1, None, "QUANTUM", None),
                               BlockRemoved((77,), "QUANTUM")), 0)
    before = UNKNOWN_MEDIA.total.get("QUANTUM", 0)
    pub = ports.publisher()
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, [*good[:2], mixed, good[2]])
            await wait_for(lambda: relay.expected_seq == 4, "stream end")
            kept = KVEventBatch(5.0, mixed.events[:1], 0)
            assert snapshot_of(relay) == expected_mirror([*good[:2], kept, good[2]])
            assert (77, 0) in relay.snapshot()[0] and 78 not in {h for h, _ in relay.snapshot()[0]}
            assert [b[1] for b in sink.batches] == [good[0].events, good[1].events, (mixed.events[0],),
                                                    good[2].events]
            assert relay.stats.malformed == {} and relay.stats.unrecoverable_gaps == 0
            assert UNKNOWN_MEDIA.total["QUANTUM"] == before + 2
    finally:
        pub.shutdown()


async def test_removal_inside_a_malformed_batch_never_leaves_the_block_reported(ports: Ports) -> None:
    """The batch that evicts block 2 arrives truncated: the relay cannot know what it removed, so it
    must not keep reporting 2 (the index would send requests to a node that lacks it)."""
    batches = [KVEventBatch(1.0, (BlockStored((1, 2), None, tuple(range(8)), 4, None, "GPU", None),), 0),
               KVEventBatch(2.0, (BlockRemoved((2,), "GPU"), BlockStored((3,), 1, (1,) * 4, 4, None, None,
                                                                          None)), 0),
               KVEventBatch(3.0, (BlockStored((4,), None, (2,) * 4, 4, None, "GPU", None),), 0)]
    pub = ports.publisher(CorruptingPublisher, corrupt={1: lambda t, s, p: [t, s, p[:-2]]})
    # Replay serves the same broken payload (what the engine buffered is what it sent).
    pub._buffer = BrokenBuffer({1}, maxlen=100)
    sink = RecordingSink()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, batches)
            await wait_for(lambda: relay.expected_seq == 3, "stream end")
            assert snapshot_of(relay) == {0: [(4, 0)]}
            clear = (AllBlocksCleared(),)
            assert [b[1] for b in sink.batches] == [batches[0].events, clear, batches[2].events]
            assert relay.stats.malformed == {"truncated": 1}
            assert relay.stats.lost_batches == 1 and relay.stats.unrecoverable_gaps == 1
    finally:
        pub.shutdown()


async def test_replay_only_stream_is_flagged(ports: Ports, caplog: pytest.LogCaptureFixture) -> None:
    """An engine that connects its PUB endpoint (vLLM's rule for tcp://HOST:PORT) to a relay that connects
    too: no live frame ever flows, only replay polling feeds the mirror. The relay says so, once."""
    pub = ZmqEventPublisher(0, f"tcp://127.0.0.1:{ports.pub}", f"tcp://127.0.0.1:{ports.replay}")
    sink = RecordingSink()
    batches = make_batches(5, seed=21)
    try:
        async with running_relay(ports, sink) as relay:
            for i, b in enumerate(batches):  # one batch per probe: each probe delivers something
                await publish_all(pub, [b])
                await wait_for(lambda i=i: relay.expected_seq == i + 1, f"batch {i} by replay")
            assert relay.stats.frames == 0 and relay.stats.replayed_batches == 5
            assert relay.stats.replay_only_probes >= 3
            assert snapshot_of(relay) == expected_mirror(batches)
            warned = [r for r in caplog.records if "no live PUB frames" in r.getMessage()]
            assert len(warned) == 1 and "both sides connecting" in warned[0].getMessage()
    finally:
        pub.shutdown()


async def test_bind_true_binds_a_host_endpoint(ports: Ports, caplog: pytest.LogCaptureFixture) -> None:
    """``bind=True`` (what ``kvcoord sim-engine --zmq-bind`` uses) binds tcp://127.0.0.1:PORT, so the
    relay's SUB connects to it and batches arrive as live frames, not by replay."""
    pub = ZmqEventPublisher(0, f"tcp://127.0.0.1:{ports.pub}", f"tcp://127.0.0.1:{ports.replay}", bind=True)
    sink = RecordingSink()
    batches = make_batches(30, seed=22)
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, batches[:1])  # may come by replay (a slow joiner), the rest need not
            await wait_for(lambda: relay.expected_seq == 1, "first batch")
            await publish_all(pub, batches[1:])
            await wait_for(lambda: relay.expected_seq == 30, "stream end")
            assert relay.stats.frames > 0 and relay.stats.replay_only_probes < REPLAY_ONLY_PROBES_WARN
            assert snapshot_of(relay) == expected_mirror(batches)
            assert not [r for r in caplog.records if "no live PUB frames" in r.getMessage()]
    finally:
        pub.shutdown()


def test_mirror_tiers_groups_and_idempotence() -> None:
    m = BlockMirror()
    m.apply(0, [BlockStored((1, 2), None, (), 0, None, "GPU", None),
                BlockStored((1,), None, (), 0, None, "CPU", None),
                BlockStored((1,), None, (), 0, None, "GPU", None)])
    assert sorted(m.snapshot()[0]) == [(1, 0), (1, 1), (2, 0)]
    m.apply(0, [BlockRemoved((1,), "CPU"), BlockRemoved((99,), None)])  # unknown removal: no-op
    assert sorted(m.snapshot()[0]) == [(1, 0), (2, 0)]
    # A sliding-window group's events never reach the mirror, nor do its removals touch group 0.
    m.apply(0, [BlockStored((5, 1), None, (), 0, None, "GPU", None, group_idx=1,
                            kv_cache_spec_kind="sliding_window"),
                BlockRemoved((1,), "GPU", group_idx=1)])
    assert sorted(m.snapshot()[0]) == [(1, 0), (2, 0)]
    m.apply(1, [BlockStored((bytes(24) + (9).to_bytes(8, "big"),), None, (), 0, None, None, None)])
    assert m.snapshot()[1] == [(9, 0)]
    with pytest.raises(ValueError, match="medium must be a string"):
        m.apply(0, [BlockRemoved((2,), "GPU"), BlockRemoved((1,), 7)])  # type: ignore[arg-type]
    assert sorted(m.snapshot()[0]) == [(1, 0), (2, 0)]  # nothing applied
    m.apply(0, [BlockRemoved((1,), "TAPE"), BlockStored((8,), None, (), 0, None, "TAPE", None)])
    assert sorted(m.snapshot()[0]) == [(1, 0), (2, 0)]  # an unknown medium's events: skipped
    m.apply(0, [BlockStored((7,), None, (), 0, None, "CPU", None)])
    # The snapshot provider's columns: validated uint64 hashes with their tiers, the same entries.
    hashes, tiers = m.rank_entries(0).columns()
    assert sorted(zip(hashes, tiers, strict=True)) == sorted(m.snapshot()[0]) == [(1, 0), (2, 0), (7, 1)]
    assert all(type(h) is int for h in hashes) and all(isinstance(t, Tier) for t in tiers)
    assert len(m.rank_entries(0)) == 3 and m.num_blocks(0) == 3 and len(m.rank_entries(5)) == 0
    m.apply(0, [AllBlocksCleared()])
    assert m.snapshot()[0] == [] and m.num_blocks() == 1


async def test_restart_detected_when_new_engine_is_already_ahead(ports: Ports) -> None:
    """The restarted engine published past our position before we noticed: the replay anchor tells."""
    first, second = make_batches(5, seed=10), make_batches(40, seed=11)
    sink = RecordingSink()
    pub = ports.publisher()
    try:
        async with running_relay(ports, sink) as relay:
            await publish_all(pub, first)
            await wait_for(lambda: relay.expected_seq == 5, "first engine's batches")
            pub.shutdown()
            pub = await rebind(ports)
            await publish_all(pub, second)
            await wait_for(lambda: relay.stats.restarts >= 1 and relay.expected_seq == 40, "resync")
            assert relay.stats.restarts == 1
            assert snapshot_of(relay) == expected_mirror(second)
    finally:
        pub.shutdown()


def _stored(hashes: Sequence[int], ts: float) -> KVEventBatch:
    ev = BlockStored(tuple(hashes), None, tuple(range(4 * len(hashes))), 4, None, "GPU", None)
    return KVEventBatch(ts, (ev,), 0)


@pytest.mark.parametrize("replay", [True, False], ids=["buffer_rolled", "no_replay_endpoint"])
async def test_unrecoverable_gap_clears_the_mirror(ports: Ports, replay: bool,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Lost batches may have removed blocks: the relay must forget the rank rather than keep lying."""
    a, b, c = 1000, 1001, 1002
    head = [_stored((a, b), 0.0), *(_stored((2000 + i,), float(i)) for i in range(1, 10))]
    tail: list[KVEventBatch] = []
    for i in range(10, 40):
        if i == 11:
            tail.append(KVEventBatch(float(i), (BlockRemoved((a,), "GPU"),), 0))  # lost: A is gone
        elif i == 12:
            tail.append(_stored((c,), float(i)))  # lost: C is held, but the relay cannot know
        else:
            tail.append(_stored((3000 + i,), float(i)))
    # A replay buffer of 12 batches cannot cover 15 dropped ones.
    pub = ports.publisher(DroppingPublisher, drop=set(), buffer_steps=12)
    sink = RecordingSink()
    relay = Relay(f"tcp://127.0.0.1:{ports.pub}", sink,
                  replay_endpoint=f"tcp://127.0.0.1:{ports.replay}" if replay else None,
                  replay_timeout=0.5, idle_probe=0.2)
    stop_ev = asyncio.Event()
    task = asyncio.create_task(relay.run(stop_ev))
    try:
        await wait_for(relay.ready.is_set, "relay ready")
        first = 0
        if replay:
            await publish_all(pub, head)  # a slow joiner gets these from the (still big enough) buffer
        else:
            for _ in range(500):  # no replay: wait until the subscription is live, then start over
                pub.publish(KVEventBatch(0.0, (), 0))
                await asyncio.to_thread(pub.flush)
                if relay.stats.batches:
                    break
                await asyncio.sleep(0.01)
            await wait_for(lambda: relay.expected_seq == pub.next_seq, "the warm-up batches")
            sink.batches.clear()
            first = pub.next_seq
            await publish_all(pub, head)
        await wait_for(lambda: relay.expected_seq == first + 10, "the head of the stream")
        assert {h for h, _ in relay.snapshot()[0]} >= {a, b}
        caplog.clear()
        assert isinstance(pub, DroppingPublisher)
        pub.drop = set(range(first + 10, first + 25))
        await publish_all(pub, tail)
        await wait_for(lambda: relay.expected_seq == first + 40, "the tail of the stream")
        held = {h for h, _ in relay.snapshot()[0]}
        truth = {h for h, _ in expected_mirror(head + tail)[0]}
        assert a not in held, "a block removed in a lost batch is still reported"
        assert held <= truth  # under-reports (b, c, the head's blocks), never over-reports
        assert b not in held and c not in held
        assert {3000 + i for i in range(25, 40)} <= held  # the stream goes on after the gap
        st = relay.stats
        assert st.unrecoverable_gaps == 1 and st.lost_batches >= 4, st
        clears = [i for i, (_, evs, _) in enumerate(sink.batches) if evs == (AllBlocksCleared(),)]
        assert clears == [10], clears  # forwarded once, right after the head
        warned = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert len(warned) == 1 and "cleared the 11 block(s)" in warned[0], warned
    finally:
        stop_ev.set()
        await asyncio.wait_for(task, 2.0)
        pub.shutdown()


def _random_events(rng: random.Random, n: int) -> list[KVEvent]:
    """Events of every form the fast path must take or hand over: int and digest hashes, media, groups,
    spec kinds (indexable or not), clears, empty stores."""
    out: list[KVEvent] = []
    for _ in range(n):
        medium = rng.choice([None, "GPU", "cpu", "CPU_PINNED", "DISK", "TAPE"])  # TAPE: unknown, skipped
        group = rng.choice([None, 0, 1])
        hashes: tuple[Any, ...] = tuple(rng.randrange(2, 1 << 64) for _ in range(rng.choice([0, 1, 1, 1, 3])))
        if rng.random() < 0.05:
            hashes = tuple(rng.randbytes(32) for _ in hashes)
        r = rng.random()
        if r < 0.05:
            out.append(AllBlocksCleared())
        elif r < 0.35:
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(), block_size=4,
                                   medium=medium, group_idx=group,
                                   kv_cache_spec_kind=rng.choice([None, "full_attention", "sliding_window"])))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
    return out


def merged_oracle(ops: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """The runs of ``ops`` (one per event) as the docs state them: consecutive stores or removals of one
    kind, tier, group and indexability as one op of all their hashes; a CLEAR alone."""
    out: list[Any] = []
    spans: list[int] = []
    for op in ops:
        last = out[-1] if out else None
        if last is not None and op.kind != CLEAR and (op.kind, op.tier, op.group, op.indexable) == (
                last.kind, last.tier, last.group, last.indexable):
            out[-1] = last._replace(hashes=[*last.hashes, *op.hashes])
            spans[-1] += 1
        else:
            out.append(op)
            spans.append(1)
    return out, spans


def test_merged_ops_are_the_runs_of_the_plain_ones_and_apply_alike() -> None:
    """``op_runs`` (the relay's fast path) equals the runs of ``ops_of()`` on every batch, its spans add up
    to the events, and a mirror fed merged ops ends equal to one fed an op per event."""
    from kvcoord import validate

    rng = random.Random(12)
    plain_mirror, merged_mirror = BlockMirror(), BlockMirror()
    for _ in range(400):
        events = _random_events(rng, rng.randint(1, 40))
        if rng.random() < 0.5:  # long runs of 1-block removals, as vLLM frees blocks
            events += [BlockRemoved(block_hashes=(rng.randrange(2, 1 << 64),)) for _ in range(30)]
        plain = validate.ops_of(events)
        merged, spans = validate.op_runs(events)
        slow, slow_spans = merged_oracle(plain)
        assert [(*op[:2], list(op[2]), *op[3:]) for op in merged] == \
            [(*op[:2], list(op[2]), *op[3:]) for op in slow]
        known = [ev for ev in events if getattr(ev, "medium", None) != "TAPE"]
        assert spans == slow_spans and sum(spans) == len(known) == len(validate.known_runs(events).events)
        assert sum(len(op.hashes) for op in merged) == sum(len(op.hashes) for op in plain)
        plain_mirror.commit(0, plain)
        merged_mirror.commit(0, merged)
    assert merged_mirror.snapshot()
    assert sorted(merged_mirror.snapshot()[0]) == sorted(plain_mirror.snapshot()[0])


def test_merged_ops_of_decoded_views_are_the_runs_of_the_plain_ones() -> None:
    """The relay's decoded views (whose runs skip the per-event checks) merge as model events do, and a
    view that breaks its run's form (an unknown medium, a digest hash) fails or falls back as ``ops_of``."""
    from kvcoord import validate
    from kvcoord.events import VIEW_TYPES, decode_vllm_views, encode_vllm_batch

    rng = random.Random(13)
    for _ in range(300):
        events = _random_events(rng, rng.randint(1, 40))
        if rng.random() < 0.5:
            events += [BlockRemoved(block_hashes=(rng.randrange(2, 1 << 64),), medium="GPU", group_idx=0)
                       for _ in range(30)]
        views = decode_vllm_views(encode_vllm_batch(KVEventBatch(1.0, tuple(events)))).events
        assert all(type(v) in VIEW_TYPES for v in views)
        merged, spans = validate.op_runs(views)
        slow, slow_spans = merged_oracle(validate.ops_of(views))
        assert [(*op[:2], list(op[2]), *op[3:]) for op in merged] == \
            [(*op[:2], list(op[2]), *op[3:]) for op in slow]
        known = [ev for ev in events if getattr(ev, "medium", 0) != "TAPE"]
        assert spans == slow_spans and sum(spans) == len(known)
    run = [BlockRemoved(block_hashes=(5 + i,), medium="GPU", group_idx=0) for i in range(3)]
    digest = BlockRemoved(block_hashes=(b"\x01" * 32,), medium="GPU", group_idx=0)
    views = decode_vllm_views(encode_vllm_batch(KVEventBatch(1.0, (*run, digest, *run)))).events
    ops, spans = validate.op_runs(views)
    assert spans == [7] and list(ops[0].hashes) == [5, 6, 7, 0x0101010101010101, 5, 6, 7]
    tape = BlockRemoved(block_hashes=(9,), medium="tape", group_idx=0)
    views = decode_vllm_views(encode_vllm_batch(KVEventBatch(1.0, (*run, tape, *run)))).events
    kept, ops, spans = validate.known_runs(views)  # the unknown medium's event is skipped, runs join over it
    assert spans == [6] and list(ops[0].hashes) == [5, 6, 7, 5, 6, 7]
    assert list(kept) == [*views[:3], *views[4:]]


def test_merged_ops_refuse_what_plain_ops_refuse() -> None:
    """A bad event fails the merged path exactly as the plain one, naming the same event."""
    from kvcoord import validate

    good = BlockRemoved(block_hashes=(5,))
    for bad in (BlockRemoved(block_hashes=(5,), medium=5), BlockRemoved(block_hashes=(-1,)),  # type: ignore[arg-type]
                BlockRemoved(block_hashes=(5,), group_idx=-2), "not an event"):
        events: list[Any] = [good, good, bad, good]
        with pytest.raises(validate.InvalidEvent) as plain:
            validate.ops_of(events)
        with pytest.raises(validate.InvalidEvent) as merged:
            validate.op_runs(events)
        assert str(merged.value) == str(plain.value) and "event 2" in str(plain.value)
