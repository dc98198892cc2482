"""What sharing one view costs per request: ``kvcoord route`` reserving its picks against the same router
with ``--no-reserve``, through one ``kvcoord serve``, one agent and two sim-engines (real processes).

Both routers run side by side; requests alternate between them in blocks, so drift cancels. Per mode:
end-to-end latency through the router (p50, p99), route's lookup time (its histogram's mean), and the CPU
seconds per request of the coordinator and of the router (``/proc/PID/stat``, over that mode's blocks).
Each request has a new prompt of ``--prompt-blocks`` 16-token blocks under a shared system prompt, so
every reservation carries blocks and every lookup walks them. Then ``--bursts`` rounds per mode of 8
concurrent requests sharing a new prefix, split across two routers of that mode (or all sent to one
router): on how many nodes the new prefix was computed.

``--replicas``: two ``kvcoord serve`` replicas on one ``redis-server`` (the Redis index), each router of a
pair on its own replica, so a burst split across the pair is split across the replicas too (their holds
claimed in Redis, their reservations shared by its stream).

    .venv/bin/python benchmarks/bench_reserve.py [--requests 2000] [--prompt-blocks 64] [--replicas]

``--stream-only N``: the stream alone, no router: one ``ReserveStream`` in this process (uvloop) against a
``kvcoord serve``, N cycles of a reservation (``--prompt-blocks`` blocks), its first byte 1 ms later and
its completion, 4 ms apart (two stream messages a cycle), against the same cycles without reservations;
CPU per cycle of this process and of the coordinator, three rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    MODEL,
    bench_parser,
    cpu_seconds,
    pct,
    route_cmd,
    start_agent,
    start_engine,
    start_serve,
    wait_url,
)
from kvcoord.gateway.reserve import ReserveStream
from kvcoord.router.client import AsyncCoordinatorClient
from tests.procs import free_port, running, wait_for_port
from tests.redis_servers import redis_server


def _cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its threads so far."""
    return sum(cpu_seconds(pid))


@contextlib.contextmanager
def _fleet(tmp: Path, token_interval: float,
           replicas: bool) -> Iterator[tuple[int, dict[str, list[tuple[str, int]]]]]:
    """(the first serve's pid, {mode: [(route URL, route pid)] * 2}); with ``replicas`` two serves on one
    Redis, the i-th router of each pair on the i-th."""
    with contextlib.ExitStack() as stack:
        engines = [start_engine(stack, tmp / f"engine{i}.log", "--token-interval", str(token_interval))
                   for i in range(2)]
        for engine, _ in engines:
            wait_url(engine)
        index = stack.enter_context(redis_server()).url if replicas else ""
        serves = [start_serve(stack, tmp / f"serve{i}.log", engines[0][0], quiet=True, index=index)
                  for i in range(2 if replicas else 1)]
        for i, (engine, pub) in enumerate(engines):
            start_agent(stack, tmp / f"agent{i}.log", serves[0][0], f"node{i}", engine, pub)
        routes: dict[str, list[tuple[str, int]]] = {}
        for mode, flags in (("reserve", ()), ("no-reserve", ("--no-reserve",))):
            for i in range(2):
                port = free_port()
                proc = stack.enter_context(running(route_cmd(
                    port, "--coordinator", serves[i % len(serves)][0], "--deadline-ms", "1000", *flags),
                    log=tmp / f"{mode}{i}.log"))
                wait_for_port(port, timeout=30)
                routes.setdefault(mode, []).append((f"http://127.0.0.1:{port}", proc.pid))
        yield serves[0][1], routes


async def _lookup_mean(s: aiohttp.ClientSession, base: str) -> float:
    async with s.get(f"{base}/metrics") as resp:
        text = await resp.text()
    vals = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvcoord_route_lookup_seconds_")}
    count = vals.get("kvcoord_route_lookup_seconds_count", 0.0)
    return vals.get("kvcoord_route_lookup_seconds_sum", 0.0) / max(count, 1.0)


async def _bursts(s: aiohttp.ClientSession, routes: dict[str, list[tuple[str, int]]], rounds: int) -> None:
    """Per round and mode: 8 concurrent requests sharing a new system prompt, split across that mode's
    two routers; how many nodes computed the new prefix."""
    groups = {"one router": routes["reserve"][:1], **routes}
    spread: dict[str, list[int]] = {m: [] for m in groups}
    for r in range(rounds):
        for mode, pair in groups.items():
            system = f"Round {r} of {mode}: a new system prompt. " * 30
            bodies = [{"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"question {j} " * 20}]}
                for j in range(8)]

            async def one(base: str, body: dict[str, object]) -> str:
                async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers["x-kvcoord-node"]

            nodes = await asyncio.gather(*(one(pair[j % len(pair)][0], b) for j, b in enumerate(bodies)))
            spread[mode].append(len(set(nodes)))
    print(f"bursts: {rounds} rounds of 8 concurrent requests sharing a new prefix, split across 2 routers "
          "(or all to one)")
    for mode, xs in spread.items():
        print(f"  {mode:<11} one node in {sum(x == 1 for x in xs)}/{len(xs)} rounds, "
              f"{sum(xs) / len(xs):.2f} nodes per new prefix")


async def _run(n: int, blocks: int, block_run: int, rounds: int, token_interval: float,
               replicas: bool) -> None:
    with (tempfile.TemporaryDirectory() as tmpdir,
          _fleet(Path(tmpdir), token_interval, replicas) as (serve_pid, fleet)):
        routes = {m: pair[0] for m, pair in fleet.items()}
        system = "You are a helpful assistant. " * 40
        lat: dict[str, list[float]] = {m: [] for m in routes}
        cpu = {m: [0.0, 0.0] for m in routes}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            for mode, (base, _) in routes.items():  # warm up: tokenizer, connections, the stream
                for i in range(50):
                    body = {"model": MODEL, "max_tokens": 1, "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"warm {mode} {i}"}]}
                    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
            i = 0
            while i < 2 * n:
                mode = "reserve" if (i // block_run) % 2 == 0 else "no-reserve"
                base, pid = routes[mode]
                c0, r0 = _cpu(serve_pid), _cpu(pid)
                for _ in range(block_run):
                    words = " ".join(f"w{i}x{j}" for j in range(blocks * 8))
                    body = {"model": MODEL, "max_tokens": 1, "messages": [
                        {"role": "system", "content": system}, {"role": "user", "content": words}]}
                    t0 = time.perf_counter()
                    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                    lat[mode].append(time.perf_counter() - t0)
                    i += 1
                cpu[mode][0] += _cpu(serve_pid) - c0
                cpu[mode][1] += _cpu(pid) - r0
            means = {m: await _lookup_mean(s, base) for m, (base, _) in routes.items()}
            if rounds:
                await _bursts(s, fleet, rounds)
        print(f"kvcoord route, reserving vs --no-reserve: {n} requests each, new prompts of ~{blocks} "
              f"blocks, alternating in blocks of {block_run}")
        for mode in routes:
            xs, (cs, cr) = lat[mode], cpu[mode]
            print(f"  {mode:<11} request p50 {pct(xs, 0.5) * 1e3:6.2f} ms p99 "
                  f"{pct(xs, 0.99) * 1e3:6.2f} ms | lookup mean {means[mode] * 1e3:5.2f} ms | "
                  "CPU per request: coordinator "
                  f"{cs / len(xs) * 1e6:6.0f} us, route {cr / len(xs) * 1e6:6.0f} us")


async def _cycles(stream: ReserveStream, n: int, blocks: int, on: bool) -> None:
    for _ in range(n):
        rid = stream.next_id() if on else ""
        if rid:
            stream.reserve(rid, MODEL, ("node0", 0), 0, [random.getrandbits(64) for _ in range(blocks)], 1000)
        await asyncio.sleep(0.001)
        if rid:
            stream.release(rid, first_byte=True)
            stream.release(rid, first_byte=False)
        await asyncio.sleep(0.004)


async def _stream_only(addr: str, serve_pid: int, n: int, blocks: int) -> None:
    client = AsyncCoordinatorClient(addr)
    stream = ReserveStream(client, logging.getLogger("bench_reserve"))
    task = asyncio.create_task(stream.run())
    while not stream.up:
        await asyncio.sleep(0.05)
    await _cycles(stream, 200, blocks, True)  # warm-up
    print(f"the Reserve stream alone: {n} cycles (reserve ~{blocks} blocks, first byte, completion) vs "
          "the same cycles without, CPU per cycle")
    for _ in range(3):
        got = {}
        for on in (True, False):
            c0, s0 = time.process_time(), _cpu(serve_pid)
            await _cycles(stream, n, blocks, on)
            await asyncio.sleep(0.05)
            got[on] = ((time.process_time() - c0) / n, (_cpu(serve_pid) - s0) / n)
        (r1, c1), (r0, c0_) = got[True], got[False]
        print(f"  router {r1 * 1e6:5.0f} - {r0 * 1e6:3.0f} = {(r1 - r0) * 1e6:4.0f} us | coordinator "
              f"{c1 * 1e6:5.0f} - {c0_ * 1e6:3.0f} = {(c1 - c0_) * 1e6:4.0f} us")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.close()


def main() -> None:
    ap = bench_parser(__doc__, requests=2000, requests_help="measured requests per mode", token_interval=0.0)
    ap.add_argument("--prompt-blocks", type=int, default=64, help="approximate new blocks per prompt")
    ap.add_argument("--block-run", type=int, default=100, help="requests per mode before switching")
    ap.add_argument("--bursts", type=int, default=50, help="burst rounds per mode (0: none)")
    ap.add_argument("--replicas", action="store_true",
                    help="two serve replicas on one redis-server, each router of a pair on its own")
    ap.add_argument("--stream-only", type=int, default=0, metavar="N",
                    help="measure N cycles on the Reserve stream alone (no router), then stop")
    args = ap.parse_args()
    if args.stream_only:
        with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
            addr, pid = start_serve(stack, Path(d) / "serve.log", "http://127.0.0.1:9", quiet=True)
            uvloop.run(_stream_only(addr, pid, args.stream_only, args.prompt_blocks))
        return
    asyncio.run(_run(args.requests, args.prompt_blocks, args.block_run, args.bursts, args.token_interval,
                     args.replicas))


if __name__ == "__main__":
    main()
