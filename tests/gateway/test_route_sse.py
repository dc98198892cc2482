"""Route's SSE pass-through (:func:`~kvcoord.gateway.route_sse.relay_events` feeding the upstream
connection's reads, :class:`~kvcoord.router.http_pool.HttpPool`'s, straight into HTTP chunks written by
:class:`~kvcoord.gateway.route_sse.ChunkedOut`) over real sockets: an upstream aiohttp server streaming
events in uneven pieces, a relay server in between (its upstream connections kept alive), and clients
speaking HTTP/1.1 (chunked), HTTP/1.0 (no chunked encoding: the body ends with the connection), reading
slowly, or leaving mid-stream (which ends the upstream request)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from kvcoord.gateway.route_sse import ChunkedOut, SseRelay, relay_events
from kvcoord.router.http_pool import HttpPool

EVENTS = [b'data: {"choices":[{"text":"t%d"}],"usage":null}\n\n' % i for i in range(200)]
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":200}}\n\n'
DONE = b"data: [DONE]\n\n"
WHOLE = b"".join(EVENTS) + USAGE + DONE
"""What the engine sends; the client gets it without the usage-only event (stripped)."""
EXPECTED = b"".join(EVENTS) + DONE


@dataclass
class Relay:
    url: str
    outcomes: list[str] = field(default_factory=list)
    usage: list[object] = field(default_factory=list)
    firsts: list[bool] = field(default_factory=list)
    upstream_closed: list[bool] = field(default_factory=list)


async def _upstream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    big = request.query.get("big") == "1"
    step = 37  # pieces that cut events anywhere
    data = b"".join(EVENTS * 200) + USAGE + DONE if big else WHOLE
    for i in range(0, len(data), step if not big else 65536):
        await resp.write(data[i:i + (step if not big else 65536)])
        if not big and i % (step * 8) == 0:
            await asyncio.sleep(0)
    await resp.write_eof()
    return resp


async def _serve(path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> tuple[web.AppRunner, int]:
    """A real server on a free port: (its runner, the port)."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    up_runner, up_port = await _serve("/stream", _upstream)
    pool = HttpPool("127.0.0.1", up_port, wanted=frozenset({"content-type"}))
    state = Relay("")

    async def handler(request: web.Request) -> web.StreamResponse:
        query = "?big=1" if request.query.get("big") == "1" else ""
        upstream = await pool.request("GET", f"/stream{query}", b"")
        try:
            assert upstream.status == 200 and upstream.headers["content-type"] == "text/event-stream"
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            out = ChunkedOut(request, resp)
            await resp.prepare(request)
            sse = SseRelay(strip_usage=True)
            try:
                await relay_events(upstream, out, sse, lambda: state.firsts.append(True))
            except ConnectionResetError:
                state.outcomes.append("client_gone")
                state.upstream_closed.append(upstream.closed)
                return resp
            state.outcomes.append("ok")
            state.usage.append(sse.usage)
            await resp.write_eof(out.held)
            return resp
        finally:
            upstream.release()

    runner, port = await _serve("/relay", handler)
    state.url = f"http://127.0.0.1:{port}/relay"
    try:
        yield state
    finally:
        await runner.cleanup()
        pool.close()
        await up_runner.cleanup()


async def _raw(url: str, version: str) -> bytes:
    host, port = url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /relay HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read(-1)  # to the connection's end
    writer.close()
    return data


def _dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol], 16)
        if size == 0:
            assert body[eol:] == b"\r\n\r\n", body[eol:]
            return b"".join(out)
        out.append(body[eol + 2:eol + 2 + size])
        assert body[eol + 2 + size:eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


async def test_http11_gets_the_events_chunked_with_usage_stripped(relay: Relay) -> None:
    async with aiohttp.ClientSession() as s, s.get(relay.url) as resp:
        assert resp.headers["Transfer-Encoding"] == "chunked"
        assert await resp.read() == EXPECTED
    raw = await _raw(relay.url, "1.1")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower()
    assert _dechunk(body) == EXPECTED
    assert relay.outcomes == ["ok", "ok"] and relay.firsts == [True, True]
    assert relay.usage[0] == {"prompt_tokens": 9, "completion_tokens": 200}


async def test_http10_gets_the_events_unframed(relay: Relay) -> None:
    raw = await _raw(relay.url, "1.0")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    assert body == EXPECTED
    assert relay.outcomes == ["ok"]


async def test_a_slow_reader_gets_every_byte(relay: Relay) -> None:
    """~11 MB read in small bites with pauses: the relay waits for the client (flow control) and
    nothing is lost or reordered."""
    expected = b"".join(EVENTS * 200) + DONE
    got = bytearray()
    async with aiohttp.ClientSession() as s, s.get(relay.url, params={"big": "1"}) as resp:
        while piece := await resp.content.read(1 << 18):
            got += piece
            if len(got) < 2 << 20:
                await asyncio.sleep(0.01)
    assert bytes(got) == expected
    assert relay.outcomes == ["ok"]


async def test_a_client_leaving_mid_stream_ends_the_relay(relay: Relay) -> None:
    host, port = relay.url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /relay?big=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await reader.read(4096)  # the stream has started
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # a reset, as from a client killed mid-stream
    for _ in range(600):  # a poll, not a timing assertion
        if relay.outcomes:
            break
        await asyncio.sleep(0.05)
    assert relay.outcomes == ["client_gone"]
    assert relay.upstream_closed == [True]  # the engine sees the request end
