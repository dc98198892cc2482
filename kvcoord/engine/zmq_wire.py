"""vLLM's ZMQ KV-event transport, both ends.

The publisher reproduces ``vllm.distributed.kv_events.ZmqEventPublisher`` frame for frame, so
anything that consumes a vLLM engine (our relay, Dynamo, llm-d) can consume ours:

- PUB socket, multipart ``[topic, seq (8 bytes big-endian), msgpack KVEventBatch]``, seq counting
  0, 1, 2, ... per publisher instance; high-water mark ``hwm``;
- ROUTER replay socket: a request ``[identity, b"", start_seq (8 bytes BE)]`` is answered with
  ``[identity, b"", seq, payload]`` for every buffered batch with ``seq >= start_seq`` (the last
  ``buffer_steps`` batches), then the end marker ``[identity, b"", (-1 as 8 signed bytes), b""]``;
- endpoints are bound when they contain ``*``/``::`` or are ``ipc://``/``inproc://``, connected
  otherwise (vLLM's rule; ``bind=True`` always binds the PUB endpoint, as a stand-in engine whose
  agents connect to it must); the replay endpoint is always bound; a DP rank offsets a tcp port by
  the rank (``inproc`` gets a ``_dp<rank>`` suffix);
- encoding and sending happen on one background thread fed by a queue.

The subscriber side (:class:`ReplayClient`, :func:`parse_pub_frames`) is what the relay uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, cast

import msgspec
import zmq
import zmq.asyncio

from kvcoord.events import KVEventBatch, encode_vllm_batch
from kvcoord.validate import shown

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's sequence frame."""

SEQ_BYTES = 8


def check_endpoint(text: str, *, connect: bool = False) -> str:
    """``text`` if it is a ZMQ endpoint kvcoord can use (``tcp://HOST:PORT``, ``ipc://PATH``, ``inproc://NAME``;
    with ``connect``, a ``tcp://`` address to dial: not ``*``). Otherwise ``ValueError`` saying what is
    wrong, in the words of Dynamo's indexer (``invalid ZMQ endpoint `X`: missing TCP port``)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"invalid ZMQ endpoint `{shown(text, 256, quote=False)}`: {why}")

    scheme, sep, rest = text.partition("://")
    if not sep:
        raise bad("missing scheme")
    if scheme not in ("tcp", "ipc", "inproc"):
        raise bad(f"unsupported scheme `{shown(scheme, quote=False)}`")
    if connect and scheme != "tcp":
        raise bad(f"the coordinator relays tcp:// endpoints only, not `{shown(scheme, quote=False)}`")
    if not rest:
        raise bad("missing address")
    if scheme != "tcp":
        return text
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or not tail.startswith(":"):
            raise bad("missing TCP port")
        port = tail[1:]
    else:
        host, colon, port = rest.partition(":")
        if not colon or ":" in port:
            raise bad("missing TCP port")
    if not host:
        raise bad("missing TCP host")
    if not port.isdigit() or not port.isascii():
        raise bad("invalid TCP port: invalid digit found in string" if port else "missing TCP port")
    if int(port) > 65535:
        raise bad("invalid TCP port: number too large to fit in target type")
    if connect and (host == "*" or int(port) == 0):
        raise bad("not an address to connect to (a bind address?)")
    why = _bad_host(host, bracketed=rest.startswith("["))
    if why:
        raise bad(f"invalid TCP host: {why}")
    return text


MAX_HOST_CHARS = 253
"""A DNS name's longest text form (RFC 1035), without a final dot."""
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _bad_host(host: str, *, bracketed: bool) -> str:
    """Why ``host`` is not an IP address, a DNS name (labels of letters, digits, ``-`` and ``_``; at most
    :data:`MAX_HOST_CHARS` characters) or ``*``; "" if it is one."""
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "not an IPv6 address"
        return ""
    if host == "*":
        return ""
    name = host.removesuffix(".")
    if len(name) > MAX_HOST_CHARS:
        return f"{len(name)} characters, at most {MAX_HOST_CHARS}"
    labels = name.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        return "not a DNS name or an IP address"
    if all(label.isdigit() for label in labels):  # 1.2.3, 999.1.1.1: no name, and no IPv4 address
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return "not an IPv4 address"
    return ""


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank, ``inproc://x`` -> ``inproc://x_dp<rank>``."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            cut = endpoint.rfind(":")
            return f"{endpoint[:cut]}:{int(endpoint[cut + 1:]) + dp_rank}"
        return endpoint
    raise ValueError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EndpointError(OSError):
    """A ZMQ endpoint that cannot be bound or connected (address in use, bad address): one line."""


def _endpoint_error(verb: str, endpoint: str, exc: zmq.ZMQError) -> EndpointError:
    return EndpointError(f"cannot {verb} {endpoint}: {exc.strerror or exc}")


class ZmqEventPublisher:
    """Reliable PUB/ROUTER publisher with an in-memory replay buffer (vLLM-exact).

    ``publish`` only enqueues; a daemon thread encodes (``form``: ``map`` like vLLM >= 0.24,
    ``array`` like <= 0.23), sends and buffers. ``_send`` is the single point where a frame
    leaves, so a test can subclass it to drop frames and force gaps.
    """

    SHUTDOWN_TIMEOUT = 0.5

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        form: Literal["map", "array"] = "map",
        ctx: zmq.Context[Any] | None = None,
        poll_interval: float = 0.02,
        bind: bool | None = None,
    ) -> None:
        """``bind``: True binds the PUB endpoint, False connects it, None follows vLLM's rule (bind only a
        wildcard, ``ipc`` or ``inproc`` endpoint)."""
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._form: Literal["map", "array"] = form
        self._topic = topic.encode("utf-8")
        self._poll_interval = poll_interval
        self._ctx = ctx if ctx is not None else zmq.Context.instance()
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert self.endpoint is not None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[Any] | None = None
        binds = bind if bind is not None else _binds(self.endpoint)
        where = self.endpoint
        try:
            if binds:
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                where = self.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            verb = "bind" if binds or where != self.endpoint else "connect"
            raise _endpoint_error(verb, where, exc) from None
        self._next_seq = 0
        self._queued = 0
        self._stop_at: float | None = None
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="zmq-publisher")
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next sent batch will carry."""
        return self._next_seq

    @property
    def queued_seq(self) -> int:
        """The sequence number after the last queued batch (``next_seq`` lags it while the thread sends)."""
        return self._queued

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch; a batch without a DP rank gets the publisher's (as vLLM does)."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._dp_rank)
        self._queue.put(batch)
        self._queued += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self) -> None:
        """Send what is queued (for up to ``SHUTDOWN_TIMEOUT``), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        self._stop_at = time.monotonic() + self.SHUTDOWN_TIMEOUT
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT + 0.2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -------------------------------------------------------------- thread side

    def _send(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        self._pub.send_multipart((topic, seq_bytes, payload))

    def _loop(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._service_replay()
                except zmq.ZMQError:  # pragma: no cover - socket closed under us
                    log.exception("replay socket failed")
            try:
                batch = self._queue.get(timeout=self._poll_interval)
            except queue.Empty:
                continue
            if batch is None:
                self._queue.task_done()
                return
            stop_at = self._stop_at
            if stop_at is not None and time.monotonic() > stop_at:  # shutting down: drop the rest
                self._queue.task_done()
                continue
            try:
                seq = self._next_seq
                payload = encode_vllm_batch(batch, form=self._form)
                self._send(self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload)
                self._buffer.append((seq, payload))
                self._next_seq = seq + 1
            except Exception:
                log.exception("publishing a KV event batch failed")
                time.sleep(0.1)
            finally:
                self._queue.task_done()

    def _service_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request with %d frames", len(frames))
            return
        client_id, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client_id, b"", seq.to_bytes(SEQ_BYTES, "big"), payload))
        self._replay.send_multipart((client_id, b"", END_SEQ, b""))


# ------------------------------------------------------------------ subscriber side


class FrameError(ValueError):
    """A multipart message that is not ``[topic, seq, payload]``; ``kind`` labels a counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def parse_pub_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """``[topic, seq, payload]`` -> ``(seq, payload)``; raises :class:`FrameError`."""
    if len(frames) != 3:
        raise FrameError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    seq_bytes = frames[1]
    if len(seq_bytes) != SEQ_BYTES:
        raise FrameError("seq", f"sequence frame must be {SEQ_BYTES} bytes, got {len(seq_bytes)}")
    return int.from_bytes(seq_bytes, "big"), frames[2]


class ReplayError(RuntimeError):
    """The replay endpoint did not answer in time, or answered nonsense."""


class ReplayClient:
    """Asks a vLLM replay ROUTER for batches from a sequence number on, with a DEALER socket.

    vLLM's example uses REQ, which can receive only the first reply of the stream; a DEALER
    reads them all. Replies are accepted with or without a topic frame (``[b"", seq, payload]``
    as vLLM sends, ``[b"", topic, seq, payload]``, or without the empty delimiter): the last two
    frames are always ``seq, payload``. The stream ends at the ``-1`` marker.

    A ROUTER drops what does not fit its peer's pipe (about a thousand messages), silently: an answer
    longer than that arrives with holes and without its end marker. So an answer that stops arriving
    after it started (``settle`` seconds without a message) is returned as it is, marked incomplete;
    the caller applies what is contiguous and asks again from there.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, timeout: float = 2.0,
                 settle: float = 0.5) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout = timeout
        """Seconds to wait for the answer to begin."""
        self.settle = min(settle, timeout)
        """Seconds without a message, once the answer began, after which it is taken as cut short."""
        self._sock: zmq.asyncio.Socket | None = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def fetch(self, start_seq: int) -> tuple[list[tuple[int, bytes]], bool]:
        """Every buffered ``(seq, payload)`` with ``seq >= start_seq`` that arrived, in order, and whether
        the answer was whole (its end marker arrived). An incomplete one may have holes.

        Raises :class:`ReplayError` when no answer begins in time or a reply is malformed. After either, or
        an incomplete answer, the socket is replaced, so a late message cannot pass for the next answer's.
        """
        sock = self._socket()
        await sock.send_multipart((b"", start_seq.to_bytes(SEQ_BYTES, "big")))
        out: list[tuple[int, bytes]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                remaining = max(0.0, deadline - loop.time())  # past it (the loop was busy): look once more
                if not await sock.poll(timeout=int(remaining * 1000) + 1):
                    if out:
                        self.close()
                        return out, False
                    raise ReplayError(f"replay from {self.endpoint} timed out after {self.timeout}s")
                frames = await sock.recv_multipart()
                if len(frames) < 2 or len(frames[-2]) != SEQ_BYTES:
                    raise ReplayError(f"malformed replay reply ({len(frames)} frames)")
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ:
                    return out, True
                out.append((int.from_bytes(seq_bytes, "big"), payload))
                deadline = loop.time() + self.settle
        except BaseException:
            self.close()
            raise


def subscribe_socket(ctx: zmq.Context[Any], endpoint: str, topic: str, *, hwm: int = 100_000,
                     heartbeat: float | None = None, monitor: PeerMonitor | None = None
                     ) -> zmq.Socket[bytes]:
    """A SUB socket on ``endpoint`` filtered by ``topic`` (connect, or bind for wildcard endpoints).

    A synchronous socket (of any context, an asyncio one included): the relay receives without
    blocking, from its FD's reader callback (a :class:`FrameReader`). ``heartbeat``: seconds between
    ZMTP pings, so a peer that vanished without closing is disconnected after three missed ones;
    ``monitor`` watches its peers from before it connects."""
    sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.set_hwm(hwm)
    if heartbeat is not None:
        ms = max(1, int(heartbeat * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
    if monitor is not None:
        monitor.attach(sock)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
    try:
        if _binds(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        with contextlib.suppress(Exception):
            sock.close(linger=0)
        raise _endpoint_error("bind" if _binds(endpoint) else "connect", endpoint, exc) from None
    return sock


class PeerMonitor:
    """Whether a socket has a peer now: its ZMTP handshakes completed minus its disconnections.

    The one signal of a PUB endpoint that publishes nothing and has no replay socket to ask: ZMQ connects
    lazily, so a SUB socket gives no error when nothing listens. Read without blocking (:meth:`connected`),
    from a synchronous PAIR socket on the monitored socket's inproc monitor endpoint."""

    _EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    _seq = 0

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        PeerMonitor._seq += 1
        self._addr = f"inproc://kvcoord-peer-monitor-{PeerMonitor._seq}-{id(self)}"
        self._sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._peers = 0

    def attach(self, sock: zmq.Socket[bytes]) -> None:
        """Watch ``sock``: before it connects, so its first handshake is seen."""
        sock.monitor(self._addr, self._EVENTS)
        self._sock.connect(self._addr)

    def connected(self) -> bool:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self._peers > 0
            event = int.from_bytes(frames[0][:2], "little") if frames and len(frames[0]) >= 2 else 0
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self._peers = max(0, self._peers - 1)

    def close(self) -> None:
        self._sock.close(linger=0)


class FrameReader:
    """Hands a synchronous ZMQ socket's messages to ``take`` from an event-loop reader callback on its FD.

    A relay that keeps up with its engine wakes once per batch. Resuming a task for each one (a future, a
    timer, a task step) cost about 100 µs of CPU a frame at an engine's pace, a third of a registered
    engine's; a callback costs none of that. ``take`` returns False to pause the reader (its owner has
    something to await first: a gap to heal); an exception pauses it too, kept in ``error``. Either sets
    ``wake``, which the owning task waits on. :meth:`resume` goes on where it stopped.

    The FD only signals activity and ``ZMQ_EVENTS`` says whether a message is there (asking it rearms the
    FD), so the reader asks before every receive. One chain of reads runs at a time: at most ``burst``
    messages in a row, then the loop runs its other callbacks before the next ``burst`` (a backlog must
    not starve other tasks or a SIGTERM handler). While paused it is unregistered and nothing of it is
    queued, so a readable FD nobody reads cannot make the loop spin, and a closed socket is never read.
    """

    __slots__ = ("_armed", "_burst", "_fd", "_loop", "_sock", "_soon", "_take", "error", "paused", "wake")

    def __init__(self, sock: zmq.Socket[Any], take: Callable[[list[bytes]], bool], *,
                 burst: int = 64) -> None:
        self._sock = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._take = take
        self._burst = burst
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = False
        self._soon: asyncio.Handle | None = None
        """The next read of the chain, queued in the loop."""
        self.paused = True
        self.error: Exception | None = None
        self.wake = Wakeup()

    def resume(self) -> None:
        """Read again (from inside the running loop): what is queued now, then as messages come."""
        if not self.paused:
            return
        self.paused = False
        self.error = None
        loop = self._loop = asyncio.get_running_loop()
        if not self._armed:
            loop.add_reader(self._fd, self._on_fd)
            self._armed = True
        self._again(loop)  # the FD may have signalled while nobody listened

    def pause(self) -> None:
        """Stop reading until :meth:`resume`."""
        self.paused = True
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._armed and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._armed = False

    close = pause

    def _again(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._soon is None:
            self._soon = loop.call_soon(self._queued)

    def _queued(self) -> None:
        self._soon = None
        self._read()

    def _on_fd(self) -> None:
        if self._soon is None:  # else the queued read comes first, and reads on
            self._read()

    def _read(self) -> None:
        sock, take = self._sock, self._take
        try:
            for _ in range(self._burst):
                if not _readable(sock):
                    return
                if not take(sock.recv_multipart(zmq.NOBLOCK)):
                    self.pause()
                    self.wake.set()
                    return
        except Exception as exc:  # handed to the owning task, which raises it
            self.error = exc
            self.pause()
            self.wake.set()
            return
        assert self._loop is not None
        self._again(self._loop)


def _readable(sock: zmq.Socket[Any]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


class Wakeup:
    """``asyncio.Event``'s ``set``/``clear`` for one waiter, whose :meth:`wait` with a timeout costs one
    future and one timer handle: ``asyncio.wait_for`` wraps each wait in a new task, and the reporter's
    writer waits once per message."""

    __slots__ = ("_flag", "_waiter")

    def __init__(self) -> None:
        self._flag = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._flag = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    @property
    def waiting(self) -> bool:
        """Someone is in :meth:`wait`."""
        return self._waiter is not None

    async def wait(self, timeout: float) -> bool:
        """Until set, or ``timeout`` seconds; whether it is set."""
        if self._flag:
            return True
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        handle = loop.call_later(max(0.0, timeout), _release, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None
        return self._flag


def _release(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
