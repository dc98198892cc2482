"""``kvcoord route`` against SGLang's Rust routers on the same engines and the same replayed trace (issue 27).

Per router and replica count a fresh fleet, all real processes over real HTTP: N ``kvcoord sim-engine``s
(``--http-listen``, vLLM's KV events on ZMQ, a BlockPool of ``--blocks-per-node`` blocks so the caches are
under pressure, and the compute clock of ``kvcoord/sim/timing.py``: a prefill cost per uncached prompt
token, serial per engine, and a decode step shared by the batch, so TTFT depends on placement and
queueing). In front of them, R router replicas, request i going to replica i mod R:

- ``kvcoord``: R ``kvcoord route``s (prefix-aware, sharing their picks as reservations in the one
  ``kvcoord serve``, which relays the engines registered over its ``/register`` and tokenizes text
  prompts); route is given the engines' cost model. ``--tokenizer sim`` (default) has serve tokenize
  in-process with the engines' own toy tokenizer (``tokenizer=sim:toktok``; checked against an engine's
  ``/tokenize`` on a trace prompt first, the run stops if the ids differ); ``--tokenizer engine`` has it
  call engine 0's ``/tokenize`` per lookup, as a deployment without a local tokenizer does; ``--tokenizer
  route`` has each route tokenize itself (``--tokenizer sim:toktok``) and look up by token ids; several
  (``sim,engine``) run each kvcoord configuration once per tokenizer, one after the other;
- ``sglang-router``: R ``sglang-router launch --policy cache_aware`` (0.3.2, Rust, a per-router
  approximate radix tree over the prompt text);
- ``smg``: R ``smg launch --policy cache_aware`` (SGLang's gateway 1.13.0, Rust, the same idea);
- ``round-robin``: R ``kvcoord route --policy round-robin`` with static backends (no lookup).

The Rust routers are benchmark-only: ``pip install sglang-router==0.3.2 smg==1.13.0`` (a router not
installed is skipped, said so on stderr).

Traffic: the first K requests of the Mooncake conversation trace at their time-scaled arrivals, streamed
``/v1/completions`` with ``max_tokens`` = the trace's output length. The prompt is text, the same for
every router: each trace token (512 per trace hash id, :func:`kvcoord.sim.workload.load_mooncake`)
becomes one word, which the engines' toy tokenizer (``kvcoord/tokenize/toktok.py``) turns into one token, so
which prompts share which prefixes is the trace's. Text is what the Rust routers' trees take.

Figures per run: the cached share of prompt tokens (the engines' own ``vllm:prefix_cache_hits`` over
``vllm:prompt_tokens``, so no router reports its own hits), TTFT p50/p90/p99 (client-side, to the first
SSE chunk), per-engine balance (each engine's share of the prompt tokens; max / mean), and CPU per
request of the router processes (``/proc``, every process in each router's process group, over the
replay), with the coordinator's own CPU (ingest, tokenization round trips, lookups, reservations) apart.
For kvcoord, route's own metrics follow on stderr: its mean lookup time (and the part of it serve's handler
took, from serve's ``/metrics``), placements on a node holding less than the best one, placements without
the index, and the best node's, the chosen node's predicted and the achieved cached tokens (where a hit
went missing: the index or the policy). The issue's targets are checked at the end against the runs made.

    .venv/bin/python benchmarks/bench_routers.py [--requests 600] [--replicas 1,2,4] [--quick]
        [--tokenizer sim|engine|sim,engine] [--lookup grpc|http] [--lookup-workers N] [--work-weight K]
        [--cache-threshold SHARE]

``--lookup http`` has route ask serve's HTTP API (``--coordinator-http``) instead of gRPC, answered by
``--lookup-workers`` worker processes too when given; ``--work-weight`` and ``--cache-threshold``
are route's (its cost model; default route's own).

Mind the trace's own ceiling: with an unbounded cache, the first 150 / 300 / 600 / 1,000 requests could
serve 4.6% / 8.1% / 17.2% / 21.6% of their prompt tokens from cache (every earlier block held
everywhere), so short runs separate the routers little.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL, pct, route_cmd, start_engines, start_serve
from benchmarks.replay_route import PROFILE, trace_requests, until_backends
from kvcoord.tokenize import SIM_SOURCE, open_tokenizer
from tests.procs import TRACES, free_port, running, wait_for_port

ROUTERS = ("kvcoord", "sglang-router", "smg", "round-robin")
TOKENIZERS = ("sim", "engine", "route")
"""Where kvcoord serve tokenizes: in-process with the sim-engines' toy tokenizer, or an engine's /tokenize."""
_TICK = os.sysconf("SC_CLK_TCK")
Request = tuple[float, str, int]
"""(arrival s, prompt text, max_tokens)."""


@dataclass
class Run:
    """One router kind with R replicas over one replay."""

    router: str
    replicas: int
    tokenizer: str = ""
    """kvcoord only: ``sim``, ``engine`` or ``route`` (:data:`TOKENIZERS`)."""
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    hit_tokens: dict[str, float] = field(default_factory=dict)
    router_cpu: float = 0.0
    coordinator_cpu: float = 0.0
    seconds: float = 0.0
    load: float = 0.0
    diagnosis: str = ""
    """kvcoord route's own account of its placements (its metrics, summed over replicas)."""

    @property
    def label(self) -> str:
        return f"{self.router} ({self.tokenizer} tokenizer)" if self.tokenizer else self.router

    @property
    def requests(self) -> int:
        return len(self.ttft) + self.errors

    @property
    def cached_share(self) -> float:
        total = sum(self.prompt_tokens.values())
        return sum(self.hit_tokens.values()) / total if total else 0.0

    def pct(self, q: float) -> float:
        return pct(self.ttft, q) if self.ttft else float("nan")

    def balance(self) -> float:
        """The busiest engine's prompt tokens over the mean (1.0: even)."""
        vals = list(self.prompt_tokens.values())
        mean = statistics.fmean(vals) if vals else 0.0
        return max(vals) / mean if mean else float("nan")


def group_cpu(pgid: int) -> float:
    """User + system CPU seconds so far of every live process in process group ``pgid``."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


@dataclass
class Fleet:
    """What a run measures: the routers' base URLs, their process groups, the coordinator's, the engines."""

    bases: list[str]
    router_pids: list[int]
    engines: dict[str, str]
    coordinator_pid: int = 0
    coordinator_metrics: str = ""
    """The coordinator's ``/metrics`` URL (its lookups' own handling time)."""


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _rust_cmd(exe: str, port: int, urls: list[str], policy: str) -> list[str]:
    return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warn"]


async def _same_ids(engine: str, prompt: str) -> None:
    """Stop the benchmark unless the in-process toy tokenizer gives ``prompt`` the ids the engine's
    ``/tokenize`` gives it (a lookup on other ids would find nothing)."""
    local = await open_tokenizer(MODEL, SIM_SOURCE).encode_prompt(prompt)
    async with aiohttp.ClientSession() as s, s.post(f"{engine}/tokenize",
                                                     json={"model": MODEL, "prompt": prompt}) as r:
        remote = (await r.json())["tokens"]
    if local != remote:
        at = next((i for i, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b),
                  min(len(local), len(remote)))
        sys.exit(f"bench_routers: {SIM_SOURCE} and {engine}/tokenize disagree on a trace prompt "
                 f"({len(local)} vs {len(remote)} ids, first difference at {at})")


@contextlib.contextmanager
def _fleet(tmp: Path, args: argparse.Namespace, run: Run) -> Iterator[Fleet]:
    """Engines, then ``run.replicas`` routers of kind ``run.router`` (and for kvcoord a coordinator with the
    engines registered); yields once every router answers a completion."""
    router, replicas = run.router, run.replicas
    tag = f"{router}-{run.tokenizer}-{replicas}"
    with contextlib.ExitStack() as stack:
        engines = start_engines(stack, tmp, tag, args.nodes, args.blocks_per_node,
                                "--prefill-us-per-token", str(args.prefill_us_per_token),
                                "--decode-ms-per-token", str(args.decode_ms_per_token),
                                "--max-num-seqs", str(args.max_running), profile=PROFILE)
        urls = {node: url for node, (url, _) in engines.items()}
        ports = [free_port() for _ in range(replicas)]
        fleet = Fleet([_url(p) for p in ports], [], urls)
        if router == "kvcoord":
            hport = free_port()
            engine0 = next(iter(urls.values()))
            if run.tokenizer in ("sim", "route"):
                asyncio.run(_same_ids(engine0, args.sample_prompt))
            mport = free_port()
            fleet.coordinator_metrics = f"{_url(mport)}/metrics"
            coordinator, fleet.coordinator_pid = start_serve(
                stack, tmp / f"{tag}-serve.log", engine0 if run.tokenizer == "engine" else SIM_SOURCE,
                http_port=hport, profile=PROFILE, metrics_port=mport, workers=args.lookup_workers)
            asyncio.run(_register(_url(hport), engines))
            over_http = ("--coordinator-http", _url(hport)) if args.lookup == "http" else ()
            weight: tuple[str, ...] = ("--work-weight", str(args.work_weight)) if args.work_weight else ()
            if args.cache_threshold is not None:
                weight += ("--cache-threshold", str(args.cache_threshold))
            own = ("--tokenizer", SIM_SOURCE) if run.tokenizer == "route" else ()
            cmds = [route_cmd(p, "--coordinator", coordinator, *over_http, *weight, *own,
                              "--deadline-ms", str(args.deadline_ms), "--refresh-interval", "0.5",
                              "--seed", str(args.seed + i),
                              "--prefill-us-per-token", str(args.prefill_us_per_token),
                              "--decode-ms-per-token", str(args.decode_ms_per_token),
                              "--max-running", str(args.max_running),
                              "--mean-output-tokens", str(args.mean_output_tokens))
                    for i, p in enumerate(ports)]
        elif router == "round-robin":
            backends = [a for node, url in urls.items() for a in ("--backend", f"{node}={url}")]
            cmds = [route_cmd(p, "--policy", "round-robin", *backends) for p in ports]
        else:
            exe = shutil.which(router) or str(Path(sys.executable).parent / router)
            cmds = [_rust_cmd(exe, p, list(urls.values()), "cache_aware") for p in ports]
        for i, cmd in enumerate(cmds):
            proc = stack.enter_context(running(cmd, log=tmp / f"{tag}-router-{i}.log"))
            fleet.router_pids.append(proc.pid)
        for p in ports:
            wait_for_port(p, timeout=90)
        if router == "kvcoord":
            for base in fleet.bases:
                asyncio.run(until_backends(base, args.nodes))
        asyncio.run(_until_serving(fleet.bases))
        yield fleet


async def _register(base: str, engines: dict[str, tuple[str, int]]) -> None:
    """Register every engine with the coordinator's HTTP API (it then relays their events itself)."""
    async with aiohttp.ClientSession() as s:
        for i, (url, pub) in enumerate(engines.values()):
            body = {"instance_id": i, "model_name": MODEL, "block_size": PROFILE.block_size,
                    "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{pub + 1}",
                    "serving_url": url, "metrics_url": f"{url}/metrics"}
            async with s.post(f"{base}/register", json=body) as r:
                if r.status >= 300:
                    raise RuntimeError(f"register engine {i}: HTTP {r.status}: {await r.text()}")


async def _until_serving(bases: list[str], timeout: float = 90.0) -> None:
    """Every router answers a one-token completion (its workers are up and known)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for base in bases:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    body = {"model": MODEL, "prompt": "ready", "max_tokens": 1}
                    async with s.post(f"{base}/v1/completions", json=body) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router at {base} did not serve within {timeout}s")
                await asyncio.sleep(0.2)


async def _engine_counters(engines: dict[str, str]) -> dict[str, tuple[float, float]]:
    """node -> (prompt tokens, cached prompt tokens) so far, from each engine's vLLM metrics."""
    out: dict[str, tuple[float, float]] = {}
    async with aiohttp.ClientSession() as s:
        for node, url in engines.items():
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
            vals = {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"))}
            out[node] = (vals.get("vllm:prompt_tokens_total", 0.0),
                         vals.get("vllm:prefix_cache_hits_total", 0.0))
    return out


_SERVE_LOOKUP = "kvcoord_lookup_latency_seconds"
_PROMPT = '{query="prompt"}'
_DIAG = (_SERVE_LOOKUP + "_sum" + _PROMPT, _SERVE_LOOKUP + "_count" + _PROMPT,
         "kvcoord_route_below_best_total", "kvcoord_route_degraded_total", "kvcoord_route_best_tokens_total",
         "kvcoord_route_predicted_tokens_total", "kvcoord_route_achieved_tokens_total",
         "kvcoord_route_lookup_seconds_sum", "kvcoord_route_lookup_seconds_count")


async def _route_diagnosis(bases: list[str], coordinator_metrics: str) -> str:
    """Summed over route replicas: placements on a node holding less than the best, placements without the
    index (by reason), the best node's, the chosen node's predicted and the achieved hit tokens, and the
    lookup's mean time (the coordinator's tokenization included), which a request waits before its engine,
    with the part the coordinator's handler took (``kvcoord_lookup_latency_seconds``: the rest is the
    transport, route's loop and lookups queued behind others)."""
    vals: dict[str, float] = {}
    async with aiohttp.ClientSession() as s:
        for base in [*bases, coordinator_metrics.removesuffix("/metrics")]:
            async with s.get(f"{base}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith(_DIAG):
                        key, v = line.rsplit(" ", 1)
                        vals[key] = vals.get(key, 0.0) + float(v)
    degraded = {k.split('reason="', 1)[1].split('"', 1)[0]: int(v) for k, v in vals.items()
                if k.startswith("kvcoord_route_degraded_total") and v}
    count = vals.get("kvcoord_route_lookup_seconds_count", 0.0)
    lookup = vals.get("kvcoord_route_lookup_seconds_sum", 0.0) / max(count, 1)
    handled = (vals.get(_SERVE_LOOKUP + "_sum" + _PROMPT, 0.0)
               / max(vals.get(_SERVE_LOOKUP + "_count" + _PROMPT, 0.0), 1))
    return (f"lookup mean {lookup * 1e3:.1f} ms (serve's handler {handled * 1e3:.1f} ms); "
            f"below the best holder {vals.get('kvcoord_route_below_best_total', 0):.0f}, without the index "
            f"{degraded or 0}; hit tokens: best node {vals.get('kvcoord_route_best_tokens_total', 0):,.0f}, "
            f"chosen (predicted) {vals.get('kvcoord_route_predicted_tokens_total', 0):,.0f}, achieved "
            f"{vals.get('kvcoord_route_achieved_tokens_total', 0):,.0f}")


async def _replay(run: Run, bases: list[str], reqs: list[Request], limit: int) -> None:
    """Stream every request at its arrival time through replica i mod R; TTFT to the first data chunk."""
    sem = asyncio.Semaphore(limit)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=limit)) as s:
        start = time.monotonic()

        async def one(i: int, at: float, prompt: str, max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            async with sem:
                t0 = time.monotonic()
                first = 0.0
                try:
                    async with s.post(f"{bases[i % len(bases)]}/v1/completions", json=body) as r:
                        if r.status != 200:
                            run.errors += 1
                            print(f"  {run.router}: HTTP {r.status}: {(await r.text())[:200]}",
                                  file=sys.stderr)
                            return
                        async for line in r.content:
                            if not first and line.startswith(b"data:"):
                                first = time.monotonic() - t0
                except (aiohttp.ClientError, TimeoutError) as e:
                    run.errors += 1
                    print(f"  {run.router}: {e!r}", file=sys.stderr)
                    return
            if first:
                run.ttft.append(first)
            else:
                run.errors += 1

        await asyncio.gather(*(one(i, *r) for i, r in enumerate(reqs)))
        run.seconds = time.monotonic() - start


def _measure(tmp: Path, args: argparse.Namespace, run: Run, reqs: list[Request]) -> Run:
    with _fleet(tmp, args, run) as fleet:
        before = asyncio.run(_engine_counters(fleet.engines))
        cpu0 = [group_cpu(p) for p in fleet.router_pids]
        coord0 = group_cpu(fleet.coordinator_pid) if fleet.coordinator_pid else 0.0
        asyncio.run(_replay(run, fleet.bases, reqs, args.concurrency))
        run.router_cpu = sum(group_cpu(p) - c for p, c in zip(fleet.router_pids, cpu0, strict=True))
        run.coordinator_cpu = group_cpu(fleet.coordinator_pid) - coord0 if fleet.coordinator_pid else 0.0
        after = asyncio.run(_engine_counters(fleet.engines))
        run.load = os.getloadavg()[0]
        if run.router == "kvcoord":
            run.diagnosis = asyncio.run(_route_diagnosis(fleet.bases, fleet.coordinator_metrics))
    for node, (p1, h1) in after.items():
        p0, h0 = before[node]
        run.prompt_tokens[node], run.hit_tokens[node] = p1 - p0, h1 - h0
    return run


def _row(r: Run) -> str:
    n = max(r.requests, 1)
    shares = "/".join(f"{v / max(sum(r.prompt_tokens.values()), 1):.0%}" for v in r.prompt_tokens.values())
    coord = f" + serve {r.coordinator_cpu / n * 1e3:.2f}" if r.router == "kvcoord" else ""
    return (f"| {r.label} | {r.replicas} | {r.cached_share:.1%} | {r.pct(0.5):.2f} / {r.pct(0.9):.2f} / "
            f"{r.pct(0.99):.2f} | {shares} ({r.balance():.2f}) | {r.router_cpu / n * 1e3:.2f}{coord} | "
            f"{r.errors} | {r.seconds:.0f} | {r.load:.2f} |")


def _verdicts(runs: list[Run]) -> list[str]:
    """The issue's targets, against this run's figures (per kvcoord tokenizer when both ran)."""
    by = {(r.router, r.tokenizer, r.replicas): r for r in runs}
    out: list[str] = []
    approx = [by[(name, "", 1)] for name in ("sglang-router", "smg") if (name, "", 1) in by]
    for tok in dict.fromkeys(r.tokenizer for r in runs if r.router == "kvcoord"):
        k1 = by.get(("kvcoord", tok, 1))
        if k1 and approx:
            best = max(approx, key=lambda r: r.cached_share)
            ok_hit = k1.cached_share >= best.cached_share
            ratios = [k1.pct(q) / best.pct(q) for q in (0.5, 0.9, 0.99)]
            out.append(f"{k1.label}, 1 router: cached share {k1.cached_share:.1%} vs {best.router}'s "
                       f"{best.cached_share:.1%}: {'met' if ok_hit else 'not met'}; TTFT p50/p90/p99 "
                       f"{' / '.join(f'{x:.2f}x' for x in ratios)} its (target <= 0.9x): "
                       f"{'met' if all(x <= 0.9 for x in ratios) else 'not met'}")
            rust = min(approx, key=lambda r: r.router_cpu)
            cpu = (k1.router_cpu / max(k1.requests, 1)
                   / (rust.router_cpu / max(rust.requests, 1) or float("nan")))
            out.append(f"{k1.label}: route CPU per request {cpu:.2f}x {rust.router}'s (target <= 1.5x): "
                       f"{'met' if cpu <= 1.5 else 'not met'} (serve's own CPU apart)")
        for n in (2, 4):
            kn = by.get(("kvcoord", tok, n))
            if k1 and kn:
                rel = (kn.cached_share / k1.cached_share - 1) if k1.cached_share else float("nan")
                ok = "met" if abs(rel) <= 0.03 else "not met"
                out.append(f"{kn.label}, {n} routers: cached share {kn.cached_share:.1%}, {rel:+.1%} of the "
                           f"1-router {k1.cached_share:.1%} (target within 3%): {ok}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACES / "mooncake_conversation.jsonl")
    ap.add_argument("--requests", type=int, default=600, help="first K trace requests")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--blocks-per-node", type=int, default=50_000, help="each engine's KV cache, in blocks")
    ap.add_argument("--time-scale", type=float, default=0.5, help="multiply trace inter-arrival times")
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0,
                    help="engines' compute per uncached prompt token (route is told the same)")
    ap.add_argument("--decode-ms-per-token", type=float, default=10.0, help="engines' decode step")
    ap.add_argument("--max-running", type=int, default=32, help="engines' --max-num-seqs")
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight at most")
    ap.add_argument("--deadline-ms", type=int, default=1000, help="route's lookup deadline")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--replicas", default="1,2,4", help="router replicas per run, comma-separated")
    ap.add_argument("--quick", action="store_true",
                    help="300 requests, 60,000 blocks a node (their working set over 4 engines; a short "
                    "run: --requests and --blocks-per-node then ignored)")
    ap.add_argument("--lookup", choices=("grpc", "http"), default="grpc",
                    help="how kvcoord route asks serve: gRPC Lookup, or its HTTP API (--coordinator-http)")
    ap.add_argument("--lookup-workers", type=int, default=0,
                    help="kvcoord serve's --lookup-workers (they answer its HTTP API: with --lookup http)")
    ap.add_argument("--work-weight", type=float, default=None,
                    help="kvcoord route's --work-weight (default: route's own)")
    ap.add_argument("--cache-threshold", type=float, default=None,
                    help="kvcoord route's --cache-threshold (default: route's own)")
    ap.add_argument("--tokenizer", default="sim",
                    help="where kvcoord tokenizes, comma-separated for several kvcoord runs: sim (serve, "
                    "in-process, the engines' toy tokenizer), engine (serve, via engine 0's /tokenize) or "
                    "route (each route itself, the toy tokenizer; lookups by token ids)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.blocks_per_node = 300, 60_000
    if args.lookup_workers and args.lookup != "http":
        sys.exit("bench_routers: --lookup-workers answer serve's HTTP API: give --lookup http too")
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        sys.exit(f"bench_routers: unknown router {bad[0]!r} (choose from {', '.join(ROUTERS)})")
    for name in ("sglang-router", "smg"):
        if name in routers and not (shutil.which(name) or (Path(sys.executable).parent / name).exists()):
            print(f"{name} is not installed (pip install sglang-router==0.3.2 smg==1.13.0): skipped",
                  file=sys.stderr)
            routers.remove(name)
    tokenizers = [t.strip() for t in args.tokenizer.split(",") if t.strip()]
    if not tokenizers or any(t not in TOKENIZERS for t in tokenizers):
        sys.exit(f"bench_routers: --tokenizer takes {' or '.join(TOKENIZERS)}, comma-separated")
    replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    tokens = trace_requests(args.trace, args.requests, args.time_scale)
    reqs: list[Request] = [(at, " ".join(f"w{t}" for t in toks), out) for at, toks, out in tokens]
    args.mean_output_tokens = statistics.fmean(r[2] for r in reqs)
    args.sample_prompt = reqs[0][1]
    print(f"{len(reqs)} requests over {reqs[-1][0]:.0f} s, {sum(len(t[1]) for t in tokens):,} prompt "
          f"tokens; {args.nodes} engines x {args.blocks_per_node} blocks of {PROFILE.block_size}, prefill "
          f"{args.prefill_us_per_token:g} us/token, decode {args.decode_ms_per_token:g} ms/step; load "
          f"average {os.getloadavg()[0]:.2f}")
    print("| router | replicas | cached share | TTFT p50 / p90 / p99 s | prompt tokens per engine (max/mean) "
          "| router CPU ms per request | errors | wall s | load avg |\n"
          "|---|---:|---:|---|---|---|---:|---:|---:|", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as d:
        for n in replicas:  # every router with one replica first: the targets' baseline
            for router in routers:
                for tok in tokenizers if router == "kvcoord" else [""]:
                    runs.append(_measure(Path(d), args, Run(router, n, tok), reqs))
                    print(_row(runs[-1]), flush=True)
                    if runs[-1].diagnosis:
                        print(f"  {runs[-1].label} x{n}: {runs[-1].diagnosis}", file=sys.stderr,
                              flush=True)
    for line in _verdicts(runs):
        print(line)


if __name__ == "__main__":
    main()
