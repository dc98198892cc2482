"""Audit placements in ``kvcoord simulate``: how often a policy sends a request away from the node holding
the most of its prompt, why, and what that costs, per policy variant and seed.

Every variant is wrapped so that it also receives the index's matches (the approximate policy ignores
them, so its decisions are unchanged), and each decision is compared with the best holder *by the index*
(the truth at routing time). The reason is read from the decision's ``why``: the balance cap, the load
term (``is busier``), or a placement this router made that events have not reported yet (``in flight``).

    PYTHONPATH=. python benchmarks/sim_placement.py --trace ../shared/traces/mooncake_conversation.jsonl \\
        --limit 2000 --seeds 0,1,2 prefix-aware prefix-aware:work_weight=2 approximate

A variant is ``policy[:key=value,...]``; keys are :class:`PrefixAwarePolicy` keyword arguments
(``balance_abs``, ``balance_rel``) or its cost model's (``work_weight``, ``cache_threshold``); for
``approximate`` they configure its inner cost model.
``sglang-tree`` is SGLang's cache-aware router's rule (:class:`SglangTree`, keys ``threshold``, ``abs_gap``,
``rel``, ``exact``, ``miss_load``), the tree ``benchmarks/bench_routers.py`` runs for real. ``routers=N``
splits the requests over N routers in turn, each with its own state (``shared=0``: prefix-aware's routers do
not share their placements, as ``route --no-reserve``; ``lag=S``: a router does not see the other routers'
picks of the last S seconds in the loads, as when their reservations reach the coordinator after its
lookup was answered; its own it counts itself; ``fill=1``: those picks, unplaced, are each added where the
queue is shortest). ``prefix-aware:temperature=T`` samples a node by ``exp(-cost / T)`` (Dynamo's router
temperature) instead of taking the cheapest.
``--nodes``, ``--blocks-per-node``, ``--time-scale``, ``--prefill-us-per-token`` and ``--decode-ms-per-token``
shape the fleet (default: ``kvcoord simulate``'s; ``benchmarks/bench_routers.py``'s is ``--nodes 4
--blocks-per-node 50000 --time-scale 0.5 --prefill-us-per-token 20 --decode-ms-per-token 10``).
Output: one line per (variant, seed) and the mean per variant. Everything but the wall time is modelled
and deterministic.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import statistics
import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, cast

from kvcoord.cli.simulate import parse_flush
from kvcoord.hashing import HashProfile, check_algo
from kvcoord.index import open_index
from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate
from kvcoord.router.placement import Decision, LatencyModel, RouteRequest
from kvcoord.router.policy import ApproximatePolicy, Policy, PrefixAwarePolicy
from kvcoord.sim.cluster import ClusterConfig, simulate
from kvcoord.sim.report import summarize
from kvcoord.sim.workload import Workload, load_mooncake


@dataclass
class Audit:
    """Decisions placed below the best holder, by reason, and the held blocks they gave up."""

    requests: int = 0
    away: Counter[str] = field(default_factory=Counter)
    blocks_lost: Counter[str] = field(default_factory=Counter)


def _reason(why: str) -> str:
    if why.startswith("sglang-tree: "):
        return why.removeprefix("sglang-tree: ")
    if "over the balance cap" in why:
        return "cap"
    if "is busier" in why:
        return "load"
    if "in flight to" in why or "reserved on" in why:
        return "in-flight"
    return "memory"  # approximate: its memory believed another node held more


class Audited:
    """A policy that also sees the index's matches, and records how each decision compares."""

    uses_index: ClassVar[bool] = True

    def __init__(self, inner: Policy, audit: Audit) -> None:
        self.inner, self.audit, self.name = inner, audit, inner.name

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        d = self.inner.choose(request, candidates)
        top = max(c.matched_blocks for c in candidates)
        chosen = next(c for c in candidates if c.key == d.key).matched_blocks
        self.audit.requests += 1
        if chosen < top:
            reason = _reason(d.why)
            self.audit.away[reason] += 1
            self.audit.blocks_lost[reason] += top - chosen
        return d


class SglangTree:
    """SGLang's ``cache_aware`` rule, as ``sglang-router`` 0.3.2 runs it with its defaults, at block
    granularity: when loads are balanced, the node whose tree matches the most of the prompt if that covers
    more than ``threshold`` of it, else the node with the smallest tree (fewest distinct blocks sent
    there); when imbalanced (max - min in flight > ``abs_gap`` and max > ``rel`` x min), the least loaded.
    The tree is what it routed where, never forgotten within a run (its 120 s sweeps cut to 2^26
    characters). For taking the rule apart: ``exact=1`` matches on the index instead of the tree,
    ``miss_load=1`` sends a miss to the least loaded node instead of the smallest tree."""

    uses_index: ClassVar[bool] = False

    def __init__(self, seed: int, threshold: float = 0.3, abs_gap: int = 64, rel: float = 1.5,
                 exact: int = 0, miss_load: int = 0) -> None:
        self.name, self.rng = "sglang-tree", random.Random(seed)
        self.threshold, self.abs_gap, self.rel = threshold, abs_gap, rel
        self.exact, self.miss_load = bool(exact), bool(miss_load)
        self.trees: dict[NodeKey, set[int]] = {}

    def _depth(self, request: RouteRequest, c: Candidate) -> int:
        if self.exact:
            return c.matched_blocks
        tree, n = self.trees.get(c.key, set()), 0
        for h in request.block_hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=lambda c: (c.load.in_flight, self.rng.random()))

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        loads = [c.load.in_flight for c in candidates]
        depth = {c.key: self._depth(request, c) for c in candidates}
        best = max(candidates, key=lambda c: (depth[c.key], self.rng.random()))
        if max(loads) - min(loads) > self.abs_gap and max(loads) > self.rel * min(loads):
            chosen, why = self._least_loaded(candidates), "imbalanced"
        elif depth[best.key] > self.threshold * max(1, len(request.block_hashes)):
            chosen, why = best, "tree match"
        elif self.miss_load:
            chosen, why = self._least_loaded(candidates), "miss to the least loaded"
        else:
            chosen = min(candidates, key=lambda c: (len(self.trees.get(c.key, ())), self.rng.random()))
            why = "smallest tree"
        self.trees.setdefault(chosen.key, set()).update(request.block_hashes)
        return Decision(chosen.node_id, chosen.dp_rank, f"sglang-tree: {why}", chosen.matched_blocks)


class Tempered(PrefixAwarePolicy):
    """Prefix-aware placement sampling a node with probability ~ exp(-cost / ``temperature``) (Dynamo's
    router temperature) rather than taking the cheapest: Gumbel noise on each cost, then the minimum."""

    def __init__(self, seed: int, temperature: float, **kw: Any) -> None:
        super().__init__(seed, **kw)
        self.temperature, self.noise = temperature, random.Random(seed + 7)

    def cost(self, request: RouteRequest, c: Candidate, weight: float) -> float:
        u = max(self.noise.random(), 1e-300)  # the noise >= -37 T: 40 T more keeps every cost positive
        return super().cost(request, c, weight) + self.temperature * (40 + math.log(-math.log(u) or 1e-300))


_COST_MODEL = ("work_weight", "cache_threshold")
"""Variant keys that set the :class:`LatencyModel`, not the policy."""


class Replicas:
    """Requests split over several routers in turn, each placing on its own state: a tree its own tree,
    prefix-aware its own in-flight memory unless ``shared`` (kvcoord's routers share their placements
    through the coordinator's reservations; here, one memory). With ``lag`` a router's loads leave out
    the other routers' picks of the last ``lag`` seconds (a request and its uncached prompt each)."""

    uses_index: ClassVar[bool] = True

    def __init__(self, routers: list[Policy], shared: bool, lag: float = 0.0, fill: bool = False) -> None:
        self.routers, self.turn, self.name, self.lag, self.fill = routers, 0, routers[0].name, lag, fill
        self.picks: deque[tuple[float, int, NodeKey, int]] = deque()
        """``(when, router, node, uncached tokens)`` of the last ``lag`` seconds' picks."""
        if shared:
            for r in routers:
                if isinstance(r, PrefixAwarePolicy):
                    r.memory = cast(PrefixAwarePolicy, routers[0]).memory

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        me = self.turn % len(self.routers)
        self.turn += 1
        if self.lag > 0:
            while self.picks and self.picks[0][0] <= request.now - self.lag:
                self.picks.popleft()
            unseen: dict[NodeKey, list[int]] = {}
            pending: list[int] = []
            for _, who, key, tokens in self.picks:
                if who != me:
                    got = unseen.setdefault(key, [0, 0])
                    got[0] += 1
                    got[1] += tokens
                    pending.append(tokens)
            candidates = [c if c.key not in unseen else replace(c, load=_less(c.load, *unseen[c.key]))
                          for c in candidates]
            if self.fill and pending:
                candidates = _water_fill(candidates, pending, self.routers[me])
        d = self.routers[me].choose(request, candidates)
        if self.lag > 0:
            held = next(c.matched_blocks for c in candidates if c.key == (d.node_id, d.dp_rank))
            uncached = max(0, request.num_tokens - held * request.block_size)
            self.picks.append((request.now, me, (d.node_id, d.dp_rank), uncached))
        return d


def _water_fill(candidates: list[Candidate], pending: list[int], router: Policy) -> list[Candidate]:
    """The other routers' picks this router does not see (only how many, and their prompts' uncached
    tokens, as the coordinator's holds would tell), each added where the queue is shortest then."""
    latency = cast(PrefixAwarePolicy, router).latency
    out = {c.key: c for c in candidates}
    for tokens in pending:
        c = min(out.values(), key=lambda c: (latency.queue_seconds(c.load), c.key))
        load = c.load
        out[c.key] = replace(c, load=replace(load, waiting_requests=load.waiting_requests + 1,
                                             prefill_tokens=load.prefill_tokens + tokens))
    return [out[c.key] for c in candidates]


def _less(load: NodeLoad, requests: int, tokens: int) -> NodeLoad:
    """``load`` without ``requests`` requests (waiting first) and ``tokens`` prefill tokens."""
    waiting = max(0, load.waiting_requests - requests)
    running = max(0, load.running_requests - (requests - (load.waiting_requests - waiting)))
    return replace(load, waiting_requests=waiting, running_requests=running,
                   prefill_tokens=max(0, load.prefill_tokens - tokens))


def _policy(variant: str, seed: int, latency: LatencyModel) -> Policy:
    name, _, raw = variant.partition(":")
    kw: dict[str, Any] = {}
    for item in filter(None, raw.split(",")):
        key, _, value = item.partition("=")
        kw[key] = float(value) if "." in value or key in _COST_MODEL else int(value)
    routers, shared, lag = kw.pop("routers", 1), bool(kw.pop("shared", 1)), float(kw.pop("lag", 0.0))
    fill = bool(kw.pop("fill", 0))
    if routers > 1:
        inner = ",".join(f"{k}={v}" for k, v in kw.items())
        one = f"{name}:{inner}" if inner else name
        return Replicas([_policy(one, seed * 1000 + i, latency) for i in range(routers)], shared, lag, fill)
    # the cost model's, not the policy's
    latency = replace(latency, **{key: kw.pop(key) for key in _COST_MODEL if key in kw})
    if name == "prefix-aware":
        if "temperature" in kw:
            return Tempered(seed, float(kw.pop("temperature")), latency=latency, **kw)
        return PrefixAwarePolicy(seed, latency=latency, **kw)
    if name == "approximate":
        p = ApproximatePolicy(seed, latency=latency)
        for key, value in kw.items():
            setattr(p.inner, key, value)
        return p
    if name == "sglang-tree":
        return SglangTree(seed, **kw)
    raise SystemExit(f"unknown policy {name!r} (prefix-aware, approximate or sglang-tree)")


_SHARED: tuple[Workload, HashProfile, ClusterConfig] | None = None


def _run(job: tuple[str, int]) -> dict[str, Any]:
    assert _SHARED is not None
    workload, profile, config = _SHARED
    variant, seed = job
    audit = Audit()
    result = simulate(workload, Audited(_policy(variant, seed, config.latency), audit), profile, config,
                      open_index("memory"))
    row = summarize(result)
    out = {"variant": variant, "seed": seed, "hit": row["token_hit_rate"], "p50": row["ttft_p50_s"],
           "p99": row["ttft_p99_s"], "away": sum(audit.away.values()),
           "blocks_lost": sum(audit.blocks_lost.values()), "why": dict(audit.away)}
    print(f"{variant} seed {seed}: hit {out['hit']:.2%}  TTFT p50 {out['p50']:.4f} p99 {out['p99']:.4f}  "
          f"away from best {out['away']} ({out['why']}), held blocks given up {out['blocks_lost']}",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated policy seeds")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--blocks-per-node", type=int, default=ClusterConfig().blocks_per_node)
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's inter-arrival times")
    model = LatencyModel().flags()
    ap.add_argument("--prefill-us-per-token", type=float, default=model["prefill_us_per_token"])
    ap.add_argument("--decode-ms-per-token", type=float, default=model["decode_ms_per_token"])
    ap.add_argument("--flush-at", type=parse_flush, action="append", default=[], metavar="SECONDS:NODE",
                    help="empty a node's GPU prefix cache then (kvcoord simulate's flag; repeatable)")
    a = ap.parse_args()
    global _SHARED
    profile = HashProfile(check_algo("xxhash_cbor"), 16, seed="kvcoord-sim")
    workload = load_mooncake(a.trace, profile, limit=a.limit, time_scale=a.time_scale)
    mean_out = sum(r.output_tokens for r in workload.requests) / len(workload.requests)
    latency = LatencyModel(prefill_s_per_token=a.prefill_us_per_token / 1e6,
                           decode_s_per_token=a.decode_ms_per_token / 1e3, mean_output_tokens=mean_out)
    config = ClusterConfig(nodes=a.nodes, blocks_per_node=a.blocks_per_node, latency=latency,
                           flushes=tuple(a.flush_at))
    _SHARED = (workload, profile, config)
    jobs = [(v, int(s)) for v in a.variants for s in a.seeds.split(",")]
    with multiprocessing.get_context("fork").Pool(max(1, a.jobs)) as pool:
        rows = pool.map(_run, jobs, chunksize=1)
    print("\nvariant | hit (mean) | hit min-max | TTFT p50 (mean) | TTFT p99 (mean) | away from best (sum)"
          " | held blocks given up (sum)")
    for v in a.variants:
        mine = [r for r in rows if r["variant"] == v]
        hits = [r["hit"] for r in mine]

        def mean(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return statistics.mean(float(r[key]) for r in rows)

        print(f"{v} | {statistics.mean(hits):.2%} | {min(hits):.2%}-{max(hits):.2%} | {mean('p50'):.4f} | "
              f"{mean('p99'):.4f} | {sum(r['away'] for r in mine)} | {sum(r['blocks_lost'] for r in mine)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
