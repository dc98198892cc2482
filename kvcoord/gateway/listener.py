"""``kvcoord route``'s listener limits (:class:`~kvcoord.coordinator.httpd.HttpLimits`) around aiohttp.

aiohttp bounds one header line and field (``max_line_size``, ``max_field_size``, set here to the whole
head's limit) and the number of headers, but not a whole head (and answers 400, not 431), has no clock
for a head that arrives a byte at a time, and takes any number of connections. So each connection's
aiohttp protocol is wrapped: a second parser (httptools, as the coordinator's server uses) follows the
request framing, and :class:`~kvcoord.coordinator.httpd.HeadWatch` refuses a slow head (408) or a large
one (431); past ``max_connections`` a new connection gets 503. Each refusal is closed and counted in
``kvcoord_route_http_refused_total{reason}``. A request it cannot parse is answered 400 in one line
(aiohttp's own answer spans lines, pointing at the bad byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import cast

import httptools
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from kvcoord.coordinator.httpd import REFUSALS, HeadWatch, HttpLimits

__all__ = ["GuardedSite"]

log = logging.getLogger("kvcoord.route")

_STATUS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


def _refusal(status: int, message: str) -> bytes:
    """A whole answer in OpenAI's error shape (as route's own), closing the connection."""
    body = json.dumps({"error": {"message": f"kvcoord route: {message}", "type": "BadRequestError",
                                 "param": None, "code": status}}, separators=(",", ":")).encode()
    return (f"HTTP/1.1 {status} {_STATUS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol (``inner``) behind the limits."""

    def __init__(self, inner: asyncio.Protocol, site: GuardedSite) -> None:
        self.inner = inner
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.head = HeadWatch(site.limits, self._timed_out)
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.connected = False
        self.done = False

    # --- asyncio.Protocol, passed on to aiohttp's ------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if len(self.site.open) >= self.site.limits.max_connections:
            self._refuse(503, "max_connections", self.site.limits.too_many())
            return
        self.site.open.add(self)
        self.connected = True
        self.inner.connection_made(transport)
        self.head.begin()

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        if self.parser is not None:
            if self.head.over(data):
                self._refuse(431, "header_too_large", self.site.limits.too_large())
                return
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self.parser = None  # aiohttp answers it; no head is followed after
                self.head.stop()
            except httptools.HttpParserError as exc:
                if not self.done:  # (else a head past the limit, refused from a callback)
                    self._refuse(400, "", f"malformed HTTP request: {' '.join(str(exc).split())}")
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.open.discard(self)
        self.head.stop()
        if self.connected:
            self.connected = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.head.begin()

    def on_url(self, url: bytes) -> None:
        self._grew(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grew(len(name) + len(value))

    def on_headers_complete(self) -> None:
        self.head.headers_done()

    def on_message_complete(self) -> None:
        self.head.message_done()

    # --- refusals ----------------------------------------------------------------------------
    def _grew(self, n: int) -> None:
        if self.head.grew(n):
            self._refuse(431, "header_too_large", self.site.limits.too_large())
            raise httptools.HttpParserError("request head too large")

    def _timed_out(self) -> None:
        if not self.done:
            self._refuse(408, "header_timeout", self.site.limits.timed_out())

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer (a refusal counted by ``reason``, or a malformed request with none), half-close and
        drop what still arrives; closed for good shortly after (closing with unread bytes would reset
        the connection, and could destroy the answer before it is read)."""
        self.done = True
        self.head.stop()
        if reason:
            self.site.refused.labels(reason).inc()
            log.debug("route: refused a client (%s)", reason)
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(_refusal(status, message))
        if transport.can_write_eof():
            transport.write_eof()
            asyncio.get_running_loop().call_later(2.0, transport.close)
        else:
            transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose every connection is held to ``limits``; refusals counted on ``registry``."""

    def __init__(self, runner: web.AppRunner, host: str | None, port: int, limits: HttpLimits,
                 registry: CollectorRegistry) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self.limits = limits
        self.open: set[_Guarded] = set()
        self.refused = Counter("kvcoord_route_http_refused", "Clients refused by the listener: a head too "
                               "slow or too large, or past max_connections.", ["reason"], registry=registry)
        for reason in REFUSALS:
            self.refused.labels(reason)

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory = cast(Callable[[], asyncio.Protocol], server)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Guarded(factory(), self), self._host, self._port,
                                                reuse_address=True, backlog=1024)

    async def stop(self) -> None:
        for conn in list(self.open):
            with contextlib.suppress(Exception):
                conn.head.stop()
        await super().stop()
