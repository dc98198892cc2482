"""What one paced message costs on an agent-to-coordinator hop: a grpc.aio client stream against a plain
asyncio TCP stream (length-prefixed), both sides, CPU per message; and what receiving an engine's ZMQ PUB
stream costs at the least: a thread blocked in ``recv`` against kvcoord's :class:`FrameReader` in an event
loop (the relay's receive path).

An engine publishes one batch per scheduler step, so an agent sends one small message every 10-50 ms and
both ends wake for each. Two processes per row (sender, receiver), one stream, ``--size``-byte messages at
``--rate`` a second; CPU is the scheduler's runtime of every thread of each process
(``/proc/<pid>/task/*/schedstat``) over ``--messages`` messages. The ``none`` row paces the sender's loop
without sending: its timer wakeups, the baseline to subtract from the sender's figure. The ``zmq-*`` rows
publish on a PUB socket; their receiver figure is a SUB socket's, ZeroMQ's I/O thread included.

Command: ``.venv/bin/python benchmarks/bench_stream_hop.py [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import zmq

from kvcoord.engine.zmq_wire import FrameReader

KINDS = ("tcp", "grpc", "none", "zmq-block", "zmq-reader")


def cpu_seconds(pid: int) -> float:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e9


def receive_blocking(port: int) -> None:
    """A SUB socket read by a thread blocked in ``recv``: the least a Python process can pay a message."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    while True:
        sub.recv_multipart()


async def receive(kind: str, port: int) -> None:
    if kind == "zmq-reader":
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")
        reader = FrameReader(sub, lambda frames: True)
        reader.resume()
        print("ready", flush=True)
        await asyncio.Event().wait()
        return
    if kind == "grpc":
        async def handler(it: object, ctx: object) -> bytes:
            async for _ in it:  # type: ignore[attr-defined]
                pass
            return b""

        srv = grpc.aio.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "hop.Hop", {"Send": grpc.stream_unary_rpc_method_handler(handler)}),))
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        print("ready", flush=True)
        await srv.wait_for_termination()
        return

    async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with_data = True
        while with_data:
            try:
                (n,) = struct.unpack("<I", await r.readexactly(4))
                await r.readexactly(n)
            except asyncio.IncompleteReadError:
                with_data = False
        w.close()

    server = await asyncio.start_server(conn, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()


async def send(kind: str, port: int, args: argparse.Namespace) -> None:
    msg = os.urandom(args.size)
    loop = asyncio.get_running_loop()
    if kind.startswith("zmq"):
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        seq = 0

        async def write() -> None:
            nonlocal seq
            seq += 1
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msg])
    elif kind == "grpc":
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = channel.stream_unary("/hop.Hop/Send")()

        async def write() -> None:
            await call.write(msg)
    else:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        frame = struct.pack("<I", len(msg)) + msg

        async def write() -> None:
            if kind == "tcp":
                writer.write(frame)
    for _ in range(20):  # warm-up, unmeasured
        await write()
        await asyncio.sleep(1 / args.rate)
    print("go", flush=True)
    sys.stdin.readline()
    due = loop.time()
    for _ in range(args.messages):
        due += 1 / args.rate
        await write()
        await asyncio.sleep(max(0.0, due - loop.time()))
    print("end", flush=True)
    sys.stdin.readline()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_row(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    """(sender, receiver) µs of CPU per message."""
    port = free_port()
    wire = "tcp" if kind == "none" else kind
    base = [sys.executable, __file__, "--rate", str(args.rate), "--size", str(args.size),
            "--messages", str(args.messages)]
    rx = subprocess.Popen([*base, "--receive", wire, str(port)], stdout=subprocess.PIPE, text=True)
    tx = None
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        tx = subprocess.Popen([*base, "--send", kind, str(port)], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
        assert tx.stdout is not None and tx.stdin is not None
        assert tx.stdout.readline().strip() == "go"
        t0, r0 = cpu_seconds(tx.pid), cpu_seconds(rx.pid)
        tx.stdin.write("\n")
        tx.stdin.flush()
        assert tx.stdout.readline().strip() == "end"
        t1, r1 = cpu_seconds(tx.pid), cpu_seconds(rx.pid)
        tx.stdin.write("\n")
        tx.stdin.flush()
        tx.wait(30)
        return 1e6 * (t1 - t0) / args.messages, 1e6 * (r1 - r0) / args.messages
    finally:
        for p in (tx, rx):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=50.0, help="messages a second (default 50)")
    ap.add_argument("--size", type=int, default=1000, help="bytes a message (default 1000)")
    ap.add_argument("--messages", type=int, default=300, help="measured messages a row (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="rows of each kind, interleaved (default 3)")
    ap.add_argument("--send", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--receive", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receive and args.receive[0] == "zmq-block":
        receive_blocking(int(args.receive[1]))
    elif args.receive:
        asyncio.run(receive(args.receive[0], int(args.receive[1])))
        return 0
    if args.send:
        asyncio.run(send(args.send[0], int(args.send[1]), args))
        return 0
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            rows[kind].append(one_row(kind, args))
            tx_us, rx_us = rows[kind][-1]
            print(f"{kind:5s} sender {tx_us:7.1f} µs/msg  receiver {rx_us:7.1f} µs/msg", file=sys.stderr)
    print(f"\n{args.size}-byte messages at {args.rate:g}/s, {args.messages} a row, medians of {args.rounds}:")
    print("| stream | sender µs/msg | receiver µs/msg |\n|---|---:|---:|")
    for kind in KINDS:
        print(f"| {kind} | {statistics.median(r[0] for r in rows[kind]):.0f} | "
              f"{statistics.median(r[1] for r in rows[kind]):.0f} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
