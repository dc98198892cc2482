"""A small HTTP/1.1 server for the coordinator's HTTP API: asyncio transports and ``httptools``' parser.

Why not a framework: a lookup is a few hundred microseconds of work, and a framework's request objects,
middleware and task per request cost about as much again (aiohttp: ~250 us more per 57 KB ``/query``,
measured in ``benchmarks/bench_vs_dynamo_service.py``). What it does:

- keep-alive and pipelining (answers go out in request order), ``Content-Length`` or chunked bodies,
  ``Expect: 100-continue``;
- a body limit per route: 413 before a byte of an oversized body is read (but 404/405 first);
- 404 (empty) for an unknown path, 405 with ``Allow`` for a known path and another method, ``HEAD``
  wherever ``GET`` is served;
- a handler may answer at once (a plain :class:`Response`) or with an awaitable: a lookup on an
  in-process index never pays for a task;
- a malformed request gets 400 and the connection is closed; nothing reaches a handler;
- what one client may hold (:class:`HttpLimits`): a request head must arrive within ``header_timeout``
  (408, closed: slowloris) and be at most ``max_header_bytes`` (431); past ``max_connections`` open
  connections a new one gets 503 and is closed. Each refusal is reported by reason (:data:`REFUSALS`).
  A connection idle for ``idle_timeout`` (no request in it, none being answered) is closed;
- every request is framed by the parser, however the client wrote it (at once, head and body apart,
  byte by byte): a lookup's fast path (:mod:`kvcoord.coordinator.fastpath`) sits in its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from time import monotonic as _monotonic
from typing import cast

import httptools

log = logging.getLogger("kvcoord.http")

__all__ = ["JSON", "REFUSALS", "HeadWatch", "HttpLimits", "HttpServer", "Request", "Response", "Route",
           "json_error", "render"]

_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
    413: "Payload Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Entity",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable",
}
_LINGER_SECONDS = 2.0
"""How long a refused request's connection still takes (and drops) the client's bytes before it closes."""
JSON = "application/json"
REFUSALS = ("header_timeout", "header_too_large", "max_connections")
"""Why a listener refused a client (the label of its ``..._http_refused_total`` counter)."""


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may hold of an HTTP listener, so a few slow or greedy ones cannot starve the rest."""

    header_timeout: float = 10.0
    """Seconds from a connection's start, or a request's first byte, to the end of the request's head."""
    max_header_bytes: int = 64 * 1024
    """The request line and headers, in bytes."""
    max_connections: int = 1024
    """Open connections at once; one more is answered 503 and closed."""
    idle_timeout: float = 75.0
    """Seconds a kept-alive connection may wait for its next request (nginx's default): idle ones cannot
    hold the connections ``max_connections`` allows."""

    def too_large(self) -> str:
        return f"request head larger than {self.max_header_bytes} bytes"

    def timed_out(self) -> str:
        return f"request head not received within {self.header_timeout:g} s"

    def too_many(self) -> str:
        return f"too many connections (max_connections {self.max_connections})"


class HeadWatch:
    """One connection's request heads against :class:`HttpLimits`: their size and their clock. For this
    module's server and ``kvcoord route``'s aiohttp listener, each feeding it its parser's events. Sizes
    are counted as received too: httptools holds a header line whole before its callback, so the
    callbacks alone would let one endless line grow without bound."""

    __slots__ = ("_loop", "_on_timeout", "_since", "_timer", "in_head", "limits", "parsed", "received")

    def __init__(self, limits: HttpLimits, on_timeout: Callable[[], None]) -> None:
        self.limits = limits
        self._on_timeout = on_timeout
        self._timer: asyncio.TimerHandle | None = None
        """Armed while a head may be read; it outlives the heads that end in time (a timer per request
        costs more than the rest of a small lookup's framing) and, when it fires, looks at :attr:`_since`."""
        self._since: float | None = None
        """When the head being read began (``time.monotonic``, a C call: the loop's ``time()`` is a Python
        one, and only differences count), or None between heads."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_head = True
        """The next bytes belong to a request's head (between requests too)."""
        self.received = 0
        self.parsed = 0

    def over(self, data: bytes) -> bool:
        """Whether ``data``, just received, takes the head being read past the limit: its blank line is
        not within it. (Still in the head: its blank line was not in the bytes before.)"""
        if not self.in_head:
            return False
        limit = self.limits.max_header_bytes
        before = self.received
        self.received = before + len(data)
        if self.received <= limit:
            return False
        if before <= limit and data.startswith((b"\n", b"\r\n", b"\n\r\n")):
            return False  # the blank line began in the bytes before
        return data.find(b"\r\n\r\n", 0, max(0, limit - before)) < 0

    def grew(self, n: int) -> bool:
        """The parser read ``n`` more bytes of URL or headers: whether the head is now past the limit."""
        self.parsed += n
        return self.parsed > self.limits.max_header_bytes

    def begin(self) -> None:
        """A connection's start or a request's first byte: the head's clock runs (if not already)."""
        self.parsed = 0
        if self._since is None:
            self._since = _monotonic()
            if self._timer is None:
                loop = self._loop
                if loop is None:
                    loop = self._loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self.limits.header_timeout, self._fire)

    def headers_done(self) -> None:
        self.in_head = False
        self._since = None

    def message_done(self) -> None:
        """The request is read: the next bytes start a head (its clock starts with them)."""
        self.in_head = True
        self.received = 0

    def stop(self) -> None:
        self._since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        if self._since is None:  # no head being read: the next one arms it again
            return
        left = self._since + self.limits.header_timeout - _monotonic()
        if left > 0:  # a later head than the one it was armed for
            self._timer = asyncio.get_running_loop().call_later(left, self._fire)
            return
        self._since = None
        self._on_timeout()


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    """Lower-cased names; a repeated header keeps its last value."""
    body: bytes
    peer: str = ""


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], "Response | Awaitable[Response]"]
_BODY_LIMIT = 2 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Route:
    """One path: its handler per method, and the largest body it reads."""

    methods: dict[str, Handler]
    body_limit: int = _BODY_LIMIT
    """Bytes (:data:`_BODY_LIMIT` by default; an unknown path has that too)."""

    @property
    def allow(self) -> str:
        names = set(self.methods)
        if "GET" in names:
            names.add("HEAD")
        return ",".join(sorted(names))


_DATES: dict[int, bytes] = {}


def _date() -> bytes:
    """The ``Date`` header's value, formatted once per second."""
    now = int(time.time())
    value = _DATES.get(now)
    if value is None:
        _DATES.clear()
        value = _DATES[now] = formatdate(now, usegmt=True).encode()
    return value


_HEADER_NAMES: dict[bytes, str] = {}  # as received -> lower-cased: clients send the same few names
_URLS: dict[bytes, tuple[str, str]] = {}  # request targets as received -> (path, query)
_METHODS: dict[bytes, str] = {}  # the parser's method names (a fixed set)
_MAX_CACHED = 256
"""Entries at most in :data:`_HEADER_NAMES` and :data:`_URLS` (emptied when full): a client sending ever
new names or targets costs only the decoding it saves the others."""


def _header_name(raw: bytes) -> str:
    name = raw.decode("latin-1").lower()
    if len(_HEADER_NAMES) >= _MAX_CACHED:
        _HEADER_NAMES.clear()
    _HEADER_NAMES[raw] = name
    return name


def _target(url: bytes) -> tuple[str, str]:
    """A request target's path and query (``httptools.parse_url``; an invalid one raises its error)."""
    parsed = httptools.parse_url(url)
    got = parsed.path.decode("latin-1", "replace"), (parsed.query or b"").decode("latin-1", "replace")
    if len(_URLS) >= _MAX_CACHED:
        _URLS.clear()
    _URLS[url] = got
    return got


class _Connection(asyncio.Protocol):
    """One client connection: parse, dispatch in order, write."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._method = self._path = self._query = ""
        """The request's, once its head is read."""
        self._head = HeadWatch(server.limits, self._head_timed_out)
        self._active = 0.0
        """When bytes last came in or an answer went out (``time.monotonic``): one timer per idle period
        checks it, instead of a timer per request."""
        self._idle: asyncio.TimerHandle | None = None
        self._body: list[bytes] = []
        self._body_len = 0
        self._limit = 0
        self._rejected: Response | None = None
        self._routed: Handler | Response = Response(404)
        """The request's handler, or its refusal (404/405), once its head is read."""
        self._queue: deque[tuple[Request | None, Handler | Response, bool]] = deque()
        """Requests read, not yet answered, each with its handler or its answer."""
        self._busy = False
        self._closing = False
        self._linger: asyncio.TimerHandle | None = None
        self._unread = False
        self._between = True
        """No request partly read: the next bytes start one."""

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        limits = self.server.limits
        if len(self.server.connections) >= limits.max_connections:
            self.server.refused("max_connections")
            self._fail(json_error(503, limits.too_many()))
            return
        self.server.connections.add(self)
        self._head.begin()
        self._active = _monotonic()
        self._idle = loop.call_later(limits.idle_timeout, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self._linger is not None:
            self._linger.cancel()
        self._head.stop()
        if self._idle is not None:
            self._idle.cancel()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._active = _monotonic()
        if self._head.over(data):
            self.server.refused("header_too_large")
            self._fail(json_error(431, self.server.limits.too_large()))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(json_error(501, "protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            if self._rejected is not None:  # refused before it was read: an oversized head or body
                self._fail(self._rejected)
            else:
                self._fail(json_error(400, f"malformed HTTP request: {exc}"))

    # --- the head's limits -----------------------------------------------------------------
    def _idle_check(self) -> None:
        """Close the connection if nothing came in or went out for ``idle_timeout`` while no request was
        read or answered (a head has its own clock); else look again when it could be."""
        self._idle = None
        if self._closing or self.transport is None:
            return
        idle = self.server.limits.idle_timeout
        left = idle - (_monotonic() - self._active)
        if left <= 0 and self._between and not self._busy and not self._queue:
            self._close(linger=False)
            return
        self._idle = asyncio.get_running_loop().call_later(left if left > 0 else idle, self._idle_check)

    def _head_timed_out(self) -> None:
        if self._closing or self.transport is None:
            return
        self.server.refused("header_timeout")
        self._fail(json_error(408, self.server.limits.timed_out()))

    # --- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._between = False
        self._head.begin()
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_len = 0
        self._rejected = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if self._head.grew(len(url)):
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head.grew(len(name) + len(value)):
            self._head_too_large()
        self._headers[_HEADER_NAMES.get(name) or _header_name(name)] = value.decode("latin-1")

    def _head_too_large(self) -> None:
        self.server.refused("header_too_large")
        self._rejected = json_error(431, self.server.limits.too_large())
        raise httptools.HttpParserError("request head too large")

    def on_headers_complete(self) -> None:
        self._head.headers_done()
        url = self._url
        self._path, self._query = _URLS.get(url) or _target(url)
        raw = self.parser.get_method()
        method = _METHODS.get(raw)
        if method is None:
            method = _METHODS[raw] = raw.decode("latin-1")
        self._method = method
        # Routing comes before the body (as in axum): an unknown path or method is refused with 404/405,
        # never 413, and without reading a body the client has not sent yet.
        self._limit, self._routed = routed = self.server.route(method, self._path)
        refused = routed[1] if isinstance(routed[1], Response) else None
        headers = self._headers
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._limit:
            self._rejected = refused or _limit_exceeded()
            raise httptools.HttpParserError("body over the route's limit")
        expect = headers.get("expect")
        if expect is not None and expect.lower() == "100-continue":
            if refused is not None:
                self._rejected = refused
                raise httptools.HttpParserError("refused before the body")
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limit:
            routed = self._routed
            self._rejected = routed if isinstance(routed, Response) else _limit_exceeded()
            raise httptools.HttpParserError("body over the route's limit")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._between = True
        self._head.message_done()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(self._method, self._path, self._query, self._headers, body, self.peer)
        keep = self.parser.should_keep_alive()
        if self._busy or self._queue:
            self._queue.append((req, self._routed, keep))
            if not self._busy:
                self._drain()
        elif self.transport is not None:  # nothing before it: answered without the queue
            self._answer(req, self._routed, keep)

    # --- dispatch --------------------------------------------------------------------------
    def _drain(self) -> None:
        """Answer queued requests in order; an awaitable answer holds the queue until it is done."""
        while self._queue and self.transport is not None:
            if not self._answer(*self._queue.popleft()):
                return

    def _answer(self, req: Request | None, routed: Handler | Response, keep: bool) -> bool:
        """Answer one request (``req`` None: a failed one, ``routed`` its answer); False when the
        answers after it must wait: its handler's awaitable runs, or the connection closes."""
        assert self.transport is not None
        if isinstance(routed, Response):
            resp = routed  # an answer already: a refusal, a failed request's, an awaited handler's
        else:
            assert req is not None
            try:
                result = self.server.dispatch(req, routed)
            except Exception:
                log.exception("HTTP %s %s failed", req.method, req.path)
                result = json_error(500, "internal error")
            if not isinstance(result, Response):
                self._busy = True
                self.transport.pause_reading()
                task = asyncio.ensure_future(result)
                self.server.tasks.add(task)
                task.add_done_callback(functools.partial(self._finished, req=req, keep=keep))
                return False
            resp = result
        self._write(resp, keep, head=req is not None and req.method == "HEAD")
        if not keep:
            self._close()
            return False
        return True

    def _finished(self, task: asyncio.Future[Response], *, req: Request, keep: bool) -> None:
        self.server.tasks.discard(task)
        self._busy = False
        if self.transport is None:
            return
        if task.cancelled():
            resp = json_error(503, "server shutting down")
            keep = False
        elif task.exception() is not None:
            log.error("HTTP %s %s failed", req.method, req.path, exc_info=task.exception())
            resp = json_error(500, "internal error")
        else:
            resp = task.result()
        self._queue.appendleft((req, resp, keep))  # req: a HEAD answer goes without its body
        self.transport.resume_reading()
        self._drain()

    def _write(self, resp: Response, keep: bool, *, head: bool = False) -> None:
        assert self.transport is not None
        self._active = _monotonic()
        self.transport.write(render(resp, keep, self.server.extra_headers, head=head))

    def _fail(self, resp: Response) -> None:
        """A request that cannot be parsed or read: answer it (after those before it) and close."""
        self._closing = True
        self._unread = True
        self._queue.append((None, resp, False))
        if not self._busy:
            self._drain()

    def _close(self, *, linger: bool = True) -> None:
        """Close; after a refused request, lingering: the client may still be sending the body, and
        closing with unread bytes resets the connection, which can destroy the answer before the client
        reads it. So half-close (FIN after the answer), drop what still arrives, close in a moment."""
        self._closing = True
        transport = self.transport
        if transport is None:
            return
        if linger and self._unread and self._linger is None and transport.can_write_eof():
            transport.write_eof()
            self._linger = asyncio.get_running_loop().call_later(_LINGER_SECONDS, transport.close)
        else:
            transport.close()


def render(resp: Response, keep: bool, extra_headers: bytes = b"", *, head: bool = False) -> bytes:
    """An answer's bytes: status line, ``extra_headers`` (whole lines), date, length, type, its own
    headers; without the body when ``head`` (a HEAD request)."""
    status, body = resp.status, resp.body
    if keep and not resp.headers:
        if status == 200 and not head and resp.content_type == JSON:
            return _OK_JSON % (extra_headers, _date(), len(body), body)  # a lookup's answer
        if resp.content_type is None and status in _STATUS_LINES:  # e.g. /health's
            return _BARE % (_STATUS_LINES[status], extra_headers, _date(), len(body), b"" if head else body)
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}".encode(),
             extra_headers + b"date: " + _date(), b"content-length: " + str(len(body)).encode()]
    if resp.content_type is not None:
        lines.append(b"content-type: " + resp.content_type.encode())
    for name, value in resp.headers:
        lines.append(f"{name}: {value}".encode("latin-1"))
    if not keep:
        lines.append(b"connection: close")
    lines.append(b"\r\n")
    head_bytes = b"\r\n".join(lines)
    return head_bytes if head or not body else head_bytes + body


_OK_JSON = b"HTTP/1.1 200 OK\r\n%bdate: %b\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n%b"
"""What :func:`render` composes of a kept-alive 200 JSON answer without headers of its own."""
_BARE = b"%b\r\n%bdate: %b\r\ncontent-length: %d\r\n\r\n%b"
"""... and of a kept-alive answer without a content type or headers of its own."""
_STATUS_LINES = {status: f"HTTP/1.1 {status} {reason}".encode() for status, reason in _REASONS.items()}


def json_error(status: int, message: str) -> Response:
    """The one error shape of the HTTP API: ``{"error": "<one line>"}``."""
    return Response(status, json.dumps({"error": message}, separators=(",", ":")).encode(), JSON)


def _limit_exceeded() -> Response:
    return json_error(413, "Failed to buffer the request body: length limit exceeded")


class HttpServer:
    """Serves ``routes`` on one listener; ``authorize`` (optional) screens every request first."""

    def __init__(self, routes: dict[str, Route],
                 authorize: Callable[[Request], Response | None] | None = None,
                 headers: Sequence[tuple[str, str]] = (),
                 limits: HttpLimits | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.routes = routes
        self.limits = limits or HttpLimits()
        self._on_refused = on_refused
        """Told each refusal's reason (:data:`REFUSALS`), for a metric."""
        self.authorize = authorize
        self.extra_headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        """Sent with every answer (e.g. which replica answered)."""
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Future[Response]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    def refused(self, reason: str) -> None:
        log.debug("HTTP: refused a client (%s)", reason)
        if self._on_refused is not None:
            self._on_refused(reason)

    def route(self, method: str, path: str) -> tuple[int, Handler | Response]:
        """Where a request goes, known from its head: the path's body limit, and the method's handler or
        the refusal (404, empty, for an unknown path; 405 with ``Allow`` for another method)."""
        route = self.routes.get(path)
        if route is None:
            return _BODY_LIMIT, Response(404)
        handler = route.methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            return route.body_limit, Response(405, headers=[("allow", route.allow)])
        return route.body_limit, handler

    def dispatch(self, req: Request,
                 routed: Handler | Response | None = None) -> Response | Awaitable[Response]:
        """``req``'s answer: its refusal, the authorizer's, or its handler's (``routed``: :meth:`route`'s,
        when the connection has it already)."""
        if routed is None:
            routed = self.route(req.method, req.path)[1]
        if isinstance(routed, Response):
            return routed
        if self.authorize is not None:
            refused = self.authorize(req)
            if refused is not None:
                return refused
        return routed(req)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                    reuse_port: bool = False) -> int:
        """Listen (with ``reuse_port``: beside other processes on the same port, ``SO_REUSEPORT``)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                                ssl=ssl_context, reuse_address=True, backlog=1024,
                                                reuse_port=reuse_port or None)
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])
        return self.port

    async def stop(self, grace: float = 0.5) -> None:
        """Stop accepting, give running handlers ``grace`` seconds, then close every connection."""
        if self._server is None:
            return
        self._server.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace)
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            conn._close(linger=False)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
        self._server = None
