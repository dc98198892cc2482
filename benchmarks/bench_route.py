"""``kvcoord route``'s own overhead above calling the engine directly, p50 and p99, lookup excluded.

Setup (all real processes on this machine): one ``kvcoord sim-engine --http-listen`` (no token delay, one
output token) and ``kvcoord route --policy round-robin --backend node=URL``: a policy that needs no index
asks no lookup, so everything else route does per request is in the figure (read and parse the body,
place, forward over a pooled connection, relay the answer, headers, metrics). The baseline is the same
request sent straight to the engine, in the same run, alternating request by request so drift cancels.

Rows: a non-streaming chat; a streaming chat (time to the last byte, and to the first token); and, with
``--lookup``, prefix-aware routing through a real ``kvcoord serve`` plus agent, whose lookup time (route's
own ``kvcoord_route_lookup_seconds``) is reported next to, not inside, the overhead.

    .venv/bin/python benchmarks/bench_route.py [--requests 2000] [--lookup] [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    MODEL,
    bench_parser,
    pct,
    route_cmd,
    start_agent,
    start_engine,
    start_serve,
    wait_url,
)
from tests.procs import free_port, running, wait_for_port

SYSTEM = "You are a helpful assistant who answers every question in a few short words " * 8


async def _one(s: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> tuple[float, float]:
    """(seconds to the last byte, seconds to the first content chunk)."""
    t0 = time.perf_counter()
    first = 0.0
    async with s.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        if stream:
            async for _ in resp.content.iter_any():
                if not first:
                    first = time.perf_counter() - t0
        else:
            await resp.read()
    total = time.perf_counter() - t0
    return total, first or total


async def _compare(direct: str, routed: str, n: int, *, stream: bool,
                   usage: bool = False) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "route": [], "direct_first": [], "route_first": []}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for i in range(n + n // 10):
            body = {"model": MODEL, "max_tokens": 1, "stream": stream,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"question {i}"}]}
            if usage:
                body["stream_options"] = {"include_usage": True}
            pair = (("direct", direct), ("route", routed))
            order = pair if i % 2 else pair[::-1]
            for name, base in order:
                total, first = await _one(s, f"{base}/v1/chat/completions", body, stream)
                if i >= n // 10:  # warm-up excluded
                    out[name].append(total)
                    out[f"{name}_first"].append(first)
    return out


def _report(label: str, r: dict[str, list[float]], key: str = "") -> None:
    d, t = r[f"direct{key}"], r[f"route{key}"]
    d50, t50, d99, t99 = (pct(d, 0.5), pct(t, 0.5), pct(d, 0.99), pct(t, 0.99))
    print(f"{label:<34} direct p50 {d50 * 1e3:7.3f} ms p99 {d99 * 1e3:7.3f} ms | via route p50 "
          f"{t50 * 1e3:7.3f} ms p99 {t99 * 1e3:7.3f} ms | overhead p50 {(t50 - d50) * 1e3:+.3f} ms "
          f"(paired median {statistics.median(b - a for a, b in zip(d, t, strict=True)) * 1e3:+.3f}) "
          f"p99 {(t99 - d99) * 1e3:+.3f} ms | ratio p50 {t50 / d50:.2f}x")


@contextlib.contextmanager
def engine_stack(tmp: Path, coordinator: bool, http_port: int = 0) -> Iterator[tuple[str, str]]:
    """A sim-engine (no token delay) and, with ``coordinator``, a ``kvcoord serve`` tokenizing through its
    ``/tokenize`` (its HTTP API on ``http_port``, none for 0) and an agent relaying its KV events:
    (engine URL, coordinator address, "" without)."""
    with contextlib.ExitStack() as stack:
        engine, pub = start_engine(stack, tmp / "engine.log", "--token-interval", "0")
        wait_url(engine)
        if not coordinator:
            yield engine, ""
            return
        address, _ = start_serve(stack, tmp / "serve.log", engine, http_port=http_port)
        start_agent(stack, tmp / "agent.log", address, "node", engine, pub)
        yield engine, address


@contextlib.contextmanager
def _fleet(tmp: Path, lookup: bool) -> Iterator[tuple[str, str, str]]:
    """(engine, route, second route): with ``lookup`` the second route tokenizes itself (``--tokenizer``)."""
    rport, rport2 = free_port(), free_port()
    with engine_stack(tmp, lookup) as (engine, coordinator), contextlib.ExitStack() as stack:
        if lookup:
            route = ["--coordinator", coordinator, "--deadline-ms", "1000"]
            stack.enter_context(running(route_cmd(rport2, *route, "--tokenizer", engine),
                                        log=tmp / "route2.log"))
            wait_for_port(rport2, timeout=30)
        else:
            route = ["--policy", "round-robin", "--backend", f"node={engine}"]
        stack.enter_context(running(route_cmd(rport, *route), log=tmp / "route.log"))
        wait_for_port(rport, timeout=30)
        yield engine, f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{rport2}"


async def _lookup_mean(routed: str) -> tuple[float, float, int, float]:
    """Mean lookup seconds from route's histogram, prefix-aware placements, lookups, and the mean of
    route's own time before forwarding with the lookup taken out (``kvcoord_route_overhead_seconds``)."""
    async with aiohttp.ClientSession() as s, s.get(f"{routed}/metrics") as resp:
        text = await resp.text()
    vals = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvcoord_route_")}
    n = vals.get("kvcoord_route_lookup_seconds_count", 0.0)
    pa = vals.get('kvcoord_route_placements_total{node="node",prefix_aware="true"}', 0.0)
    pre = vals.get("kvcoord_route_overhead_seconds_sum", 0.0) / max(vals.get(
        "kvcoord_route_overhead_seconds_count", 0.0), 1)
    return vals.get("kvcoord_route_lookup_seconds_sum", 0.0) / max(n, 1), pa, int(n), pre


def main() -> None:
    ap = bench_parser(__doc__, requests=2000, requests_help="measured requests per path and row")
    ap.add_argument("--lookup", action="store_true", help="also route prefix-aware through serve + agent")
    ap.add_argument("--quick", action="store_true", help="200 requests (a smoke run)")
    args = ap.parse_args()
    n = 200 if args.quick else args.requests
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with _fleet(tmp, lookup=False) as (engine, routed, _):
            print(f"kvcoord route overhead, lookup excluded (--policy round-robin, static backend), {n} "
                  "requests per path, alternating")
            r = asyncio.run(_compare(engine, routed, n, stream=False))
            _report("chat, non-streaming", r)
            r = asyncio.run(_compare(engine, routed, n, stream=True))
            _report("chat, streaming (last byte)", r)
            _report("chat, streaming (first chunk)", r, "_first")
            r = asyncio.run(_compare(engine, routed, n, stream=True, usage=True))
            _report("chat, streaming, client asks usage", r)
        if args.lookup:
            with _fleet(tmp, lookup=True) as (engine, routed, routed_tok):
                for label, base, how in (
                        ("prefix-aware, serve tokenizes", routed, "the coordinator tokenizes through the "
                         "engine's /tokenize"),
                        ("prefix-aware, --tokenizer URL", routed_tok, "route tokenizes through the engine's "
                         "/tokenize, then looks up by ids")):
                    r = asyncio.run(_compare(engine, base, n, stream=False))
                    mean, pa, lookups, pre = asyncio.run(_lookup_mean(base))
                    _report(label, r)
                    print(f"  {lookups} lookups, mean {mean * 1e3:.3f} ms ({how}); {pa:.0f} prefix-aware "
                          f"placements; route's time before forwarding, lookup excluded: mean "
                          f"{pre * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
