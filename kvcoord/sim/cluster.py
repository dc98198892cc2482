"""A simulated cluster: N nodes, each a real :class:`~kvcoord.agent.pool.BlockPool`, whose KV events
feed a real index, and a router that places every request with a :class:`~kvcoord.router.policy.Policy`.

Cost model (per node; :class:`~kvcoord.router.placement.LatencyModel` holds the numbers):

- at most ``max_running`` requests run at once; the rest wait in a FIFO queue. A request is admitted
  when a slot is free *and* its pool can hold its prompt (the queue head blocks the rest, as in vLLM);
- admission looks the prompt up in the node's pool: the leading cached blocks are hits, the rest is
  allocated (evicting least recently used cached blocks) and cached at once, emitting the same
  ``BlockStored``/``BlockRemoved`` events vLLM does. The events go straight to the index;
- prefill is compute bound, so one node prefills one request at a time, FIFO:
  ``prefill = uncached_tokens * prefill_s_per_token``;
- ``TTFT = queue wait (for a slot and for the prefill lane) + prefill``;
  ``completion = TTFT + output_tokens * decode_s_per_token``, after which the request's blocks are
  freed (they stay cached until evicted).

With :attr:`ClusterConfig.tiers`, a node also reloads blocks from its CPU tier, a shared pool or a peer
(:mod:`kvcoord.sim.tiers`) instead of prefilling them, at their cost per block on the prefill lane. With
:attr:`ClusterConfig.pd`, prefill and decode run on separate pools (:mod:`kvcoord.sim.disagg`).

Decode-time KV growth is not allocated (outputs are ~3% of Mooncake prompts), and prefill does not
slow the running decodes. Everything but the measured routing overhead is deterministic.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvcoord.agent.blocks import KVCacheBlock
from kvcoord.agent.pool import BlockPool
from kvcoord.events import KVEvent
from kvcoord.hashing import BlockHash64, HashProfile
from kvcoord.index.base import Index, NodeKey, NodeMatch, run_inline
from kvcoord.load import NodeLoad
from kvcoord.router.placement import LatencyModel, RouteRequest
from kvcoord.router.policy import Policy, candidates_from_matches
from kvcoord.sim.disagg import PdSimConfig, place, pools
from kvcoord.sim.tiers import TierConfig, Tiers
from kvcoord.sim.workload import SimRequest, Workload
from kvcoord.validate import ops_of

_T = TypeVar("_T")

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Shape and speed of the simulated fleet."""

    nodes: int = 8
    blocks_per_node: int = 25_000
    """KV blocks per node (block size from the hash profile): 25k x 16 tokens = 400k tokens, what an
    H100-80GB holds for Llama-3.1-8B next to its weights (128 KiB per token)."""
    latency: LatencyModel = field(default_factory=LatencyModel)
    tiers: TierConfig = field(default_factory=TierConfig)
    """The CPU tiers, shared pool and peer pulls (:mod:`kvcoord.sim.tiers`); none by default."""
    pd: PdSimConfig = field(default_factory=PdSimConfig)
    """Disaggregated prefill and decode pools (:mod:`kvcoord.sim.disagg`); off by default."""
    flushes: tuple[tuple[float, int], ...] = ()
    """``(seconds, node index)``: that node's GPU prefix cache is emptied then (every block's hash dropped,
    with its ``BlockRemoved``, as a cache reset or a restart loses it; its requests run on; a CPU tier takes
    the blocks, as on any GPU eviction). The index sees it; a router's memory of what it sent does not."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("nodes must be >= 1")
        if self.blocks_per_node < 2:
            raise ValueError("blocks per node must be >= 2")
        for at, node in self.flushes:
            if not 0 <= node < self.nodes or not at >= 0:
                raise ValueError(f"a flush at {at:g} s of node {node}: the time must be >= 0 and the node "
                                 f"in 0..{self.nodes - 1}")


class SimBackend:
    """Where the simulated nodes' events go and where the router looks prefixes up (synchronously).

    The simulator calls :meth:`attach` for every node, then :meth:`start`, then, per request,
    :meth:`sync` (make every event applied so far visible to lookups) before timing :meth:`match`.
    """

    def attach(self, node_id: str, pool: BlockPool) -> None:
        """A node and its pool (for snapshots); before :meth:`start`."""

    def start(self) -> None:
        """Connect; after every :meth:`attach`."""

    def apply(self, node_id: str, events: Sequence[KVEvent]) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Block until every event applied so far is visible to :meth:`match`."""

    def match(self, hashes: Sequence[BlockHash64]) -> list[NodeMatch]:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections and loops."""


class IndexAdapter(SimBackend):
    """Synchronous apply/match over an index, through the Index protocol: an ``inline`` backend's
    coroutines run to completion at once, any other's on a private event loop."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.index.inline:
            return run_inline(coro)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def apply(self, node_id: str, events: Sequence[KVEvent]) -> None:
        self._run(self.index.apply(MODEL, node_id, 0, ops_of(events)))

    def match(self, hashes: Sequence[BlockHash64]) -> list[NodeMatch]:
        return self._run(self.index.match(MODEL, hashes))

    def close(self) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self.index.close())
        if self._loop is not None:
            self._loop.close()
            self._loop = None


class _Node:
    __slots__ = (
        "area",
        "hit_tokens",
        "idx",
        "in_system",
        "key",
        "last_change",
        "node_id",
        "pool",
        "prefill_free_at",
        "prefill_tokens",
        "queue",
        "queued_estimate",
        "running",
        "served",
    )

    def __init__(self, idx: int, pool: BlockPool) -> None:
        self.idx = idx
        node_id = f"node-{idx}"
        self.node_id = node_id
        self.key: NodeKey = (node_id, 0)
        self.pool = pool
        self.queue: deque[tuple[SimRequest, int, int, int]] = deque()
        """Waiting requests with the router's estimate of their uncached tokens, the node to pull from
        (its index; -1 none) and their P/D stage (:data:`WHOLE`, :data:`TRANSFERRED`, or the index of
        the decode node a prefill-only request hands over to)."""
        self.queued_estimate = 0
        self.running = 0
        self.prefill_free_at = 0.0
        self.in_system = 0
        self.area = 0.0
        self.last_change = 0.0
        self.served = 0
        self.prefill_tokens = 0
        self.hit_tokens = 0

    def change_in_system(self, now: float, delta: int) -> None:
        self.area += self.in_system * (now - self.last_change)
        self.last_change = now
        self.in_system += delta


@dataclass(slots=True)
class PolicyResult:
    """What one policy did on one workload. ``overhead_*`` are wall clock; everything else is modelled."""

    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    ttft: list[float]
    completion: list[float]
    node_requests: list[int]
    node_prefill_tokens: list[int]
    node_mean_in_system: list[float]
    makespan: float
    overhead_us: list[float]
    sample_decisions: list[str]
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    """Hit tokens by where they came from: ``gpu``, ``cpu`` (evicted from GPU, reloaded), ``pool``,
    ``pull`` (copied from a peer)."""
    pd: dict[str, int] = field(default_factory=dict)
    """P/D runs: ``remote_prefills``, ``skipped_prefills`` (the decode node prefilled alone) and
    ``transferred_blocks`` (prefill node to decode node); empty otherwise."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


_FINISH, _HANDOFF = 0, 1
"""Heap events: a request completes; a remote prefill ends and its request goes to the decode node."""
WHOLE, TRANSFERRED = -1, -2
"""A queued request's stage: all of it on this node; the decode part after a remote prefill."""


Progress = Callable[[int, int], None]
"""Called with (requests routed so far, requests in the workload)."""
PROGRESS_EVERY = 100


def simulate(
    workload: Workload,
    policy: Policy,
    profile: HashProfile,
    config: ClusterConfig,
    index: Index | SimBackend,
    *,
    keep_decisions: int = 5,
    progress: Progress | None = None,
) -> PolicyResult:
    """Replay ``workload`` on a fresh cluster under ``policy``; ``index`` must start empty.

    ``index`` is an index (events applied in process) or a :class:`SimBackend` such as
    :class:`kvcoord.sim.remote.CoordinatorBackend`; either way it is closed at the end. ``progress`` is
    called with (requests routed, requests in all) every ``PROGRESS_EVERY`` requests."""
    adapter = index if isinstance(index, SimBackend) else IndexAdapter(index)
    try:
        bs = profile.block_size
        max_blocks = max((-(-r.num_tokens // bs) for r in workload.requests), default=0)
        if max_blocks > config.blocks_per_node - 1:
            raise ValueError(
                f"a prompt needs {max_blocks} blocks but a node has {config.blocks_per_node - 1}; "
                "raise --blocks-per-node"
            )
        return _simulate(workload, policy, profile, config, adapter, keep_decisions, progress)
    finally:
        adapter.close()


class _Run:
    """One replay's mutable state: the nodes, the finish-event heap and the running totals.

    A class rather than closures in one long function, so admission (:meth:`try_start`), completion
    (:meth:`finish`) and the load report (:meth:`loads`) can be read, and tested, one at a time."""

    __slots__ = (
        "adapter", "bs", "completion", "heap", "hit_total", "max_running", "nodes", "pd", "prefill_total",
        "prompt_total", "seq", "t_d", "t_p", "tier_hits", "tiers", "transfer_s", "ttft",
    )

    def __init__(self, nodes: list[_Node], adapter: SimBackend, lat: LatencyModel, bs: int,
                 tiers: Tiers | None = None, transfer_s: float | None = None) -> None:
        self.nodes = nodes
        self.transfer_s = transfer_s or 0.0
        self.pd = ({"remote_prefills": 0, "skipped_prefills": 0, "transferred_blocks": 0}
                   if transfer_s is not None else {})
        """P/D counters (``transfer_s`` given: disaggregated); empty otherwise."""
        self.tiers = tiers
        self.tier_hits = {"gpu": 0, "cpu": 0, "pool": 0, "pull": 0}
        self.adapter = adapter
        self.bs = bs
        self.t_p, self.t_d = lat.prefill_s_per_token, lat.decode_s_per_token
        self.max_running = lat.max_running
        self.heap: list[tuple[float, int, int, int, list[KVCacheBlock] | SimRequest]] = []
        self.seq = 0
        self.ttft: list[float] = []
        self.completion: list[float] = []
        self.hit_total = self.prefill_total = self.prompt_total = 0

    def try_start(self, node: _Node, now: float) -> None:
        """Admit queued requests on ``node`` while a slot is free and the queue head's prompt fits."""
        pool, bs, t_p, t_d = node.pool, self.bs, self.t_p, self.t_d
        while node.queue and node.running < self.max_running:
            req, estimate, peer, stage = node.queue[0]
            n = req.num_tokens
            hits = pool.find_longest_cache_hit(req.digests, (n - 1) // bs)
            num_new = -(-n // bs) - len(hits)
            evictable = sum(1 for b in hits if b.ref_cnt == 0)
            if num_new + evictable > pool.num_free_blocks:
                return  # the head waits for blocks to be freed, and so does everything behind it
            node.queue.popleft()
            node.queued_estimate -= estimate
            pool.touch(hits)
            blocks = hits + pool.get_new_blocks(num_new)
            pool.cache_full_blocks(blocks, req.digests, len(hits), n // bs, req.tokens)
            if stage == TRANSFERRED:
                start, uncached = self.transferred(node, req, len(hits), now)
                loaded_s = 0.0
            else:
                loaded_s, past = self.beyond(node, req, len(hits), peer)
                cached = (len(hits) + past) * bs
                uncached = n - cached
                node.hit_tokens += cached
                node.prefill_tokens += uncached
                self.hit_total += cached
                self.prefill_total += uncached
                start = max(now, node.prefill_free_at)
            self.publish(node.node_id, pool.take_events())
            node.running += 1
            end = start + uncached * t_p + loaded_s
            node.prefill_free_at = end
            self.seq += 1
            if stage >= 0:  # a remote prefill: its one token done, the decode node takes the request
                heapq.heappush(self.heap, (end, self.seq, _FINISH, node.idx, blocks))
                self.seq += 1
                heapq.heappush(self.heap, (end, self.seq, _HANDOFF, stage, req))
                continue
            self.ttft.append(end - req.arrival)
            done = end + req.output_tokens * t_d
            self.completion.append(done - req.arrival)
            heapq.heappush(self.heap, (done, self.seq, _FINISH, node.idx, blocks))

    def transferred(self, node: _Node, req: SimRequest, hits: int, now: float) -> tuple[float, int]:
        """The decode part of a remotely prefilled request on ``node``, which holds ``hits`` of its blocks:
        it pulls the rest of the prompt's blocks but the last (vLLM's decode computes the last token),
        then computes what is left. ``(when its compute starts, tokens it computes)``."""
        moved = max(0, (req.num_tokens - 1) // self.bs - hits)
        self.pd["transferred_blocks"] += moved
        start = max(now + moved * self.transfer_s, node.prefill_free_at)
        return start, req.num_tokens - (hits + moved) * self.bs

    def publish(self, node_id: str, events: list[KVEvent]) -> None:
        """A node's GPU events to the index, with its CPU tier's and the pool's (:meth:`Tiers.published`)."""
        if not events:
            return
        if self.tiers is None:
            self.adapter.apply(node_id, events)
            return
        for where, batch in self.tiers.published(node_id, events).items():
            self.adapter.apply(where, batch)

    def beyond(self, node: _Node, req: SimRequest, gpu: int, peer: int) -> tuple[float, int]:
        """Blocks past the GPU hit that ``node`` loads (CPU tier, pool) or pulls from ``peer`` instead of
        prefilling, counted per source: ``(seconds the loads take, blocks)``."""
        self.tier_hits["gpu"] += gpu * self.bs
        tiers = self.tiers
        if tiers is None:
            return 0.0, 0
        limit = (req.num_tokens - 1) // self.bs
        cpu, pooled = tiers.extend(node.node_id, req.hashes, gpu, limit)
        pulled = 0
        if peer >= 0 and tiers.config.pull_s is not None:
            held = len(self.nodes[peer].pool.find_longest_cache_hit(req.digests, limit))
            pulled = max(0, held - gpu - cpu - pooled)
        cfg = tiers.config
        for key, blocks in (("cpu", cpu), ("pool", pooled), ("pull", pulled)):
            self.tier_hits[key] += blocks * self.bs
        seconds = cpu * cfg.cpu_reload_s + pooled * cfg.pool_load_s + pulled * (cfg.pull_s or 0.0)
        return seconds, cpu + pooled + pulled

    def finish(self, node: _Node, now: float, blocks: list[KVCacheBlock]) -> None:
        """A request on ``node`` completes: free its blocks (they stay cached) and admit the next."""
        node.pool.free_blocks(reversed(blocks))
        node.running -= 1
        node.change_in_system(now, -1)
        self.try_start(node, now)

    def flush(self, node: _Node) -> None:
        """Empty ``node``'s GPU prefix cache (:attr:`ClusterConfig.flushes`)."""
        node.pool.evict_blocks(b.block_id for b in node.pool.blocks if b.block_hash is not None)

    def finish_until(self, until: float, now: float) -> float:
        """Complete every request done by ``until``; the time of the last one (``now`` if none)."""
        heap, nodes = self.heap, self.nodes
        while heap and heap[0][0] <= until:
            now, _, kind, ni, what = heapq.heappop(heap)
            if kind == _HANDOFF:
                assert isinstance(what, SimRequest)
                self.enqueue(nodes[ni], what, (what.num_tokens - 1) // self.bs, now, stage=TRANSFERRED)
            else:
                assert isinstance(what, list)
                self.finish(nodes[ni], now, what)
        return now

    def loads(self, now: float) -> dict[NodeKey, NodeLoad]:
        """What each node would report to the router at ``now``."""
        t_p = self.t_p
        return {
            nd.key: NodeLoad(
                running_requests=nd.running,
                waiting_requests=len(nd.queue),
                kv_usage=nd.pool.usage,
                prefill_tokens=int(max(0.0, nd.prefill_free_at - now) / t_p if t_p > 0 else 0)
                + nd.queued_estimate,
            )
            for nd in self.nodes
        }

    def enqueue(self, node: _Node, req: SimRequest, matched_blocks: int, now: float, peer: int = -1,
                stage: int = WHOLE) -> None:
        """The router sent ``req`` to ``node`` (to pull from node ``peer``, -1 none; its ``stage``): queue
        it with its estimated uncached tokens."""
        node.served += 1
        node.change_in_system(now, +1)
        estimate = max(0, req.num_tokens - matched_blocks * self.bs)
        node.queue.append((req, estimate, peer, stage))
        node.queued_estimate += estimate
        self.try_start(node, now)

    def result(self, policy: str, requests: int, now: float, overhead: list[float],
               decisions: list[str]) -> PolicyResult:
        """Close the in-system integrals at the makespan and gather the totals."""
        nodes = self.nodes
        stuck = [nd.node_id for nd in nodes if nd.queue]
        if stuck:
            raise RuntimeError(f"requests never admitted on {stuck}")
        span = max(now, 1e-9)
        for nd in nodes:
            nd.change_in_system(span, 0)
        return PolicyResult(
            policy=policy,
            requests=requests,
            prompt_tokens=self.prompt_total,
            hit_tokens=self.hit_total,
            prefill_tokens=self.prefill_total,
            ttft=self.ttft,
            completion=self.completion,
            node_requests=[nd.served for nd in nodes],
            node_prefill_tokens=[nd.prefill_tokens for nd in nodes],
            node_mean_in_system=[nd.area / span for nd in nodes],
            makespan=span,
            overhead_us=overhead,
            sample_decisions=decisions,
            tier_hit_tokens=dict(self.tier_hits),
            pd=dict(self.pd),
        )


def _simulate(
    workload: Workload,
    policy: Policy,
    profile: HashProfile,
    config: ClusterConfig,
    adapter: SimBackend,
    keep_decisions: int,
    progress: Progress | None,
) -> PolicyResult:
    bs = profile.block_size
    nodes = [
        _Node(i, BlockPool(config.blocks_per_node, profile, removal_events="vllm"))
        for i in range(config.nodes)
    ]
    for nd in nodes:
        adapter.attach(nd.node_id, nd.pool)
    adapter.start()
    tiers = Tiers(config.tiers, [nd.node_id for nd in nodes], bs) if config.tiers.active else None
    pd = pools(config.pd, [nd.node_id for nd in nodes])
    run = _Run(nodes, adapter, config.latency, bs, tiers, config.pd.transfer_s if pd is not None else None)
    overhead: list[float] = []
    decisions: list[str] = []
    uses_index = policy.uses_index
    by_key = {nd.key: nd for nd in nodes}
    by_id = {nd.node_id: nd for nd in nodes}
    now = 0.0
    total = len(workload.requests)
    flushes = sorted(config.flushes, reverse=True)
    for routed, req in enumerate(workload.requests):
        if progress is not None and routed % PROGRESS_EVERY == 0:
            progress(routed, total)
        while flushes and flushes[-1][0] <= req.arrival:
            at, ni = flushes.pop()
            run.finish_until(at, now)
            run.flush(nodes[ni])
        run.finish_until(req.arrival, now)
        now = req.arrival
        run.prompt_total += req.num_tokens
        node_loads = run.loads(now)
        route = RouteRequest(req.num_tokens, bs, req.hashes, now, req.request_id)
        adapter.sync()
        t0 = time.perf_counter()
        matches = adapter.match(req.hashes) if uses_index else []
        if tiers is not None and uses_index:
            candidates = tiers.candidates(node_loads, matches, req.hashes, adapter.match)
        else:
            candidates = candidates_from_matches(node_loads, matches)
        decision, prefill = (policy.choose(route, candidates), None) if pd is None else \
            place(pd, policy, route, candidates)
        overhead.append((time.perf_counter() - t0) * 1e6)
        if len(decisions) < keep_decisions:
            decisions.append(f"{req.request_id}: {decision.why}"
                             + (f"; prefill: {prefill.why}" if prefill is not None else ""))
        if pd is not None:
            run.pd["remote_prefills" if prefill is not None else "skipped_prefills"] += 1
        first = prefill or decision
        puller = by_id.get(first.pull.rpartition(":")[0]) if first.pull else None  # "node-i:8000"
        peer = puller.idx if puller is not None else -1
        stage = by_key[decision.key].idx if prefill is not None else WHOLE
        run.enqueue(by_key[first.key], req, first.matched_blocks, now, peer, stage)
    now = run.finish_until(math.inf, now)
    return run.result(policy.name, total, now, overhead, decisions)
