"""A small HTTP/1.1 client for one server: kept-alive connections, one request at a time on each, framed
by ``httptools`` (llhttp, the coordinator's own parser). What :mod:`kvcoord.router.http_lookup` posts its
lookups on, and what ``kvcoord route`` forwards requests to the engines on (:meth:`HttpPool.request`: the
answer's head first, then its body whole or passed on piece by piece from ``data_received``).

Why not aiohttp's client: a lookup is one small POST and one JSON answer, and aiohttp's client machinery
(request and response objects, header multidicts, stream readers, timers) costs a router more CPU per call
than the lookup's own work. Here a call is one write of a head and the body, and the answer's bytes joined
once. A streamed answer (an engine's SSE, ~370 reads a request) goes from the parser's callback straight
to the caller's sink: no stream reader, no future and no task wake-up per read; the connection stops
reading while the sink's client is slow (:meth:`HttpConn.pipe`).

A kept-alive connection the server closed meanwhile fails the call that finds it dead before any answer
byte: that call is sent once more on a new connection. With a ``read_timeout``, an answer that brings no byte
for that long (a server that stopped mid-answer, or never answered) fails with :class:`ReadTimeout` and its
connection is closed; a pipe paused for its slow client is not counted.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpConn", "HttpPool", "HttpPools", "HttpReply", "ReadTimeout", "Sink"]

HttpReply = tuple[int, bytes, dict[str, str]]
"""Status, body, and the headers asked for (lower-case names)."""
Sink = Callable[[bytes], bool]
"""Takes each piece of a body as it arrives; True asks the connection to stop reading until resumed."""



class ReadTimeout(TimeoutError):
    """The server took the request, then sent no answer byte for the pool's ``read_timeout``: it may still
    be working on it, so the request is not one to send again elsewhere."""


_SENT, _HEAD, _END = 0, 1, 2
"""How far an answer has come."""
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


class HttpConn(asyncio.Protocol):
    """One connection: a request written, its answer parsed; reusable when the server keeps it alive.
    After :meth:`HttpPool.request` returned it: ``status`` and ``headers`` (the ones asked for), then
    :meth:`read` or :meth:`pipe` the body, then :meth:`release`."""

    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.sink: Sink | None = None
        self.phase = _END
        self.until = _END
        self.paused = False
        self.framed = False
        self.error: BaseException | None = None
        self.closed = False
        self.keep_alive = True
        self.got_bytes = False
        self.last_read = 0.0
        """When the request was sent or the answer's last bytes came (``time.monotonic``)."""
        self.idle_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_read = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"a malformed HTTP answer: {exc}"))
            return
        if self.sink is not None and self.body:
            self._flush()  # whatever this read brought, as one piece
        if self.waiter is not None and (self.phase >= self.until or self.paused or self.error is not None):
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.phase == _HEAD and not self.framed and not self.keep_alive:
            self.on_message_complete()  # a body that ends with the connection (no length, not chunked)
            if self.sink is not None and self.body:
                self._flush()
        if self.phase != _END:
            self._fail(ConnectionError(f"connection closed{f': {exc}' if exc else ''}"))
        self._wake()

    # --- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in _FRAMING:
            self.framed = True
        if name in self.pool.wanted:
            self.headers[name.decode()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.phase = _HEAD

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.phase = _END

    # ---
    def send(self, head: bytes, body: bytes) -> None:
        if self.transport is None or self.phase != _END or self.closed:
            raise ConnectionError("the connection is not ready for a request")
        self.got_bytes = self.framed = self.paused = False
        self.phase, self.status, self.headers, self.body, self.sink, self.error = _SENT, 0, {}, [], None, None
        self.last_read = time.monotonic()
        self.transport.writelines((head, body))

    async def wait(self, phase: int) -> None:
        """Until the answer reached ``phase`` (or, piped, the sink asked for a pause); raises what ended
        the exchange first (the connection's loss, a malformed answer, the sink's exception)."""
        while self.error is None and self.phase < phase and not self.paused:
            self.until = phase
            loop = asyncio.get_running_loop()
            self.waiter = loop.create_future()
            if self.pool.read_timeout is not None:
                self._arm(loop)
            try:
                await self.waiter
            finally:
                self.waiter = None
                if self.idle_timer is not None:
                    self.idle_timer.cancel()
                    self.idle_timer = None
        if self.error is not None:
            raise self.error

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        timeout = self.pool.read_timeout
        assert timeout is not None
        self.idle_timer = loop.call_at(loop.time() + max(0.0, self.last_read + timeout - time.monotonic()),
                                       self._idle_check, loop)

    def _idle_check(self, loop: asyncio.AbstractEventLoop) -> None:
        """A waiting answer's timer: fails it when no byte came for ``read_timeout``, else re-arms."""
        timeout = self.pool.read_timeout
        assert timeout is not None
        if time.monotonic() - self.last_read >= timeout:
            self.idle_timer = None
            self._fail(ReadTimeout(f"no answer bytes for {timeout:g} s"))
        else:
            self._arm(loop)

    async def read(self) -> bytes:
        """The whole body."""
        await self.wait(_END)
        body, self.body = b"".join(self.body), []
        return body

    async def pipe(self, sink: Sink, drain: Callable[[], Awaitable[None]]) -> None:
        """Passes the body to ``sink`` as each read brings it (from ``data_received``: no task runs per
        piece) until it ends. When ``sink`` returns True the connection stops reading; it reads again once
        ``drain()`` returned. ``sink``'s exceptions end the exchange (the connection is closed: the server
        sees the request end) and are raised here."""
        self.sink = sink
        if self.body:
            self._flush()
        while True:
            await self.wait(_END)
            if not self.paused:
                return
            await drain()
            self.paused = False
            self.last_read = time.monotonic()  # the pause was the client's: the server's clock starts again
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def release(self) -> None:
        """Back to the pool when the answer ended and the server keeps the connection; else closed."""
        self.sink = None
        if self.phase == _END and self.keep_alive and not self.closed and self.error is None:
            self.pool.idle(self)
        else:
            self.close()

    def _flush(self) -> None:
        body, sink = self.body, self.sink
        assert sink is not None
        piece = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        try:
            pause = sink(piece)
        except Exception as exc:  # raised to the one awaiting the exchange
            self._fail(exc)
            return
        if pause and not self.paused and self.phase != _END and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """Kept-alive connections to ``host:port`` (TLS with ``ssl_context``): one request at a time per
    connection, as many connections as calls run at once. ``headers`` go with every :meth:`post`;
    ``wanted`` names the answer headers returned. ``connect_timeout`` bounds a new connection (TLS
    handshake included); ``read_timeout`` the silence of a server that owes answer bytes (None: no bound)."""

    def __init__(self, host: str, port: int, *, headers: Mapping[str, str] = {},
                 ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 wanted: frozenset[str] = frozenset(), max_idle: int = 64,
                 connect_timeout: float | None = None, read_timeout: float | None = None) -> None:
        self.host, self.port = host, port
        self.ssl = ssl_context
        self.server_hostname = server_hostname if ssl_context is not None else None
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.wanted = frozenset(w.lower().encode() for w in wanted)
        self._idle: list[HttpConn] = []
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.closed = False
        """Closed: a connection handed back (a request in flight at the close) is closed, not kept."""

    def head(self, method: str, path: str, length: int, headers: Mapping[str, str] | None = None) -> bytes:
        """A request's head: ``headers`` (else the pool's), then the body's length. ``ValueError`` when a
        header or the path would break the head's lines."""
        if headers is None:
            extra = self._extra
        else:
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            if extra.count("\n") != len(headers) or extra.count("\r") != len(headers):
                raise ValueError("a header holds a line break")
        if " " in path or "\n" in path or "\r" in path:
            raise ValueError(f"{path!r}: not a request path")
        return (f"{method} {path} HTTP/1.1\r\nHost: {self.authority}\r\n{extra}"
                f"Content-Length: {length}\r\n\r\n").encode()

    async def _connect(self) -> HttpConn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(lambda: HttpConn(self), self.host, self.port, ssl=self.ssl,
                                                   server_hostname=self.server_hostname)
        return conn

    async def post(self, path: str, body: bytes) -> HttpReply:
        """POST ``body`` to ``path``: ``(status, body, wanted headers)``. ``ConnectionError`` / ``OSError``
        when the server cannot be reached or drops the connection; cancelling closes the connection."""
        conn = await self.request("POST", path, body)
        try:
            data = await conn.read()
        finally:
            conn.release()
        return conn.status, data, conn.headers

    async def request(self, method: str, path: str, body: bytes,
                      headers: Mapping[str, str] | None = None) -> HttpConn:
        """Sends a request (``headers``, else the pool's) and returns its connection once the answer's head
        has come: read its body, then :meth:`HttpConn.release` it. ``OSError`` (``ConnectionError``) or
        ``TimeoutError`` (connecting) when the server cannot be reached or drops the connection first."""
        head = self.head(method, path, len(body), headers)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, head, body)
            except ConnectionError:
                if conn.got_bytes:  # it answered, badly: not a stale connection
                    raise
            # a kept-alive connection the server closed meanwhile: once more, on a new one
        return await self._exchange(await self._connect(), head, body)

    @staticmethod
    async def _exchange(conn: HttpConn, head: bytes, body: bytes) -> HttpConn:
        try:
            conn.send(head, body)
            await conn.wait(_HEAD)
        except BaseException:
            conn.close()
            raise
        return conn

    def idle(self, conn: HttpConn) -> None:
        """Keeps ``conn`` for the next request (closed ones are dropped when the list is full)."""
        if self.closed:
            conn.close()
            return
        if len(self._idle) >= self.max_idle:
            self._idle = [c for c in self._idle if not c.closed]
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class HttpPools:
    """An :class:`HttpPool` per server URL (``http(s)://HOST:PORT[/base]``), made at its first request:
    what ``kvcoord route`` forwards to the engines on. Answers' ``content-type`` is kept. At most
    ``max_pools`` are kept, the least recently asked closed first: engines come and go (a pod's new
    address is a new URL), and a pool of one that left must not live as long as the router."""

    def __init__(self, *, connect_timeout: float | None = None, read_timeout: float | None = None,
                 max_idle: int = 256, max_pools: int = 1024) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle = max_idle
        self.max_pools = max_pools
        self._pools: dict[str, tuple[HttpPool, str]] = {}
        self._tls: ssl.SSLContext | None = None

    def _pool(self, url: str) -> tuple[HttpPool, str]:
        got = self._pools.pop(url, None)
        if got is not None:
            self._pools[url] = got  # the most recently asked last
        else:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectionError(f"{url!r}: not an http(s)://HOST:PORT URL")
            while len(self._pools) >= self.max_pools:
                self._pools.pop(next(iter(self._pools)))[0].close()
            if tls and self._tls is None:
                self._tls = ssl.create_default_context()
            pool = HttpPool(parts.hostname, parts.port or (443 if tls else 80), ssl_context=self._tls if tls
                            else None, wanted=frozenset({"content-type"}), max_idle=self.max_idle,
                            connect_timeout=self.connect_timeout, read_timeout=self.read_timeout)
            got = self._pools[url] = (pool, parts.path.rstrip("/"))
        return got

    async def request(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> HttpConn:
        """POSTs ``body`` to ``url`` + ``path``: :meth:`HttpPool.request`."""
        pool, base = self._pool(url)
        return await pool.request("POST", base + path, body, headers)

    def close(self) -> None:
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()
