"""``kvcoord simulate``: build the workload once, replay it under each policy, report.

The comparison table is the command's data, so it goes to stdout (stderr when ``--json -`` takes
stdout); progress, with an ETA per policy run, goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcoord.gateway.disagg import DEFAULT_MAX_LOCAL_PREFILL
from kvcoord.hashing import HashProfile, check_algo
from kvcoord.index import open_index
from kvcoord.index.base import Index
from kvcoord.router.placement import LatencyModel
from kvcoord.router.policy import POLICY_NAMES, make_policy
from kvcoord.sim.cluster import ClusterConfig, SimBackend, simulate
from kvcoord.sim.disagg import PdSimConfig, pools
from kvcoord.sim.report import average_seeds, breakdown, check_plotting, plot, summarize, table
from kvcoord.sim.tiers import TierConfig
from kvcoord.sim.workload import SyntheticSpec, Workload, load_mooncake, synthetic

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvcoord.transport import ChannelSecurity

PROGRESS_SECONDS = 5.0
"""A policy run reports its progress at most this often."""


_SYNTHETIC = SyntheticSpec()
_CLUSTER = ClusterConfig()
"""The defaults below come from the configurations that own them, so they are written once."""


@dataclass(frozen=True, slots=True)
class SimulateConfig:
    """A simulation: the workload, the cluster and cost model, the policies (``kvcoord simulate --help``)."""

    trace: str | None = None
    synthetic: bool = False
    limit: int | None = None
    time_scale: float = 1.0
    requests: int = _SYNTHETIC.requests
    groups: int = _SYNTHETIC.groups
    prompts_per_group: int = _SYNTHETIC.prompts_per_group
    system_tokens: int = _SYNTHETIC.system_tokens
    question_tokens: int = _SYNTHETIC.question_tokens
    output_tokens: int = _SYNTHETIC.output_tokens
    turns: int = _SYNTHETIC.turns
    zipf: float = _SYNTHETIC.zipf
    rate: float = _SYNTHETIC.rate
    nodes: int = _CLUSTER.nodes
    blocks_per_node: int = _CLUSTER.blocks_per_node
    max_running: int = _CLUSTER.latency.max_running
    prefill_us_per_token: float = _CLUSTER.latency.flags()["prefill_us_per_token"]
    decode_ms_per_token: float = _CLUSTER.latency.flags()["decode_ms_per_token"]
    work_weight: float = _CLUSTER.latency.work_weight
    cache_threshold: float = _CLUSTER.latency.cache_threshold
    flush_at: Sequence[tuple[float, int]] = ()
    block_size: int = 16
    hash_algo: str = "xxhash_cbor"
    hash_seed: str = "kvcoord-sim"
    index: str = "memory"
    coordinator: str | None = None
    coordinator_security: ChannelSecurity | None = None
    policies: str = "prefix-aware,approximate,least-loaded,round-robin,random"
    ttl: float = 120.0
    cpu_blocks_per_node: int = 0
    cpu_reload_us_per_block: float = 20.0
    pool_blocks: int = 0
    pool_nodes: int = 0
    pool_load_us_per_block: float = 200.0
    pull_us_per_block: float | None = None
    prefill_nodes: int = 0
    kv_transfer_us_per_block: float = 100.0
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL
    seed: int = 0
    seeds: int = 1
    jobs: int = 1
    json: str | None = None
    plot: str | None = None


def _policies(raw: str) -> list[str]:
    names = [p.strip() for p in raw.split(",") if p.strip()]
    if not names:
        raise ValueError("--policies is empty")
    for p in names:
        if p not in POLICY_NAMES:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(POLICY_NAMES)})")
    if len(set(names)) != len(names):
        raise ValueError("--policies lists a policy twice")
    return names


def _workload(args: SimulateConfig, profile: HashProfile) -> Workload:
    if args.trace is not None and args.synthetic:
        raise ValueError("give --trace or --synthetic, not both")
    if args.trace is not None:
        if not os.path.exists(args.trace):
            raise ValueError(f"trace {args.trace!r} not found")
        return load_mooncake(args.trace, profile, limit=args.limit, time_scale=args.time_scale)
    spec = SyntheticSpec(
        requests=args.limit if args.limit is not None else args.requests,
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_tokens=args.system_tokens,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        turns=args.turns,
        zipf=args.zipf,
        rate=args.rate / args.time_scale,
    )
    return synthetic(spec, profile, seed=args.seed)


_SHARED: tuple[Workload, HashProfile, ClusterConfig, SimulateConfig] | None = None
"""What :func:`_run_policy` needs, set before worker processes fork."""


def _reporter(name: str, seed: int) -> Any:
    """A progress callback that prints ``routed/total`` and an ETA to stderr every few seconds."""
    start = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == 0 or now - last < PROGRESS_SECONDS:
            return
        last = now
        eta = (now - start) / done * (total - done)
        print(f"  {name} (seed {seed}): {done:,}/{total:,} requests ({done / total:.0%}), ETA {eta:.0f} s",
              file=sys.stderr, flush=True)

    return progress


def _run_policy(job: tuple[str, int]) -> dict[str, Any]:
    assert _SHARED is not None
    name, seed = job
    workload, profile, config, args = _SHARED
    policy = make_policy(name, seed, latency=config.latency, ttl=args.ttl)
    index: Index | SimBackend
    if args.coordinator is not None:
        from kvcoord.sim.remote import CoordinatorBackend, run_tag

        index = CoordinatorBackend(args.coordinator, profile, tag=run_tag(name),
                                   security=args.coordinator_security)
    else:
        index = open_index(args.index, key_prefix=f"kvcoord-sim-{os.getpid()}-{name}-{seed}")
    t1 = time.perf_counter()
    result = simulate(workload, policy, profile, config, index, progress=_reporter(name, seed))
    row = summarize(result)
    row["wall_s"] = round(time.perf_counter() - t1, 2)
    row["seed"] = seed
    print(
        f"  {name} (seed {seed}): hit {row['token_hit_rate']:.1%}, TTFT p99 {row['ttft_p99_s']:.3f} s "
        f"({row['wall_s']:.1f} s wall)",
        file=sys.stderr,
        flush=True,
    )
    return row


def _cluster(args: SimulateConfig, workload: Workload) -> ClusterConfig:
    """The fleet and its cost model; the mean output length comes from the workload."""
    mean_out = sum(r.output_tokens for r in workload.requests) / len(workload.requests)
    latency = LatencyModel.from_flags(prefill_us_per_token=args.prefill_us_per_token,
                                      decode_ms_per_token=args.decode_ms_per_token,
                                      max_running=args.max_running, mean_output_tokens=mean_out,
                                      pull_us_per_block=args.pull_us_per_block,
                                      work_weight=args.work_weight, cache_threshold=args.cache_threshold)
    if args.pool_nodes > args.nodes:
        raise ValueError(f"--pool-nodes {args.pool_nodes} is more than --nodes {args.nodes}")
    tiers = TierConfig(cpu_blocks=args.cpu_blocks_per_node, cpu_reload_s=args.cpu_reload_us_per_block / 1e6,
                       pool_blocks=args.pool_blocks, pool_nodes=args.pool_nodes,
                       pool_load_s=args.pool_load_us_per_block / 1e6,
                       pull_s=None if args.pull_us_per_block is None else args.pull_us_per_block / 1e6)
    pd = PdSimConfig(args.prefill_nodes, args.kv_transfer_us_per_block / 1e6, args.max_local_prefill_tokens)
    pools(pd, [str(i) for i in range(args.nodes)])  # ValueError now, not after the workload's replay
    return ClusterConfig(nodes=args.nodes, blocks_per_node=args.blocks_per_node, latency=latency, tiers=tiers,
                         pd=pd, flushes=tuple(args.flush_at))


def _run_jobs(args: SimulateConfig, names: list[str], workload: Workload, profile: HashProfile,
              config: ClusterConfig) -> list[dict[str, Any]]:
    """One row per (policy, seed), in parallel processes with ``--jobs``."""
    global _SHARED
    _SHARED = (workload, profile, config, args)
    try:
        jobs = [(name, args.seed + k) for name in names for k in range(args.seeds)]
        if args.jobs > 1 and len(jobs) > 1:
            import multiprocessing

            # fork: the children share the (large) workload copy-on-write instead of pickling it
            with multiprocessing.get_context("fork").Pool(min(args.jobs, len(jobs))) as workers:
                return workers.map(_run_policy, jobs)
        return [_run_policy(job) for job in jobs]
    finally:
        _SHARED = None


def _report(args: SimulateConfig, workload: Workload, profile: HashProfile, config: ClusterConfig,
            rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--json`` document: the workload, the cluster, one row per policy (and every run with seeds)."""
    report: dict[str, Any] = {
        "workload": {
            "name": workload.name,
            "source": args.trace or "synthetic",
            "requests": len(workload.requests),
            "duration_s": round(workload.duration, 3),
            "limit": args.limit,
            "time_scale": args.time_scale,
        },
        "cluster": {
            "nodes": config.nodes,
            "blocks_per_node": config.blocks_per_node,
            "block_size": profile.block_size,
            "hash_algo": profile.algo,
            "max_running": config.latency.max_running,
            "prefill_us_per_token": args.prefill_us_per_token,
            "decode_ms_per_token": args.decode_ms_per_token,
            "work_weight": config.latency.work_weight,
            "cache_threshold": config.latency.cache_threshold,
            "flush_at": [list(f) for f in config.flushes],
            "index": f"coordinator {args.coordinator}" if args.coordinator else args.index,
            "cpu_blocks_per_node": args.cpu_blocks_per_node,
            "cpu_reload_us_per_block": args.cpu_reload_us_per_block,
            "pool_blocks": args.pool_blocks,
            "pool_nodes": args.pool_nodes or (config.nodes if args.pool_blocks else 0),
            "pool_load_us_per_block": args.pool_load_us_per_block,
            "pull_us_per_block": args.pull_us_per_block,
            "prefill_nodes": args.prefill_nodes,
            "kv_transfer_us_per_block": args.kv_transfer_us_per_block,
            "max_local_prefill_tokens": args.max_local_prefill_tokens,
        },
        "seed": args.seed,
        "seeds": args.seeds,
        "policies": rows,
    }
    if args.seeds > 1:
        report["runs"] = runs
    return report


def run_simulate(args: SimulateConfig) -> None:
    """Replay the workload under every requested policy; the table on stdout, JSON/PNG when asked."""
    if args.coordinator is not None and args.index != "memory":
        raise ValueError("give --index or --coordinator, not both")
    if args.coordinator is not None and (args.cpu_blocks_per_node or args.pool_blocks
                                         or args.pull_us_per_block is not None):
        raise ValueError("the CPU tier, pool and pull flags need the in-process index, not --coordinator")
    if args.plot is not None:
        check_plotting()  # before minutes of simulation, not after
    names = _policies(args.policies)
    profile = HashProfile(check_algo(args.hash_algo), args.block_size, seed=args.hash_seed)
    t0 = time.perf_counter()
    workload = _workload(args, profile)
    if not workload.requests:
        raise ValueError("the workload has no requests")
    load_s = time.perf_counter() - t0
    config = _cluster(args, workload)
    print(
        f"workload {workload.name}: {len(workload.requests)} requests over {workload.duration:.0f} s, "
        f"{sum(r.num_tokens for r in workload.requests):,} prompt tokens (built in {load_s:.1f} s); "
        f"{config.nodes} nodes x {config.blocks_per_node} blocks of {profile.block_size}"
        + (f" ({args.prefill_nodes} prefill, {config.nodes - args.prefill_nodes} decode)"
           if config.pd.active else ""),
        file=sys.stderr,
    )
    runs = _run_jobs(args, names, workload, profile, config)
    rows = [average_seeds([r for r in runs if r["policy"] == name]) for name in names]
    out = sys.stderr if args.json == "-" else sys.stdout
    print(table(rows), file=out, flush=True)
    if config.tiers.active:
        print("\nwhere the saved prefill tokens came from:\n" + breakdown(rows), file=out, flush=True)
    if args.json is not None:
        text = json.dumps(_report(args, workload, profile, config, rows, runs), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.plot is not None:
        title = (
            f"{workload.name}: {len(workload.requests)} requests, {config.nodes} nodes, "
            f"{config.blocks_per_node} blocks/node"
            + (f", mean of {args.seeds} seeds" if args.seeds > 1 else "")
        )
        plot(rows, args.plot, title)
        print(f"plot written to {args.plot}", file=sys.stderr)
