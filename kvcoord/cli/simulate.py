"""``kvcoord simulate``: replay a workload on a simulated cluster under several routing policies."""

from __future__ import annotations

import argparse
import dataclasses

from kvcoord.cli.common import (
    NONNEG_FLOAT,
    NONNEG_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Subparsers,
    add_block_hashing,
    add_connection,
    add_cost_model,
    security,
)


def parse_flush(text: str) -> tuple[float, int]:
    """``SECONDS:NODE`` of ``--flush-at`` (``benchmarks/sim_placement.py`` takes the same flag)."""
    at, sep, node = text.partition(":")
    try:
        when, which = float(at), int(node)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not SECONDS:NODE (e.g. 40:0)") from None
    if not sep or not when >= 0 or which < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not SECONDS:NODE with SECONDS >= 0 and NODE >= 0")
    return when, which


def add(sub: Subparsers) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare routing policies on a simulated cluster",
        description="Replays a Mooncake trace or a synthetic shared-prefix workload on N simulated "
        "nodes (real block pools feeding a real index) under each routing policy, and prints a "
        "comparison table on stdout (JSON with --json, a PNG with --plot); progress goes to stderr.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: the synthetic workload)")
    w.add_argument("--synthetic", action="store_true", help="use the synthetic generator (the default)")
    w.add_argument("--limit", type=POSITIVE_INT, default=None, help="only the first N requests")
    w.add_argument("--time-scale", type=POSITIVE_FLOAT, default=1.0,
                   help="multiply inter-arrival times (0.5 = twice the request rate)")
    w.add_argument("--requests", type=POSITIVE_INT, default=2000, help="synthetic: number of requests")
    w.add_argument("--groups", type=POSITIVE_INT, default=16, help="synthetic: system prompts")
    w.add_argument("--prompts-per-group", type=POSITIVE_INT, default=32,
                   help="synthetic: conversations per group")
    w.add_argument("--system-tokens", type=POSITIVE_INT, default=2048, help="synthetic: system prompt length")
    w.add_argument("--question-tokens", type=POSITIVE_INT, default=128, help="synthetic: tokens per question")
    w.add_argument("--output-tokens", type=POSITIVE_INT, default=256, help="synthetic: tokens per answer")
    w.add_argument("--turns", type=POSITIVE_INT, default=4, help="synthetic: turns per conversation")
    w.add_argument("--zipf", type=POSITIVE_FLOAT, default=1.1, help="synthetic: group popularity exponent")
    w.add_argument("--rate", type=POSITIVE_FLOAT, default=10.0, help="synthetic: Poisson arrivals per second")
    c = p.add_argument_group("cluster and cost model")
    c.add_argument("--nodes", type=POSITIVE_INT, default=8, help="engines in the simulated fleet")
    c.add_argument("--blocks-per-node", type=POSITIVE_INT, default=25_000,
                   help="KV blocks per node (default 25000)")
    add_cost_model(c, mean_output=False, pull=True)
    c.add_argument("--flush-at", type=parse_flush, action="append", default=[], metavar="SECONDS:NODE",
                   help="empty node NODE's (0-based) GPU prefix cache at SECONDS of the replay, as a cache "
                        "reset or a restart does (a CPU tier takes the blocks); the index sees it, a "
                        "router's memory does not (repeatable)")
    t = p.add_argument_group(
        "caches past the GPU (docs/simulate.md)",
        "A CPU tier per node (evicted GPU blocks move there), a shared pool (stored blocks are written "
        "through) and peer pulls; an engine loads them instead of prefilling, at the cost per block given.")
    t.add_argument("--cpu-blocks-per-node", type=NONNEG_INT, default=0,
                   help="CPU-tier blocks per node (0: none)")
    t.add_argument("--cpu-reload-us-per-block", type=NONNEG_FLOAT, default=20.0,
                   help="reloading one block from the CPU tier (default 20 us: 2 MiB over PCIe)")
    t.add_argument("--pool-blocks", type=NONNEG_INT, default=0, help="blocks in the shared pool (0: none)")
    t.add_argument("--pool-nodes", type=NONNEG_INT, default=0,
                   help="the first N nodes reach the pool (0: all)")
    t.add_argument("--pool-load-us-per-block", type=NONNEG_FLOAT, default=200.0,
                   help="loading one block from the pool (default 200 us: 2 MiB over ~10 GB/s)")
    d = p.add_argument_group(
        "disaggregated prefill and decode (docs/simulate.md)",
        "The first --prefill-nodes nodes prefill, the others decode. Each policy picks the decode node, "
        "and a prefill node when the decode node lacks more than --max-local-prefill-tokens of the prompt "
        "(as kvcoord route does); the decode node then pulls the blocks it lacks.")
    d.add_argument("--prefill-nodes", type=NONNEG_INT, default=0, metavar="N",
                   help="nodes of the prefill pool (0: not disaggregated)")
    d.add_argument("--kv-transfer-us-per-block", type=NONNEG_FLOAT, default=100.0,
                   help="moving one block from the prefill node to the decode node (default 100 us: 2 MiB "
                        "over ~20 GB/s RDMA)")
    d.add_argument("--max-local-prefill-tokens", type=NONNEG_INT, default=1000, metavar="N",
                   help="the decode node prefills alone when it lacks at most N prompt tokens (Dynamo's "
                        "max_local_prefill_length; default 1000)")
    add_block_hashing(c, algo_flag="--hash-algo", algo_default="xxhash_cbor", seed_default="kvcoord-sim")
    c.add_argument("--index", default="memory", help="index backend URI (default: in-process memory)")
    r = p.add_argument_group(
        "against a running coordinator",
        "Nodes stream their events through real reporters and the router looks prefixes up over gRPC (same "
        "table; the routing overhead includes the network). The run's nodes are removed at the end.")
    add_connection(r, required=False, timeout=None, replicas=False)
    o = p.add_argument_group("routing and output")
    o.add_argument("--policies", default="prefix-aware,approximate,least-loaded,round-robin,random",
                   help="comma separated policies to compare")
    o.add_argument("--ttl", type=POSITIVE_FLOAT, default=120.0,
                   help="approximate policy: routed-prefix memory TTL (s)")
    o.add_argument("--seed", type=int, default=0, help="RNG seed of the workload and the policies")
    o.add_argument("--seeds", type=POSITIVE_INT, default=1,
                   help="run each policy with seeds SEED..SEED+N-1 and report means and min-max ranges")
    o.add_argument("--jobs", type=POSITIVE_INT, default=1, help="policies simulated in parallel processes")
    o.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-' for stdout)")
    o.add_argument("--plot", default=None, metavar="PNG", help="write a comparison plot (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvcoord.sim.run import SimulateConfig, run_simulate

    fields = {f.name for f in dataclasses.fields(SimulateConfig)} - {"coordinator_security"}
    config = SimulateConfig(
        **{name: getattr(args, name) for name in fields},
        coordinator_security=security(args) if args.coordinator else None,
    )
    run_simulate(config)
    return 0
