"""A small HTTP/1.1 client for one server: kept-alive connections, one request at a time on each, framed
by ``httptools`` (llhttp, the coordinator's own parser). What :mod:`kvcoord.router.http_lookup` posts its
lookups on.

Why not aiohttp's client: a lookup is one small POST and one JSON answer, and aiohttp's client machinery
(request and response objects, header multidicts, stream readers, timers) costs a router more CPU per call
than the lookup's own work. Here a call is one write of a prebuilt head and the body, and the answer's
bytes joined once.

A kept-alive connection the server closed meanwhile (its idle timeout) fails the call that finds it dead
before any answer byte: that call is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import cast

import httptools

__all__ = ["HttpPool", "HttpReply"]

HttpReply = tuple[int, bytes, dict[str, str]]
"""Status, body, and the headers asked for (lower-case names)."""


class _Conn(asyncio.Protocol):
    """One connection: a request written, its answer parsed; reusable when the server keeps it alive."""

    def __init__(self, wanted: frozenset[bytes]) -> None:
        self.wanted = wanted
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[HttpReply] | None = None
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.closed = False
        self.keep_alive = True
        self.got_bytes = False

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"a malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"connection closed{f': {exc}' if exc else ''}"))

    # --- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self.wanted:
            self.headers[name.decode()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        reply = (self.parser.get_status_code(), b"".join(self.body), self.headers)
        self.body, self.headers = [], {}
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    # ---
    def send(self, head: bytes, body: bytes) -> asyncio.Future[HttpReply]:
        if self.transport is None or self.waiter is not None or self.closed:
            raise ConnectionError("the connection is not ready for a request")
        self.got_bytes = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, body))
        return self.waiter

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """Kept-alive connections to ``host:port`` (TLS with ``ssl_context``); :meth:`post` one body at a time
    per connection, as many connections as calls run at once. ``headers`` go with every request;
    ``wanted`` names the answer headers :meth:`post` returns."""

    def __init__(self, host: str, port: int, *, headers: Mapping[str, str] = {},
                 ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 wanted: frozenset[str] = frozenset(), max_idle: int = 64) -> None:
        self.host, self.port = host, port
        self.ssl = ssl_context
        self.server_hostname = server_hostname if ssl_context is not None else None
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"HTTP/1.1\r\nHost: {authority}\r\n{extra}Content-Length: ".encode()
        self._wanted = frozenset(w.lower().encode() for w in wanted)
        self._idle: list[_Conn] = []
        self.max_idle = max_idle

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self._wanted), self.host, self.port,
                                               ssl=self.ssl, server_hostname=self.server_hostname)
        return conn

    async def post(self, path: str, body: bytes) -> HttpReply:
        """POST ``body`` to ``path``: ``(status, body, wanted headers)``. ``ConnectionError`` / ``OSError``
        when the server cannot be reached or drops the connection; cancelling closes the connection."""
        head = b"POST " + path.encode() + b" " + self._head + str(len(body)).encode() + b"\r\n\r\n"
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

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes) -> HttpReply:
        try:
            reply = await conn.send(head, body)
        except BaseException:
            conn.close()
            raise
        if conn.keep_alive and not conn.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()
        return reply

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
