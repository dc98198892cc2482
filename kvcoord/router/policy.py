"""Placement policies: pick a ``(node, dp_rank)`` for a request from a lookup answer and node loads.

A policy sees one :class:`RouteRequest` (prompt length, block hashes, the clock) and one
:class:`Candidate` per routable ``(node, dp_rank)``: how many leading blocks of the prompt that node
holds (per tier, from the coordinator's lookup) and its current load. It returns a
:class:`Decision` whose ``why`` explains the choice in one line, so an operator can audit a route.

Policies:

- :class:`PrefixAwarePolicy`: minimises the expected time to first token (formula in its docstring),
  with a load-imbalance cap so that a shared prefix cannot pull the whole fleet onto one node.
- :class:`ApproximatePolicy`: the same cost over the router's own memory of what it routed where
  (a TTL'd prefix map), for fleets whose engines publish no KV events.
- Baselines: :class:`RoundRobinPolicy`, :class:`LeastLoadedPolicy`, :class:`RandomPolicy`.

Every policy owns a seedable ``random.Random`` (tie-breaks): a fixed seed, the same decisions every run.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import ClassVar, Protocol

from kvcoord.events import DEFAULT_TIER_WEIGHTS, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey, NodeMatch
from kvcoord.load import APPROXIMATE, DEGRADED, HISTORY_LOST, NodeLoad
from kvcoord.router.answer import Candidate, LookupResult
from kvcoord.router.memory import PlacementMemory, RoutedPrefixMemory
from kvcoord.router.placement import (
    Decision,
    LatencyModel,
    RouteRequest,
)


class Policy(Protocol):
    """A placement policy. ``uses_index`` says whether candidates need the index's prefix matches."""

    name: str
    uses_index: ClassVar[bool]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of ``candidates`` (non-empty). May update the policy's own state."""
        ...


def candidates_from_matches(
    loads: Mapping[NodeKey, NodeLoad], matches: Sequence[NodeMatch]
) -> list[Candidate]:
    """One candidate per routable node in ``loads``, with its match (zero when the index omitted it).

    Matches for nodes not in ``loads`` (not routable, e.g. draining) are dropped.
    """
    by_key = {(m.node_id, m.dp_rank): m for m in matches}
    out: list[Candidate] = []
    for key, load in loads.items():
        m = by_key.get(key)
        if m is None:
            out.append(Candidate(key[0], key[1], 0, (), load))
        else:
            out.append(Candidate(key[0], key[1], m.matched_blocks, m.tiers, load))
    return out


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("no candidate nodes to route to")


def _name(c: Candidate) -> str:
    return c.node_id if c.dp_rank == 0 else f"{c.node_id}/{c.dp_rank}"


def _in_key_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """By ``(node_id, dp_rank)``: what seeded picks index, so they ignore the answer's order."""
    return sorted(candidates, key=lambda c: c.key)


def _held_on_gpu(c: Candidate, blocks: int) -> Candidate:
    """``c`` holding ``blocks`` leading blocks, all on GPU: how blocks a router believes are there (routed
    there, reserved, remembered) count, whatever the index reported."""
    return replace(c, matched_blocks=blocks, tiers=(blocks,))


class _Seeded:
    """A policy's own seedable ``random.Random``, so that a fixed seed makes the same decisions every run."""

    name: str
    uses_index: ClassVar[bool] = False

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def _pick(self, ties: Sequence[Candidate]) -> Candidate:
        """One of ``ties`` (in key order) at random; the source is drawn from only when there is a choice."""
        return ties[self.rng.randrange(len(ties))] if len(ties) > 1 else ties[0]


class RoundRobinPolicy(_Seeded):
    """Cycles through candidates in ``(node_id, dp_rank)`` order; ignores cache and load."""

    name = "round-robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _require(candidates)
        c = _in_key_order(candidates)[self._next % len(candidates)]
        self._next += 1
        return Decision(c.node_id, c.dp_rank, f"round-robin: turn {self._next - 1} -> {_name(c)}")


class RandomPolicy(_Seeded):
    """Uniformly random candidate from the seeded source (drawn from even for a single candidate)."""

    name = "random"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _require(candidates)
        c = _in_key_order(candidates)[self.rng.randrange(len(candidates))]
        return Decision(c.node_id, c.dp_rank, f"random: {_name(c)} of {len(candidates)}")


class LeastLoadedPolicy(_Seeded):
    """Fewest requests in flight (running + waiting); ties broken at random so no node is favoured."""

    name = "least-loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _require(candidates)
        low = min(c.load.in_flight for c in candidates)
        ties = _in_key_order(c for c in candidates if c.load.in_flight == low)
        c = self._pick(ties)
        return Decision(
            c.node_id,
            c.dp_rank,
            f"least-loaded: {_name(c)} has {low} in flight ({len(ties)} tied)",
            c.matched_blocks,
        )


DEGRADED_WEIGHT = 0.5
"""What ``degraded="discount"`` counts the matched blocks of a candidate whose hashes failed verification
at, by default."""


def _suspect(c: Candidate) -> bool:
    """Whether ``c``'s matches may be wrong: degraded, unless by lost history alone (missing blocks,
    real matches). A coordinator that predates ``trust_cause`` sends none: taken as a mismatch."""
    return c.trust == DEGRADED and c.trust_cause != HISTORY_LOST


class PrefixAwarePolicy(_Seeded):
    """Minimise expected time to first token, without hot-spotting a shared prefix.

    For a prompt of ``T`` tokens in blocks of ``B`` tokens, candidate ``n`` holding ``g_n``, ``c_n``,
    ``s_n`` leading blocks on GPU, CPU and storage, with load ``L_n``::

        saved_n   = min(T, B * (w_gpu * g_n + w_cpu * c_n + w_sto * s_n))     # prefill tokens saved
        cost_n    = k * t_p * (T - saved_n)                                    # its own prefill
                  + t_p * L_n.prefill_tokens                                   # prefill queued ahead
                  + t_d * out * max(0, running_n + waiting_n + 1 - R) / R       # wait for a free slot

    with tier weights ``w`` (default 1.0 / 0.8 / 0.5: the fraction of a block's prefill a hit saves),
    ``t_p``/``t_d`` the prefill/decode seconds per token, ``out`` the expected output length and
    ``R`` the node's max running requests (:class:`LatencyModel`). Cache benefit and load are both
    in seconds. ``k`` (``work_weight``, default 12) counts the prefill a request causes more than once: for
    its own TTFT, for the delay it adds to the requests queued behind it, and for the cache it costs (each
    recomputed block evicts a block a later request would hit). At ``k = 1`` the policy gives up a hit as
    soon as the holder is marginally busier, duplicating prefixes and lowering the fleet's hit rate.
    **A miss** (no candidate saves ``cache_threshold``, default 10%, of the prompt) has ``k = 1``: else a
    sliver of a shared prefix pulls new conversations onto one node, whose cache then churns fastest (a busy
    simulated fleet: 15.0% hit rate at ``k = 12``, 12.4% at 50 without this, 14.9-15.1% at 12-100 with
    it). ``k = 12`` reaches SGLang's tree's hit rate in the router benchmark's fleet (12.59% against
    12.66%; ``k = 4``: 12.36%) at 0.7-0.9x its TTFT (docs/simulate.md, "SGLang's tree, simulated").

    Hot-spotting guards (ties are common, e.g. a system prompt every node holds; the load term decides
    them; these handle the rest):

    1. **Balance cap** (like SGLang's cache-aware router thresholds): a node whose in-flight count
       exceeds ``balance_rel * min + balance_abs`` (min over candidates) is not eligible, whatever it
       holds. This bounds max/min in-flight imbalance under any prefix popularity.
    2. **Replication**: when the holder of a hot prefix is loaded, the queue term makes a less-loaded
       node cheaper even though it must recompute the prefix; that node then caches it too, and the
       prefix is spread across the fleet in proportion to its demand. ``why`` says when this happens.
    3. **Random tie-break** among equal costs (seeded), so equal nodes share the work evenly.

    **In-flight placements** (the index's blind spot): the router remembers, in a bounded LRU of
    ``affinity_entries`` chain checkpoints (every ``affinity_stride`` blocks plus the last block of
    each prompt), which node it last sent each prefix to and when that node should have reported it
    (``now`` + the expected queue wait and prefill). Until then the placement counts as held on that
    node (queued there, or its events still on the wire), so a burst of requests sharing a new
    prefix does not scatter and recompute it everywhere. It is consulted only when it remembers a
    longer prefix than the index shows on any node (a system prompt every node holds never pins
    anything) and the balance cap applies to it like to any hit. After the horizon the index is
    authoritative: no "session affinity" bonus for a node that evicted the prefix (-0.2 points on the
    Mooncake trace: the node that evicted a session is the one whose cache churns fastest).

    **Other routers' placements** (and this one's, at block granularity) come with the lookup answer as
    ``reserved_blocks`` (docs/routing.md, "Routers that share one view") and count as held the same way.

    **Degraded nodes** whose hashes failed verification (``trust`` ``degraded``, ``trust_cause``
    ``hash_mismatch`` or unknown), so their matches may be wrong, per ``degraded``: ``"discount"``
    (default) counts its matched blocks at ``degraded_weight`` (0.5), ``"ignore"`` treats it as holding
    nothing (it stays a candidate, chosen on load), ``"trust"`` takes its matches as exact. A node
    degraded by lost history (``history_lost``) lacks some blocks but every match is real: counted in full.

    **Approximate nodes** (``trust`` ``approximate``: the engine publishes no KV events, so the index's
    zero says nothing) are matched against what this router sent them within ``approximate_ttl`` s
    (:class:`RoutedPrefixMemory`, as :class:`ApproximatePolicy` does for every node), so a fleet that
    mixes engines with and without KV events still keeps conversations where their prefixes are.
    """

    name = "prefix-aware"
    uses_index: ClassVar[bool] = True

    def __init__(
        self,
        seed: int | None = None,
        *,
        latency: LatencyModel | None = None,
        tier_weights: tuple[float, float, float] = DEFAULT_TIER_WEIGHTS,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
        affinity_entries: int = 65_536,
        affinity_stride: int = 32,
        degraded: str = "discount",
        degraded_weight: float = DEGRADED_WEIGHT,
        approximate_ttl: float = 120.0,
        routed_only: bool = False,
    ) -> None:
        if degraded not in DEGRADED_MODES:
            raise ValueError(f"degraded must be one of {', '.join(DEGRADED_MODES)}, got {degraded!r}")
        if not 0.0 <= degraded_weight <= 1.0:
            raise ValueError(f"degraded_weight must be in [0, 1], got {degraded_weight}")
        if affinity_entries < 0 or affinity_stride < 1:
            raise ValueError("affinity_entries must be >= 0 and affinity_stride >= 1")
        if any(not 0.0 <= w <= 1.0 for w in tier_weights) or len(tier_weights) != 3:
            raise ValueError(f"tier weights must be three numbers in [0, 1], got {tier_weights}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")
        super().__init__(seed)
        self.latency = latency or LatencyModel()
        self.tier_weights = tier_weights
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.memory = PlacementMemory(affinity_entries, affinity_stride)
        self.degraded = degraded
        self.degraded_weight = {"discount": degraded_weight, "ignore": 0.0, "trust": 1.0}[degraded]
        """What a degraded candidate's matched blocks count for."""
        self.routed = RoutedPrefixMemory(approximate_ttl)
        """What this router sent to approximate nodes (every node, ``routed_only``), written when one is
        chosen."""
        self.routed_only = routed_only
        """Every node's matches are what :attr:`routed` says (the index's are ignored): the cost model of
        :class:`ApproximatePolicy`, whose ``why`` it writes."""

    def saved_tokens(self, request: RouteRequest, c: Candidate) -> float:
        g, cpu, sto = c.tier_counts()
        w = self.tier_weights
        held = w[0] * g + w[1] * cpu + w[2] * sto
        pooled = c.pool_blocks()
        if pooled:  # a shared pool's blocks past the node's own run, at the pool tier's weight
            held += w[Tier[c.pool_tier].value if c.pool_tier in Tier.__members__ else Tier.STORAGE] * pooled
        if _suspect(c):
            held *= self.degraded_weight
        return min(float(request.num_tokens), request.block_size * held)

    def cost(self, request: RouteRequest, c: Candidate, weight: float) -> float:
        """The placement cost of ``c`` in seconds (the formula in the class docstring): the predicted TTFT
        with the request's own prefill counted ``weight`` times (:meth:`weight`)."""
        left = request.num_tokens - self.saved_tokens(request, c)
        return weight * self.latency.prefill_s_per_token * left + self.latency.queue_seconds(c.load)

    def weight(self, request: RouteRequest, counted: Sequence[Candidate]) -> float:
        """The request's ``k``: ``work_weight`` when one of ``counted`` (:meth:`counted`'s, in
        :meth:`choose`) saves at least ``cache_threshold`` of the prompt, else 1 (a miss, placed for its own
        TTFT)."""
        lat = self.latency
        top = max((self.saved_tokens(request, c) for c in counted), default=0.0)
        return lat.work_weight if top >= lat.cache_threshold * request.num_tokens else 1.0

    def ttft(self, request: RouteRequest, c: Candidate) -> float:
        """Predicted time to first token on ``c`` in seconds: the queue ahead plus the prefill of what ``c``
        lacks, counted once (what a TTFT SLO is checked against)."""
        left = request.num_tokens - self.saved_tokens(request, c)
        return self.latency.prefill_s_per_token * left + self.latency.queue_seconds(c.load)

    def balance_cap(self, candidates: Sequence[Candidate]) -> float:
        """The most requests in flight an eligible node may have (guard 1 in the class docstring)."""
        return self.balance_rel * min(c.load.in_flight for c in candidates) + self.balance_abs

    def counted(self, request: RouteRequest,
                candidates: Sequence[Candidate]) -> tuple[Sequence[Candidate], str]:
        """``candidates`` holding what this policy counts them as holding, and the ``why`` notes on it:
        degraded nodes per ``degraded``, approximate nodes (every node, ``routed_only``) what this router
        routed them, and placements not reported yet (reserved, or this router's own in flight) on GPU."""
        if self.degraded == "ignore":
            # Held nothing, as far as this decision (and its explanation) goes.
            candidates = [replace(c, matched_blocks=0, tiers=()) if _suspect(c) else c
                          for c in candidates]
        guessed = [c.key for c in candidates if self.routed_only or c.trust == APPROXIMATE]
        if guessed:
            believed = self.routed.match(request.block_hashes, request.now, guessed)
            candidates = [_held_on_gpu(c, believed[c.key]) if c.key in believed else c for c in candidates]
        candidates, notes = reserved_as_held(candidates)
        recalled = self.memory.recall(request.block_hashes)
        if (
            recalled is not None
            and request.now < recalled.ready_at
            and recalled.depth > max(c.matched_blocks for c in candidates)
        ):
            # Routed there, not reported yet: count it as held (on GPU) on that node.
            age = request.now - recalled.placed_at
            candidates = [_held_on_gpu(c, recalled.depth) if c.key == recalled.key else c for c in candidates]
            notes += f"; {recalled.depth} blocks in flight to {recalled.key[0]} (routed {age:.2f} s ago)"
        return candidates, notes

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _require(candidates)
        candidates, notes = self.counted(request, candidates)
        cap = self.balance_cap(candidates)
        k = self.weight(request, candidates)
        eligible = [c for c in candidates if c.load.in_flight <= cap]
        scored = sorted(((self.cost(request, c, k), c.key, c) for c in eligible), key=lambda t: (t[0], t[1]))
        best_cost = scored[0][0]
        ties = [c for cost, _, c in scored if cost <= best_cost * (1 + 1e-9) + 1e-12]
        chosen = self._pick(ties)
        saved = self.saved_tokens(request, chosen)
        queue = self.latency.queue_seconds(chosen.load)
        label = f"approximate (routed-prefix memory, ttl {self.routed.ttl:g}s)" if self.routed_only \
            else "prefix-aware"
        why = (
            f"{label}: {_name(chosen)} saves {saved:.0f}/{request.num_tokens} tokens "
            f"({chosen.matched_blocks} blocks), cost {best_cost * 1e3:.1f} ms = prefill "
            f"{(best_cost - queue) * 1e3:.1f} + queue {queue * 1e3:.1f}"
        )
        why += notes
        if k < self.latency.work_weight:
            why += (f"; a miss (no node holds {self.latency.cache_threshold:.0%} of the prompt): placed for "
                    "its own TTFT")
        if _suspect(chosen) and self.degraded != "ignore":
            why += (f"; {_name(chosen)} is degraded (its hashes failed verification), its blocks counted "
                    f"at {self.degraded_weight:g}")
        elif chosen.trust == DEGRADED and chosen.trust_cause == HISTORY_LOST:
            why += (f"; {_name(chosen)} is degraded (lost history: some blocks missing), its matches are "
                    "real and counted in full")
        elif chosen.trust == APPROXIMATE and not self.routed_only:
            why += f"; {_name(chosen)} publishes no KV events: its blocks are what this router sent it"
        if self.routed_only or chosen.trust == APPROXIMATE:
            self.routed.record(chosen.key, request.block_hashes, request.now)
        if len(ties) > 1:
            why += f"; {len(ties)} tied, picked at random"
        top = max(_in_key_order(candidates), key=lambda c: c.matched_blocks)
        if top.matched_blocks > chosen.matched_blocks:
            if top.load.in_flight > cap:
                why += (
                    f"; replicating: best holder {_name(top)} ({top.matched_blocks} blocks) over the balance "
                    f"cap ({top.load.in_flight} in flight > {cap:.1f})"
                )
            else:
                busier = (f"is degraded, its blocks counted at {self.degraded_weight:g}"
                          if _suspect(top) and self.degraded_weight < 1 else "is busier")
                why += (
                    f"; replicating: best holder {_name(top)} ({top.matched_blocks} blocks) {busier} "
                    f"(cost {self.cost(request, top, k) * 1e3:.1f} ms)"
                )
        own = self.latency.prefill_s_per_token * (request.num_tokens - saved)
        self.memory.record(request.block_hashes, chosen.key, request.now, request.now + queue + own)
        # A peer pull is the index's hint: a router placing on its own memory names none.
        pull, pulled = ("", 0) if self.routed_only else self.latency.pull(request, chosen)
        if pull:
            why += f"; pull {pulled} blocks from {chosen.pull.node_id if chosen.pull else pull} ({pull})"
        return Decision(chosen.node_id, chosen.dp_rank, why, chosen.matched_blocks, best_cost, pull, pulled)


def reserved_as_held(candidates: Sequence[Candidate]) -> tuple[Sequence[Candidate], str]:
    """``candidates`` with the blocks routers reserved on each (routed there, not reported by its events
    yet) counted as held there (on GPU), like this router's own in-flight placements, and the ``why`` note
    that names the deepest ("" when none counts)."""
    if not any(c.reserved_blocks > c.matched_blocks for c in candidates):
        return candidates, ""
    top = max((c for c in candidates if c.reserved_blocks > c.matched_blocks),
              key=lambda c: (c.reserved_blocks, c.key))
    out = [_held_on_gpu(c, c.reserved_blocks) if c.reserved_blocks > c.matched_blocks else c
           for c in candidates]
    return out, f"; {top.reserved_blocks} blocks reserved on {_name(top)} (routed, not reported yet)"


DEGRADED_MODES: tuple[str, ...] = ("discount", "ignore", "trust")
"""How :class:`PrefixAwarePolicy` counts the matches of a candidate whose hashes failed verification."""


class ApproximatePolicy:
    """Prefix-aware cost over the router's own routing memory instead of the index (no KV events).

    The matches in the candidates are ignored; each candidate's match is what
    :class:`RoutedPrefixMemory` says this router sent there within ``ttl``, counted as GPU blocks, and
    the decision is recorded in that memory: a :class:`PrefixAwarePolicy` with ``routed_only``.
    """

    uses_index: ClassVar[bool] = False

    def __init__(
        self,
        seed: int | None = None,
        *,
        ttl: float = 120.0,
        latency: LatencyModel | None = None,
        tier_weights: tuple[float, float, float] = DEFAULT_TIER_WEIGHTS,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
    ) -> None:
        self.name = "approximate"
        self.inner = PrefixAwarePolicy(
            seed,
            latency=latency,
            tier_weights=tier_weights,
            balance_abs=balance_abs,
            balance_rel=balance_rel,
            affinity_entries=0,  # its routed-prefix memory already is a placement memory
            approximate_ttl=ttl,
            routed_only=True,
        )
        self.rng = self.inner.rng
        self.memory = self.inner.routed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return self.inner.choose(request, candidates)


POLICY_NAMES: tuple[str, ...] = ("prefix-aware", "approximate", "least-loaded", "round-robin", "random")


def make_policy(
    name: str,
    seed: int | None = None,
    *,
    latency: LatencyModel | None = None,
    tier_weights: tuple[float, float, float] = DEFAULT_TIER_WEIGHTS,
    ttl: float = 120.0,
    degraded: str = "discount",
) -> Policy:
    """Build a policy by name (one of ``POLICY_NAMES``). ``degraded`` (one of ``DEGRADED_MODES``): how
    prefix-aware counts the matches of nodes in trust state ``degraded``; the other policies ignore it."""
    if name == "prefix-aware":
        return PrefixAwarePolicy(seed, latency=latency, tier_weights=tier_weights, degraded=degraded)
    if name == "approximate":
        return ApproximatePolicy(seed, ttl=ttl, latency=latency, tier_weights=tier_weights)
    if name == "least-loaded":
        return LeastLoadedPolicy(seed)
    if name == "round-robin":
        return RoundRobinPolicy(seed)
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")


def place(answer: LookupResult, policy: Policy | None = None, *, now: float = 0.0,
          block_hashes: Sequence[BlockHash64] = (), degraded: str | None = None) -> Decision:
    """Where to send the request ``answer`` is the lookup of: ``policy`` (default: prefix-aware) over the
    answer's nodes. Ask the lookup with ``include_unmatched=True`` so that idle nodes holding nothing are
    candidates too; raises ``ValueError`` when the answer names no node at all. ``degraded`` (one of
    ``DEGRADED_MODES``) configures the default policy; a policy passed in has its own setting.
    ``block_hashes`` (default: the answer's, asked with ``want_block_hashes=True``) key the policy's
    memories of its own placements."""
    if policy is not None and degraded is not None:
        raise ValueError("degraded configures the default policy: give it to the policy you pass instead")
    num_tokens = answer.num_tokens or answer.num_blocks * answer.block_size
    request = RouteRequest(num_tokens, max(1, answer.block_size), block_hashes or answer.block_hashes, now)
    return (policy or PrefixAwarePolicy(degraded=degraded or "discount")).choose(request, answer.nodes)
