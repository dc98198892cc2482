"""What sharing one view costs per request: ``kvcoord route`` reserving its picks against the same router
with ``--no-reserve``, through one ``kvcoord serve``, one agent and two sim-engines (real processes).

Both routers run side by side; requests alternate between them in blocks, so drift cancels. Per mode:
end-to-end latency through the router (p50, p99), route's lookup time (its histogram's mean), and the CPU
seconds per request of the coordinator and of the router (``/proc/PID/stat``, over that mode's blocks).
Each request has a new prompt of ``--prompt-blocks`` 16-token blocks under a shared system prompt, so
every reservation carries blocks and every lookup walks them. Then ``--bursts`` rounds per mode of 8
concurrent requests sharing a new prefix, split across two routers of that mode (or all sent to one
router): on how many nodes the new prefix was computed.

    .venv/bin/python benchmarks/bench_reserve.py [--requests 2000] [--prompt-blocks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "sim-model"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@contextlib.contextmanager
def _fleet(tmp: Path, token_interval: float) -> Iterator[tuple[int, dict[str, list[tuple[str, int]]]]]:
    """(serve pid, {mode: [(route URL, route pid)] * 2})."""
    gport = free_port()
    with contextlib.ExitStack() as stack:
        engines = []
        for i in range(2):
            http, pub = free_port(), free_port()
            engine = f"http://127.0.0.1:{http}"
            stack.enter_context(running(kvcoord_cmd(
                "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--model", MODEL, "--algo",
                "sha256_cbor", "--hash-seed", "0", "--block-size", "16", "--http-listen", f"127.0.0.1:{http}",
                "--rate", "0", "--requests", "0", "--token-interval", str(token_interval),
                "--num-blocks", "65536"),
                log=tmp / f"engine{i}.log"))
            engines.append((engine, pub))
        for engine, _ in engines:
            wait_for_port(int(engine.rsplit(":", 1)[1]), timeout=30)
        serve = stack.enter_context(running(kvcoord_cmd(
            "--log-level", "WARNING", "serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "",
            "--model", f"{MODEL},algo=sha256_cbor,block_size=16,seed=0,tokenizer={engines[0][0]}"),
            env={"KVCOORD_HTTP_LISTEN": ""}, log=tmp / "serve.log"))
        wait_for_port(gport, timeout=30)
        for i, (engine, pub) in enumerate(engines):
            stack.enter_context(running(kvcoord_cmd(
                "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", f"node{i}", "--model", MODEL,
                "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--serving-url", engine),
                log=tmp / f"agent{i}.log"))
        routes: dict[str, list[tuple[str, int]]] = {}
        for mode, flags in (("reserve", ()), ("no-reserve", ("--no-reserve",))):
            for i in range(2):
                port = free_port()
                proc = stack.enter_context(running(kvcoord_cmd(
                    "--log-level", "WARNING", "route", "--listen", f"127.0.0.1:{port}", "--model", MODEL,
                    "--coordinator", f"127.0.0.1:{gport}", "--deadline-ms", "1000", *flags),
                    log=tmp / f"{mode}{i}.log"))
                wait_for_port(port, timeout=30)
                routes.setdefault(mode, []).append((f"http://127.0.0.1:{port}", proc.pid))
        yield serve.pid, routes


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


async def _run(n: int, blocks: int, block_run: int, rounds: int, token_interval: float) -> None:
    with tempfile.TemporaryDirectory() as tmpdir, _fleet(Path(tmpdir), token_interval) as (serve_pid, fleet):
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
            print(f"  {mode:<11} request p50 {_pct(xs, 0.5) * 1e3:6.2f} ms p99 "
                  f"{_pct(xs, 0.99) * 1e3:6.2f} ms | lookup mean {means[mode] * 1e3:5.2f} ms | "
                  "CPU per request: coordinator "
                  f"{cs / len(xs) * 1e6:6.0f} us, route {cr / len(xs) * 1e6:6.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per mode")
    ap.add_argument("--prompt-blocks", type=int, default=64, help="approximate new blocks per prompt")
    ap.add_argument("--block-run", type=int, default=100, help="requests per mode before switching")
    ap.add_argument("--bursts", type=int, default=50, help="burst rounds per mode (0: none)")
    ap.add_argument("--token-interval", type=float, default=0.0, help="the sim-engines' seconds per token")
    args = ap.parse_args()
    asyncio.run(_run(args.requests, args.prompt_blocks, args.block_run, args.bursts, args.token_interval))


if __name__ == "__main__":
    main()
