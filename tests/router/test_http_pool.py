"""The small HTTP/1.1 client (:mod:`kvcoord.router.http_pool`) against raw servers on real sockets: what
``kvcoord route`` relies on when it forwards to engines on it (kept-alive reuse and a stale connection's
retry, bodies framed every way, an answer cut short, a paused pipe)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvcoord.router.http_pool import HttpPool, HttpPools

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Start = Callable[[Answer], Awaitable[int]]


async def _head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


@pytest.fixture
async def server() -> AsyncIterator[Start]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> int:
        srv = await asyncio.start_server(answer, "127.0.0.1", 0)
        servers.append(srv)
        return int(srv.sockets[0].getsockname()[1])

    yield start
    for srv in servers:
        srv.close()


async def test_kept_alive_connections_are_reused_and_a_stale_one_is_retried(server: Start) -> None:
    """Each connection answers one request and drops the next unanswered (a server whose idle timeout
    raced it): that call, dead before any byte, goes again on a new connection."""
    connections = dropped = 0

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, dropped
        connections += 1
        head = await _head(reader)
        assert head.startswith(b"POST /base/v1/x HTTP/1.1\r\n") and b"\r\nx-hop: 1\r\n" in head
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
        await _head(reader)
        dropped += 1
        writer.close()

    port = await server(once)
    pools = HttpPools(connect_timeout=2.0)
    try:
        async with asyncio.timeout(10):
            for _ in range(3):
                conn = await pools.request(f"http://127.0.0.1:{port}/base/", "/v1/x", b"{}", {"x-hop": "1"})
                assert (conn.status, conn.headers) == (200, {"content-type": "text/plain"})
                assert await conn.read() == b"ok"
                conn.release()
        assert (connections, dropped) == (3, 2)
    finally:
        pools.close()


async def test_bodies_chunked_or_ended_by_the_close_are_read_whole(server: Start) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _head(reader)
        if b" /chunked " in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            writer.close()

    port = await server(answer)
    for path, body in (("/chunked", b"abcde"), ("/close", b"until the end")):
        pool = HttpPool("127.0.0.1", port)
        async with asyncio.timeout(10):
            assert await pool.post(path, b"") == (200, body, {})
        pool.close()


async def test_an_answer_cut_short_fails_and_a_paused_pipe_reads_on_after_drain(server: Start) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(4):
            writer.write(b"2\r\n%02d\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.close()  # no last chunk: the answer is incomplete

    pool = HttpPool("127.0.0.1", await server(answer))
    conn = await pool.request("POST", "/", b"")
    got: list[bytes] = []
    drains = 0

    async def drain() -> None:
        nonlocal drains
        drains += 1
        await asyncio.sleep(0.05)

    with pytest.raises(ConnectionError):
        async with asyncio.timeout(10):
            await conn.pipe(lambda piece: got.append(piece) or True, drain)  # type: ignore[func-returns-value]
    conn.release()
    assert b"".join(got) == b"00010203" and drains >= 1 and conn.closed
    pool.close()


async def test_pools_of_engines_not_asked_lately_are_closed(server: Start) -> None:
    """Past ``max_pools`` URLs the least recently asked pool goes and its kept connection is closed; the
    others' stay open and are reused."""
    opened: dict[int, int] = {}
    ended: dict[int, int] = {}

    def keep_alive(port_of: list[int]) -> Answer:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            port = port_of[0]
            opened[port] = opened.get(port, 0) + 1
            try:
                while True:
                    await _head(reader)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            except (asyncio.IncompleteReadError, ConnectionError):
                ended[port] = ended.get(port, 0) + 1
        return answer

    ports: list[int] = []
    for _ in range(3):
        cell: list[int] = []
        cell.append(await server(keep_alive(cell)))
        ports.append(cell[0])
    pools = HttpPools(connect_timeout=2.0, max_pools=2)

    async def ask(port: int) -> None:
        conn = await pools.request(f"http://127.0.0.1:{port}", "/x", b"", {})
        assert await conn.read() == b"ok"
        conn.release()

    try:
        async with asyncio.timeout(10):
            await ask(ports[0])
            await ask(ports[1])
            await ask(ports[0])  # ports[0] is now the most recently asked
            await ask(ports[2])  # ports[1]'s pool goes, its connection closed
            while ended.get(ports[1]) != 1:
                await asyncio.sleep(0.01)
            await ask(ports[0])
            await ask(ports[2])
            assert opened == {ports[0]: 1, ports[1]: 1, ports[2]: 1}  # the kept ones were reused
            assert ports[0] not in ended and ports[2] not in ended
    finally:
        pools.close()


async def test_a_server_silent_past_the_read_timeout_fails_the_answer(server: Start) -> None:
    """A server that stops mid-answer (or never answers) fails the call with TimeoutError and its connection
    is closed; a pipe paused for its slow client longer than the timeout is not counted against the server
    (asyncio runs a read that is due before a timer that is due, so the resumed read comes first)."""
    stop = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _head(reader)
        if b" /silent " in head:
            await stop.wait()  # never a byte
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        if b" /stalls " in head:
            await stop.wait()  # stops mid-answer
            return
        writer.write(b"1\r\nc\r\n" * 6 + b"0\r\n\r\n")  # the rest at once: only the client is slow

    pool = HttpPool("127.0.0.1", await server(answer), read_timeout=0.2)
    try:
        async with asyncio.timeout(30):
            with pytest.raises(TimeoutError, match=r"no answer bytes for 0\.2 s"):
                await pool.request("POST", "/silent", b"")
            conn = await pool.request("POST", "/stalls", b"")
            with pytest.raises(TimeoutError):
                await conn.pipe(lambda piece: False, asyncio.sleep)
            conn.release()
            assert conn.closed
            conn = await pool.request("POST", "/flows", b"")
            got: list[bytes] = []

            async def slow_client() -> None:
                await asyncio.sleep(0.5)  # longer than the timeout: the client's pause, not the server's

            await conn.pipe(lambda piece: got.append(piece) or True, slow_client)  # type: ignore[func-returns-value]
            conn.release()
            assert b"".join(got) == b"abcccccc"
    finally:
        stop.set()
        pool.close()
