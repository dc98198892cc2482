"""What the event loop alone costs an HTTP request: server CPU per request of an asyncio protocol that
answers fixed bytes to every read (no parsing, no routing), next to the coordinator's HTTP server
(``kvcoord.coordinator.httpd``) answering ``GET /health`` the same way, on asyncio's loop and on uvloop.

Why: ``bench_vs_dynamo_service.py`` compares whole services; this says how much of a small request's
server CPU is the loop and the socket calls (the floor no handler code can go below) and how much is
kvcoord's framing. A client process sends ``--requests`` sequential requests on one keep-alive
connection; the server's CPU (``time.process_time``) over them, per request, is reported.

    python benchmarks/bench_loop_floor.py [--requests 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

from kvcoord.coordinator.httpd import HttpServer, Request, Response, Route

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
ANSWER = b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 04:00:00 GMT\r\ncontent-length: 0\r\n\r\n"


class _Fixed(asyncio.Protocol):
    """The floor: every read answered with the same bytes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)  # type: ignore[attr-defined]


def _client(port: int, requests: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(requests):
        sock.sendall(REQUEST)
        got = b""
        while not got.endswith(b"\r\n\r\n"):
            got += sock.recv(65536)
    sock.close()


async def _serve(server: str, requests: int) -> float:
    """Server CPU per request (µs) of ``server`` (``fixed`` or ``kvcoord``) in this process."""
    loop = asyncio.get_running_loop()
    if server == "fixed":
        listener = await loop.create_server(_Fixed, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
    else:
        def health(req: Request) -> Response:
            return Response(200)
        http = HttpServer({"/health": Route({"GET": health})})
        port = await http.start("127.0.0.1", 0)
    cpu = time.process_time()
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--client", str(port),
                                                 "--requests", str(requests))
    await child.wait()
    return (time.process_time() - cpu) / requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=5000, help="sequential requests per run (default 5000)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each server and loop (default 3)")
    ap.add_argument("--client", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--server", default="", help=argparse.SUPPRESS)
    ap.add_argument("--uvloop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        _client(args.client, args.requests)
        return
    if args.server:  # one measurement, in a fresh process (the loop policy is per process)
        if args.uvloop:
            import uvloop
            uvloop.install()
        print(f"{asyncio.run(_serve(args.server, args.requests)):.1f}")
        return
    for _ in range(args.rounds):  # interleaved: the machine may be shared
        for server in ("fixed", "kvcoord"):
            for loop in ("asyncio", "uvloop"):
                cmd = [sys.executable, __file__, "--server", server, "--requests", str(args.requests)]
                out = subprocess.run(cmd + (["--uvloop"] if loop == "uvloop" else []), check=True,
                                     capture_output=True, text=True).stdout.strip()
                print(f"{server:8} {loop:8} {out:>7} us server CPU per request", flush=True)


if __name__ == "__main__":
    main()
