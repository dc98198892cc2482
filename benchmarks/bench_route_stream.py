"""``kvcoord route``'s CPU per request for long streamed answers: the SSE pass-through, chunk by chunk.

Setup (real processes on this machine): one ``kvcoord sim-engine --http-listen`` pacing its tokens
(``--token-interval``, one SSE chunk each, so every chunk reaches route on its own read, as from a real
engine) and ``kvcoord route --policy round-robin --backend ...`` (no lookup: the proxying alone). The
client keeps ``--concurrency`` streamed ``/v1/completions`` in flight, ``--tokens`` chunks each (370: the
Mooncake replay's mean in ``bench_routers.py``), and reads route's CPU (user + system, ``/proc``) per
request over each of ``--reps`` batches of ``--requests``, after a warm-up.

    .venv/bin/python benchmarks/bench_route_stream.py [--requests 200] [--tokens 370] [--concurrency 16]
        [--token-interval 0.005] [--reps 3]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL, bench_parser, cpu_seconds, route_cmd, start_engine, wait_url
from tests.procs import free_port, running, wait_for_port


async def _traffic(url: str, n: int, tokens: int, concurrency: int) -> int:
    """Sends ``n`` streamed completions, ``concurrency`` at once; returns the client's reads."""
    sem, reads = asyncio.Semaphore(concurrency), 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            nonlocal reads
            body = {"model": MODEL, "prompt": f"request {i} says hello " * 20, "max_tokens": tokens,
                    "stream": True, "ignore_eos": True}
            async with sem, s.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for _ in resp.content.iter_any():
                    reads += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return reads


def main() -> None:
    ap = bench_parser(__doc__, requests=200, requests_help="requests per measured batch",
                      token_interval=0.005)
    ap.add_argument("--tokens", type=int, default=370, help="SSE chunks per answer")
    ap.add_argument("--concurrency", type=int, default=16, help="streams in flight")
    ap.add_argument("--reps", type=int, default=3, help="measured batches")
    args = ap.parse_args()
    rport = free_port()
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        engine, _ = start_engine(stack, tmp / "engine.log", "--token-interval", str(args.token_interval),
                                 "--max-num-seqs", "256")
        wait_url(engine)
        route = stack.enter_context(running(route_cmd(rport, "--policy", "round-robin", "--backend",
                                                      f"node={engine}"), log=tmp / "route.log"))
        wait_for_port(rport, timeout=30)
        url = f"http://127.0.0.1:{rport}"
        asyncio.run(_traffic(url, 20, args.tokens, args.concurrency))  # warm-up
        print(f"kvcoord route (round-robin) CPU per request, {args.tokens} SSE chunks an answer, "
              f"{args.concurrency} streams at once, {args.requests} requests a batch")
        for _ in range(args.reps):
            load = os.getloadavg()[0]
            (u0, s0), t0 = cpu_seconds(route.pid), time.monotonic()
            reads = asyncio.run(_traffic(url, args.requests, args.tokens, args.concurrency))
            (u1, s1), n = cpu_seconds(route.pid), args.requests
            print(f"  {((u1 - u0) + (s1 - s0)) / n * 1e3:6.2f} ms (user {(u1 - u0) / n * 1e3:.2f}, system "
                  f"{(s1 - s0) / n * 1e3:.2f}); client reads per request {reads / n:.0f}; "
                  f"{time.monotonic() - t0:.1f} s; load average {load:.2f}", flush=True)


if __name__ == "__main__":
    main()
