"""Replay a Mooncake trace through ``kvcoord route`` against sim-engines and compare the achieved prefix-cache
hit rate with ``kvcoord simulate`` on the same requests, nodes and capacity (issue 14).

Per policy a fresh fleet: N ``kvcoord sim-engine`` (HTTP only, a real BlockPool of ``--blocks-per-node``
blocks each, vLLM-exact KV events on ZMQ), one ``kvcoord agent`` per engine announcing its serving URL,
``kvcoord serve`` with the engines' hash profile, and ``kvcoord route --policy P``. The first K trace
requests are sent to route as token-id prompts to ``/v1/completions`` at their (time-scaled) trace
arrival times, ``max_tokens`` = the trace's output length; achieved hits are the engines'
``usage.prompt_tokens_details.cached_tokens``. ``kvcoord simulate`` runs the same K requests with
``--json`` under the same seed, with its decode time set to the engines' token interval; route's policy
is given the simulator's cost model (``--prefill-us-per-token``, ``--decode-ms-per-token``,
``--max-running`` and the workload's mean output length), so both weigh load against cached prefix alike.

Prompt tokens are those of :func:`kvcoord.sim.workload.load_mooncake` (each trace hash id expands into
512 deterministic tokens), taken modulo the sim-engine's vocabulary (the workload draws ids below 2**17,
the sim-engine's toy tokenizer accepts ids below 32000). That keeps which prompts share which prefixes,
so it cannot change a hit rate; the block hashes differ from the simulator's, which only compares them
with each other.

    .venv/bin/python benchmarks/replay_route.py --requests 400 --nodes 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL, route_cmd, start_agent, start_engines, start_serve
from kvcoord.hashing import HashProfile
from kvcoord.sim.workload import load_mooncake
from kvcoord.tokenize import toktok
from tests.procs import TRACES, free_port, kvcoord_cmd, running, wait_for_port

PROFILE = HashProfile("xxhash_cbor", 16, seed="0")
"""The engines' hash profile (the simulator's too)."""


@dataclass
class Replayed:
    """What the engines answered for one policy's replay."""

    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    errors: int = 0
    prefix_aware: int = 0
    seconds: float = 0.0
    nodes: dict[str, int] | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@contextlib.contextmanager
def _fleet(tmp: Path, args: argparse.Namespace, policy: str) -> Iterator[str]:
    """Engines, agents, serve and route for one policy; yields route's base URL once it knows every node."""
    with contextlib.ExitStack() as stack:
        rport = free_port()
        engines = start_engines(stack, tmp, policy, args.nodes, args.blocks_per_node,
                                "--token-interval", str(args.token_interval),
                                "--max-num-seqs", str(args.max_running), profile=PROFILE)
        coordinator, _ = start_serve(stack, tmp / f"{policy}-serve.log", profile=PROFILE)
        for node, (url, pub) in engines.items():
            start_agent(stack, tmp / f"{policy}-agent-{node}.log", coordinator, node, url, pub, replay=True)
        route = route_cmd(rport, "--coordinator", coordinator, "--policy", policy, "--deadline-ms", "2000",
                          "--refresh-interval", "0.5", "--seed", str(args.seed),
                          # the simulator's cost model, so both policies weigh load alike
                          "--prefill-us-per-token", str(args.prefill_us_per_token),
                          "--decode-ms-per-token", str(args.token_interval * 1e3),
                          "--max-running", str(args.max_running),
                          "--mean-output-tokens", str(args.mean_output_tokens))
        stack.enter_context(running(route, log=tmp / f"{policy}-route.log"))
        wait_for_port(rport, timeout=60)
        base = f"http://127.0.0.1:{rport}"
        asyncio.run(until_backends(base, args.nodes))
        yield base


async def until_backends(base: str, n: int, timeout: float = 60.0) -> None:
    """Poll route's /health until it knows ``n`` serving URLs (every agent said Hello)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                async with s.get(f"{base}/health") as r:
                    if len((await r.json()).get("backends", {})) >= n:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"route at {base} did not learn {n} backends in {timeout}s")


async def _replay(base: str, policy: str, reqs: list[tuple[float, list[int], int]], limit: int) -> Replayed:
    """Send every request at its arrival time (at most ``limit`` in flight) and add up the answers."""
    out = Replayed(policy, nodes={})
    sem = asyncio.Semaphore(limit)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=limit)) as s:
        start = time.monotonic()

        async def one(at: float, prompt: list[int], max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
            async with sem:
                try:
                    async with s.post(f"{base}/v1/completions", json=body) as r:
                        data: Any = await r.json(content_type=None)
                        headers = r.headers
                        status = r.status
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    out.errors += 1
                    return
            if status != 200:
                out.errors += 1
                print(f"  {policy}: HTTP {status}: {str(data)[:200]}", file=sys.stderr)
                return
            usage = data["usage"]
            out.prompt_tokens += usage["prompt_tokens"]
            out.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            out.predicted_tokens += int(headers.get("x-kvcoord-predicted-cached-tokens", 0))
            out.prefix_aware += headers.get("x-kvcoord-prefix-aware") == "true"
            node = headers.get("x-kvcoord-node", "?")
            assert out.nodes is not None
            out.nodes[node] = out.nodes.get(node, 0) + 1

        await asyncio.gather(*(one(*r) for r in reqs))
        out.seconds = time.monotonic() - start
    return out


def _simulate(args: argparse.Namespace, policies: list[str], tmp: Path) -> dict[str, float]:
    """``kvcoord simulate`` on the same first K requests, nodes, capacity and seed: policy -> hit rate."""
    path = tmp / "simulate.json"
    cmd = kvcoord_cmd("simulate", "--trace", str(args.trace), "--limit", str(args.requests),
                      "--nodes", str(args.nodes), "--blocks-per-node", str(args.blocks_per_node),
                      "--time-scale", str(args.time_scale), "--max-running", str(args.max_running),
                      "--decode-ms-per-token", str(args.token_interval * 1e3),
                      "--prefill-us-per-token", str(args.prefill_us_per_token),
                      "--policies", ",".join(policies), "--seed", str(args.seed), "--json", str(path))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    data = json.loads(path.read_text())
    return {p["policy"]: float(p["token_hit_rate"]) for p in data["policies"]}


def trace_requests(trace: Path, limit: int, time_scale: float) -> list[tuple[float, list[int], int]]:
    """(arrival s, token ids, max_tokens) of the first ``limit`` trace requests, arrivals time-scaled."""
    wl = load_mooncake(trace, PROFILE, limit=limit, time_scale=time_scale)
    t0 = wl.requests[0].arrival
    return [(r.arrival - t0, [t % toktok.VOCAB for t in r.tokens], max(1, r.output_tokens))
            for r in wl.requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACES / "mooncake_conversation.jsonl")
    ap.add_argument("--requests", type=int, default=400, help="first K trace requests")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--blocks-per-node", type=int, default=25_000)
    ap.add_argument("--time-scale", type=float, default=0.5, help="multiply trace inter-arrival times")
    ap.add_argument("--token-interval", type=float, default=0.015,
                    help="engines' seconds per output token = the simulator's decode time")
    ap.add_argument("--prefill-us-per-token", type=float, default=1.0,
                    help="simulator's prefill cost (the sim-engine prefills instantly; must be > 0)")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=128, help="requests in flight at most")
    ap.add_argument("--policies", default="prefix-aware,round-robin")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    reqs = trace_requests(args.trace, args.requests, args.time_scale)
    args.mean_output_tokens = sum(r[2] for r in reqs) / len(reqs)  # as simulate takes it off the workload
    print(f"{len(reqs)} requests over {reqs[-1][0]:.0f} s, {sum(len(r[1]) for r in reqs):,} prompt tokens; "
          f"{args.nodes} nodes x {args.blocks_per_node} blocks of {PROFILE.block_size}; load average "
          f"{os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sim = _simulate(args, policies, tmp)
        rows = []
        for policy in policies:
            with _fleet(tmp, args, policy) as base:
                rows.append(asyncio.run(_replay(base, policy, reqs, args.concurrency)))
    print("| policy | route hit | simulate hit | route / simulate | route - simulate | predicted | "
          "errors | wall s | load avg |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = sim[r.policy]
        pred = r.predicted_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        ratio = f"{r.hit_rate / s:.3f}" if s else "-"
        print(f"| {r.policy} | {r.hit_rate:.2%} | {s:.2%} | {ratio} | {(r.hit_rate - s) * 100:+.2f} pt | "
              f"{pred:.2%} | {r.errors} | {r.seconds:.0f} | {os.getloadavg()[0]:.2f} |")
        print(f"  {r.policy}: requests per node {dict(sorted((r.nodes or {}).items()))}, "
              f"{r.prefix_aware} prefix-aware placements", file=sys.stderr)
    if len(rows) >= 2 and rows[1].hit_rate:
        a, b = rows[0], rows[1]
        print(f"{a.policy} / {b.policy}: route {a.hit_rate / b.hit_rate:.2f}x, simulate "
              f"{sim[a.policy] / sim[b.policy]:.2f}x")


if __name__ == "__main__":
    main()
