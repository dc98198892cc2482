"""Placement policies on hand-built lookup answers and loads."""

from __future__ import annotations

import pytest

from kvcoord.events import Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeMatch
from kvcoord.load import HASH_MISMATCH, HISTORY_LOST, NodeLoad
from kvcoord.router.answer import Candidate, LookupResult
from kvcoord.router.memory import PlacementMemory, RoutedPrefixMemory
from kvcoord.router.placement import DEFAULT_WORK_WEIGHT, LatencyModel, RouteRequest
from kvcoord.router.policy import (
    POLICY_NAMES,
    ApproximatePolicy,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RandomPolicy,
    RoundRobinPolicy,
    candidates_from_matches,
    make_policy,
    place,
)

BS = 16


def req(tokens: int, hashes: int = 0, now: float = 0.0) -> RouteRequest:
    return RouteRequest(tokens, BS, [BlockHash64(1000 + i) for i in range(hashes)], now)


def nodes(n: int, **loads: NodeLoad) -> list[Candidate]:
    return [Candidate(f"n{i}", 0, 0, (), loads.get(f"n{i}", NodeLoad())) for i in range(n)]


def test_round_robin_cycles_in_key_order_and_ignores_cache() -> None:
    p = RoundRobinPolicy(seed=1)
    cands = list(reversed(nodes(3)))
    cands[0] = Candidate("n2", 0, 100, (), NodeLoad())
    picks = [p.choose(req(64), cands).node_id for _ in range(6)]
    assert picks == ["n0", "n1", "n2", "n0", "n1", "n2"]


def test_random_is_reproducible_from_its_seed_and_covers_nodes() -> None:
    a = [RandomPolicy(seed=7).choose(req(64), nodes(4)).node_id for _ in range(1)]
    p1, p2 = RandomPolicy(seed=7), RandomPolicy(seed=7)
    s1 = [p1.choose(req(64), nodes(4)).node_id for _ in range(50)]
    s2 = [p2.choose(req(64), nodes(4)).node_id for _ in range(50)]
    assert s1 == s2 and s1[0] == a[0]
    assert set(s1) == {"n0", "n1", "n2", "n3"}


def test_least_loaded_picks_fewest_in_flight_and_breaks_ties_at_random() -> None:
    p = LeastLoadedPolicy(seed=3)
    cands = nodes(3, n0=NodeLoad(running_requests=4), n1=NodeLoad(running_requests=1, waiting_requests=1),
                  n2=NodeLoad(running_requests=1))
    d = p.choose(req(64), cands)
    assert d.node_id == "n2" and "1 in flight" in d.why
    tied = nodes(4)
    assert {LeastLoadedPolicy(seed=s).choose(req(64), tied).node_id for s in range(20)} == {
        "n0", "n1", "n2", "n3"
    }


def test_prefix_aware_prefers_the_longest_hit_at_equal_load() -> None:
    p = PrefixAwarePolicy(seed=0)
    cands = nodes(4)
    cands[1] = Candidate("n1", 0, 10, (10, 0, 0), NodeLoad())
    cands[3] = Candidate("n3", 0, 60, (60, 0, 0), NodeLoad())
    d = p.choose(req(64 * BS), cands)
    assert d.key == ("n3", 0) and d.matched_blocks == 60
    assert "saves 960/1024 tokens" in d.why
    assert d.cost == pytest.approx(DEFAULT_WORK_WEIGHT * 4 * BS * 50e-6)  # k x the 4 blocks it lacks


def test_ttft_counts_the_own_prefill_once_and_the_cost_work_weight_times() -> None:
    """The SLO checks the predicted TTFT; placement weighs the request's own prefill ``work_weight`` times."""
    p = PrefixAwarePolicy(seed=0)
    c = Candidate("n", 0, 60, (60, 0, 0), NodeLoad(prefill_tokens=1000))
    own, queue = 4 * BS * 50e-6, 1000 * 50e-6
    assert p.ttft(req(64 * BS), c) == pytest.approx(own + queue)
    assert p.weight(req(64 * BS), [c]) == DEFAULT_WORK_WEIGHT
    assert p.cost(req(64 * BS), c, DEFAULT_WORK_WEIGHT) == pytest.approx(DEFAULT_WORK_WEIGHT * own + queue)


def test_tier_weights_rank_gpu_over_cpu_over_storage() -> None:
    p = PrefixAwarePolicy(seed=0)
    r = req(64 * BS)
    gpu = Candidate("gpu", 0, 40, (40, 0, 0))
    cpu = Candidate("cpu", 0, 40, (0, 40, 0))
    sto = Candidate("sto", 0, 40, (0, 0, 40))
    assert p.choose(r, [sto, cpu, gpu]).node_id == "gpu"
    assert p.choose(r, [sto, cpu]).node_id == "cpu"
    # A storage hit of 40 blocks saves 20 blocks' prefill: a GPU hit of 21 blocks beats it, 19 does not.
    assert p.choose(r, [sto, Candidate("g21", 0, 21, (21, 0, 0))]).node_id == "g21"
    assert p.choose(r, [sto, Candidate("g19", 0, 19, (19, 0, 0))]).node_id == "sto"
    assert p.saved_tokens(r, Candidate("mixed", 0, 30, (10, 10, 10))) == pytest.approx(BS * (10 + 8 + 5))


def test_load_outweighs_a_small_hit_in_the_same_unit() -> None:
    lat = LatencyModel(prefill_s_per_token=1e-4)
    p = PrefixAwarePolicy(seed=0, latency=lat)
    holder = Candidate("holder", 0, 8, (8, 0, 0), NodeLoad(running_requests=1, prefill_tokens=2000))
    idle = Candidate("idle", 0, 0, (), NodeLoad())
    # The hit saves 128 tokens of prefill (counted k = 12 times: 1536) but 2000 tokens are queued ahead of it.
    assert DEFAULT_WORK_WEIGHT == 12
    d = p.choose(req(1024), [holder, idle])
    assert d.node_id == "idle" and "replicating" in d.why and "busier" in d.why
    holder_light = Candidate("holder", 0, 8, (8, 0, 0), NodeLoad(running_requests=1, prefill_tokens=100))
    assert p.choose(req(1024), [holder_light, idle]).node_id == "holder"


def test_a_miss_is_placed_for_its_own_ttft() -> None:
    """Below ``cache_threshold`` of the prompt held anywhere, the request's prefill counts once: a node
    holding a sliver of it (a shared system prompt) does not pull new conversations onto its queue."""
    holder = Candidate("holder", 0, 1, (1, 0, 0), NodeLoad(running_requests=1, prefill_tokens=100))
    idle = Candidate("idle", 0, 0, (), NodeLoad())
    r = req(1024)  # the holder has 16 of 1024 tokens (1.6%): 16 x 12 = 192 > 100 queued, 16 x 1 < 100
    p = PrefixAwarePolicy(seed=0, latency=LatencyModel(prefill_s_per_token=1e-4))
    assert p.weight(r, [holder, idle]) == 1.0
    d = p.choose(r, [holder, idle])
    assert d.node_id == "idle" and "a miss (no node holds 10% of the prompt)" in d.why
    # Threshold 0: every request weighs its prefill work_weight times, and the sliver wins.
    flat = PrefixAwarePolicy(seed=0, latency=LatencyModel(prefill_s_per_token=1e-4, cache_threshold=0.0))
    assert flat.weight(r, [holder, idle]) == DEFAULT_WORK_WEIGHT
    d = flat.choose(r, [holder, idle])
    assert d.node_id == "holder" and "a miss" not in d.why
    # Past the threshold (7 blocks: 112 of 1024 tokens, >= 102.4) it is a hit again.
    seven = Candidate("holder", 0, 7, (7, 0, 0), NodeLoad(running_requests=1, prefill_tokens=1000))
    assert p.weight(r, [seven, idle]) == DEFAULT_WORK_WEIGHT
    assert p.choose(r, [seven, idle]).node_id == "holder"  # 112 x 12 = 1344 > 1000 queued


@pytest.mark.parametrize("threshold", [-0.1, 1.1, float("nan")])
def test_cache_threshold_out_of_range_is_refused(threshold: float) -> None:
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        LatencyModel(cache_threshold=threshold)


def test_balance_cap_excludes_an_overloaded_holder_whatever_it_holds() -> None:
    p = PrefixAwarePolicy(seed=0, balance_abs=4, balance_rel=1.5)
    full = Candidate("holder", 0, 128, (128, 0, 0), NodeLoad(running_requests=5))
    others = [Candidate(f"n{i}", 0, 0, (), NodeLoad(running_requests=0)) for i in range(3)]
    d = p.choose(req(128 * BS + 8), [full, *others])
    assert d.node_id != "holder"
    assert "over the balance cap" in d.why
    # At 4 in flight (= 1.5 * 0 + 4) it is still eligible, and its hit wins.
    ok = Candidate("holder", 0, 128, (128, 0, 0), NodeLoad(running_requests=4))
    assert p.choose(req(128 * BS + 8), [ok, *others]).node_id == "holder"


def test_shared_system_prompt_spreads_once_the_holder_is_loaded() -> None:
    """Every request has the same 2048-token system prompt and its own 128-token question.

    Nothing finishes, so load only grows: the first holder attracts requests while its hit is worth
    more than its queue, then other nodes take the prompt too (replication), and no node ends up with
    much more than its share."""
    lat = LatencyModel(prefill_s_per_token=50e-6, decode_s_per_token=15e-3, max_running=32)
    p = PrefixAwarePolicy(seed=42, latency=lat)
    n_nodes, system_blocks, q_tokens = 8, 128, 128
    held: dict[str, int] = {}
    running = dict.fromkeys((f"n{i}" for i in range(n_nodes)), 0)
    pending = dict.fromkeys(running, 0)
    picks: list[str] = []
    first_spread = None
    for i in range(400):
        cands = [
            Candidate(n, 0, held.get(n, 0), (held.get(n, 0), 0, 0), NodeLoad(running[n], 0, 0.0, pending[n]))
            for n in running
        ]
        d = p.choose(req(system_blocks * BS + q_tokens), cands)
        picks.append(d.node_id)
        running[d.node_id] += 1
        pending[d.node_id] += system_blocks * BS + q_tokens - d.matched_blocks * BS
        held[d.node_id] = system_blocks
        if first_spread is None and len(set(picks)) > 1:
            first_spread = i
        # prefill drains a little between arrivals (a 20 ms gap at 50 µs/token = 400 tokens)
        for n in pending:
            pending[n] = max(0, pending[n] - 400)
    assert first_spread is not None and first_spread > 1, "the holder should take the first few repeats"
    counts = [picks.count(n) for n in running]
    assert min(counts) > 0, counts
    assert max(counts) <= 1.5 * min(counts) + 8, counts
    assert len(held) == n_nodes  # the prompt was replicated everywhere


def test_prefix_aware_ties_are_broken_at_random_not_by_node_id() -> None:
    picks = {PrefixAwarePolicy(seed=s).choose(req(256), nodes(4)).node_id for s in range(30)}
    assert picks == {"n0", "n1", "n2", "n3"}


def test_approximate_remembers_what_it_routed_until_the_ttl() -> None:
    p = ApproximatePolicy(seed=5, ttl=10.0)
    first = p.choose(req(64 * BS, hashes=64, now=0.0), nodes(4))
    # The index answer (candidates' matches) is ignored: only the routing memory counts.
    decoy = [Candidate(c.node_id, 0, 64 if c.node_id != first.node_id else 0, (), c.load) for c in nodes(4)]
    again = p.choose(req(64 * BS, hashes=64, now=5.0), decoy)
    assert again.node_id == first.node_id and again.matched_blocks == 64
    assert "approximate" in again.why
    # A shorter prompt sharing 32 blocks matches 32 there.
    assert p.memory.match([BlockHash64(1000 + i) for i in range(32)], 6.0, [first.key]) == {first.key: 32}
    # Past the TTL (refreshed at t=5) the belief is gone.
    assert p.memory.match([BlockHash64(1000 + i) for i in range(64)], 15.5, [first.key]) == {first.key: 0}


def test_prefix_aware_matches_approximate_nodes_against_what_it_routed_them() -> None:
    """A node without KV events (trust approximate) always answers 0 matched: prefix-aware counts what it
    sent there within ``approximate_ttl`` instead, so a conversation stays where its prefix is."""
    p = PrefixAwarePolicy(seed=1, approximate_ttl=10.0)
    blind = Candidate("blind", 0, 0, (), NodeLoad(), trust="approximate")
    busy = Candidate("events", 0, 0, (), NodeLoad(running_requests=3))
    first = p.choose(req(64 * BS, hashes=64, now=0.0), [busy, blind])
    assert first.node_id == "blind" and first.matched_blocks == 0
    assert "publishes no KV events" in first.why
    # Later the node with events is idle and blind is busier; blind is believed to hold the prefix.
    idle = Candidate("events", 0, 0, (), NodeLoad())
    loaded = Candidate("blind", 0, 0, (), NodeLoad(prefill_tokens=256), trust="approximate")
    again = p.choose(req(64 * BS, hashes=64, now=5.0), [idle, loaded])
    assert (again.node_id, again.matched_blocks) == ("blind", 64)
    # An exact node's zero is believed: the memory only stands in for approximate nodes.
    exact = Candidate("blind", 0, 0, (), NodeLoad(prefill_tokens=256))
    assert p.choose(req(64 * BS, hashes=64, now=6.0), [idle, exact]).node_id == "events"
    # Past the TTL the belief is gone and load decides.
    assert p.choose(req(64 * BS, hashes=64, now=30.0), [idle, loaded]).node_id == "events"


def test_routed_memory_sweep_drops_only_expired_entries() -> None:
    m = RoutedPrefixMemory(ttl=1.0)
    m.record(("a", 0), [BlockHash64(1), BlockHash64(2)], now=0.0)
    m.record(("b", 0), [BlockHash64(1)], now=5.0)
    assert len(m) == 3
    m.sweep(now=2.0)
    assert len(m) == 1
    assert m.match([BlockHash64(1), BlockHash64(2)], 5.5, [("a", 0), ("b", 0)]) == {("a", 0): 0, ("b", 0): 1}
    with pytest.raises(ValueError):
        RoutedPrefixMemory(ttl=0)


def test_candidates_from_matches_fills_missing_nodes_and_drops_unroutable() -> None:
    loads = {("a", 0): NodeLoad(running_requests=1), ("b", 0): NodeLoad(),
             ("b", 1): NodeLoad(waiting_requests=2)}
    matches = [
        NodeMatch("b", 1, 7, (3, 4, 0)),
        NodeMatch("gone", 0, 9, (9, 0, 0)),
    ]
    cands = {c.key: c for c in candidates_from_matches(loads, matches)}
    assert set(cands) == set(loads)
    assert cands[("b", 1)].matched_blocks == 7 and cands[("b", 1)].tier_counts() == (3, 4, 0)
    assert cands[("a", 0)].matched_blocks == 0 and cands[("a", 0)].load.running_requests == 1
    assert Candidate("x", 0, 5).tier_counts() == (5, 0, 0)
    assert Candidate("x", 0, 5, (1, 2, 2)).tier_counts()[Tier.STORAGE] == 2


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_explains_itself_and_rejects_no_candidates(name: str) -> None:
    p = make_policy(name, seed=1)
    d = p.choose(req(100, hashes=6), nodes(3))
    assert d.node_id in {"n0", "n1", "n2"} and d.why.strip()
    with pytest.raises(ValueError, match="no candidate"):
        p.choose(req(100), [])


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nearest")
    with pytest.raises(ValueError, match="tier weights"):
        PrefixAwarePolicy(tier_weights=(1.0, 1.5, 0.5))
    with pytest.raises(ValueError, match="balance"):
        PrefixAwarePolicy(balance_rel=0.5)
    with pytest.raises(ValueError, match="max_running"):
        LatencyModel(max_running=0)


def test_queue_estimate_counts_prefill_backlog_and_slot_wait() -> None:
    lat = LatencyModel(
        prefill_s_per_token=1e-4, decode_s_per_token=1e-2, max_running=2, mean_output_tokens=100
    )
    assert lat.queue_seconds(NodeLoad(running_requests=1, prefill_tokens=1000)) == pytest.approx(0.1)
    # 2 running + 1 waiting + this one = 2 over the 2 slots: 2 * 100 * 0.01 / 2 = 1.0 s
    assert lat.queue_seconds(NodeLoad(running_requests=2, waiting_requests=1)) == pytest.approx(1.0)


def hashes(*runs: tuple[int, int]) -> list[BlockHash64]:
    """Block hashes made of ``(first, count)`` runs: equal runs mean an equal prefix."""
    return [BlockHash64(first + i) for first, count in runs for i in range(count)]


def test_in_flight_placement_counts_as_held_until_the_node_should_have_reported_it() -> None:
    p = PrefixAwarePolicy(seed=9)
    convo = hashes((5000, 64))
    first = p.choose(RouteRequest(64 * BS, BS, convo, 0.0), nodes(4))
    a = first.node_id
    # 10 ms later the index shows nothing yet (the node has not admitted it), and the holder is busy
    # prefilling it: the remembered placement still wins over an idle node that would recompute.
    busy = [Candidate(c.node_id, 0, 0, (), NodeLoad(1, 0, 0.0, 1024) if c.node_id == a else c.load)
            for c in nodes(4)]
    follow = RouteRequest(96 * BS, BS, convo + hashes((9000, 32)), 0.01)
    d = p.choose(follow, busy)
    assert d.node_id == a and d.matched_blocks == 64, d.why
    assert "64 blocks in flight to" in d.why
    # Without the memory the same request would go to an idle node.
    blind = PrefixAwarePolicy(seed=9, affinity_entries=0)
    assert blind.choose(follow, busy).node_id != a


def test_after_the_report_horizon_the_index_is_authoritative() -> None:
    p = PrefixAwarePolicy(seed=9)
    convo = hashes((5000, 64))
    a = p.choose(RouteRequest(64 * BS, BS, convo, 0.0), nodes(4)).node_id
    # 100 s later the index shows nothing: the node evicted it. No affinity bonus: a tie, at random.
    picks = set()
    for i in range(30):
        d = p.choose(RouteRequest(96 * BS, BS, convo + hashes((9000, 32)), 100.0 * (i + 1)), nodes(4))
        assert d.matched_blocks == 0 and "in flight" not in d.why, d.why
        picks.add(d.node_id)
    assert picks == {"n0", "n1", "n2", "n3"} and a in picks
    # A real index hit elsewhere wins over the remembered placement.
    b = next(c.node_id for c in nodes(4) if c.node_id != a)
    held = [Candidate(c.node_id, 0, 8 if c.node_id == b else 0, (), c.load) for c in nodes(4)]
    assert p.choose(RouteRequest(96 * BS, BS, convo, 5000.0), held).node_id == b


def test_remembered_placement_obeys_the_balance_cap() -> None:
    p = PrefixAwarePolicy(seed=3, balance_abs=4, balance_rel=1.5)
    convo = hashes((7000, 128))
    a = p.choose(RouteRequest(128 * BS, BS, convo, 0.0), nodes(4)).node_id
    over = [Candidate(c.node_id, 0, 0, (), NodeLoad(running_requests=9) if c.node_id == a else c.load)
            for c in nodes(4)]
    d = p.choose(RouteRequest(128 * BS + 8, BS, convo, 0.01), over)
    assert d.node_id != a and "over the balance cap" in d.why, d.why


def test_shared_system_prompt_in_flight_does_not_pin_the_fleet_to_one_node() -> None:
    """A burst of 400 requests sharing a 2048-token system prompt arrives before any node reports it.

    The placement memory says the last node to get the prompt holds it, so each request is attracted
    to that node; the queue term moves the prompt on once that node is busier than a recompute, and
    the work ends up spread over every node, within the balance cap."""
    p = PrefixAwarePolicy(seed=42)
    n_nodes, system_blocks, q_blocks = 8, 128, 8
    running = dict.fromkeys((f"n{i}" for i in range(n_nodes)), 0)
    pending = dict.fromkeys(running, 0)
    picks: list[str] = []
    for i in range(400):
        cands = [Candidate(n, 0, 0, (), NodeLoad(running[n], 0, 0.0, pending[n])) for n in running]
        prompt = hashes((1, system_blocks), (10_000 + i * q_blocks, q_blocks))
        d = p.choose(RouteRequest((system_blocks + q_blocks) * BS, BS, prompt, i * 0.02), cands)
        picks.append(d.node_id)
        running[d.node_id] += 1
        pending[d.node_id] += (system_blocks + q_blocks - d.matched_blocks) * BS
        for n in pending:
            pending[n] = max(0, pending[n] - 400)
    assert picks[1] == picks[0], "the in-flight holder takes the first repeat"
    counts = [picks.count(n) for n in running]
    assert min(counts) > 0 and max(counts) <= 1.5 * min(counts) + 8, counts


def test_placement_memory_keeps_checkpoints_in_a_bounded_lru() -> None:
    m = PlacementMemory(capacity=6, stride=4)
    a, b = ("a", 0), ("b", 0)
    m.record(hashes((100, 10)), a, 0.0, 1.0)  # checkpoints at blocks 3, 7 and the last, 9
    assert len(m) == 3
    got = m.recall(hashes((100, 8), (555, 4)))
    assert got is not None and got.key == a and got.depth == 8 and got.ready_at == 1.0
    assert m.recall(hashes((100, 3))) is None  # no checkpoint inside the first 3 blocks
    m.record(hashes((200, 16)), b, 2.0, 3.0)  # 4 more entries: the oldest of a's fall out
    assert len(m) == 6
    assert m.recall(hashes((100, 4))) is None
    again = m.recall(hashes((100, 10)))
    assert again is not None and again.key == a and again.depth == 10
    assert PlacementMemory(capacity=0).recall(hashes((100, 10))) is None
    with pytest.raises(ValueError, match="affinity"):
        PrefixAwarePolicy(affinity_stride=0)


# --- degraded nodes (trust) ----------------------------------------------------------------------
def _degraded_pair(exact_blocks: int = 30, cause: str = "") -> list[Candidate]:
    """n0 degraded (by ``cause``; none: a coordinator that predates it) with 40 leading blocks, n1 exact
    with ``exact_blocks``; equal (idle) loads."""
    return [Candidate("n0", 0, 40, (), NodeLoad(), trust="degraded", trust_cause=cause),
            Candidate("n1", 0, exact_blocks, (), NodeLoad())]


def test_lost_history_counts_in_full_a_hash_mismatch_is_discounted() -> None:
    """Lost history means missing blocks, not wrong ones: the default setting leaves its real matches
    whole, and still halves a node whose hashes failed verification."""
    p = PrefixAwarePolicy(seed=1)
    d = p.choose(req(64 * BS), _degraded_pair(cause=HISTORY_LOST))
    assert d.node_id == "n0" and d.matched_blocks == 40
    assert "n0 is degraded (lost history: some blocks missing), its matches are real and counted in full" \
        in d.why
    assert p.saved_tokens(req(64 * BS), _degraded_pair(cause=HISTORY_LOST)[0]) == 40 * BS
    d = p.choose(req(64 * BS), _degraded_pair(cause=HASH_MISMATCH))
    assert d.node_id == "n1" and "best holder n0 (40 blocks) is degraded, its blocks counted at 0.5" in d.why
    ignore = PrefixAwarePolicy(seed=1, degraded="ignore")
    assert ignore.choose(req(64 * BS), _degraded_pair(cause=HISTORY_LOST)).node_id == "n0"
    d = ignore.choose(req(64 * BS), _degraded_pair(exact_blocks=1, cause=HASH_MISMATCH))
    assert d.node_id == "n1" and "lost history" not in d.why
    lost = Candidate("n0", trust="degraded", trust_cause=HISTORY_LOST)
    assert lost.to_json()["trust_cause"] == HISTORY_LOST
    assert "trust_cause" not in Candidate("n1").to_json()


def test_degraded_trust_counts_its_matches_as_exact() -> None:
    d = PrefixAwarePolicy(seed=1, degraded="trust").choose(req(64 * BS), _degraded_pair())
    assert d.node_id == "n0" and d.matched_blocks == 40
    assert "n0 is degraded (its hashes failed verification), its blocks counted at 1" in d.why


def test_degraded_discount_is_the_default_and_halves_its_blocks() -> None:
    p = PrefixAwarePolicy(seed=1)
    assert p.degraded == "discount" and p.degraded_weight == 0.5
    d = p.choose(req(64 * BS), _degraded_pair())
    assert d.node_id == "n1"  # 40 * 0.5 = 20 < 30
    assert "best holder n0 (40 blocks) is degraded, its blocks counted at 0.5" in d.why
    # Still preferred when its discounted hit beats the exact node's.
    d = p.choose(req(64 * BS), _degraded_pair(exact_blocks=10))
    assert d.node_id == "n0" and "n0 is degraded" in d.why
    assert p.saved_tokens(req(64 * BS), _degraded_pair()[0]) == 20 * BS


def test_degraded_ignore_holds_nothing_but_stays_a_candidate() -> None:
    p = PrefixAwarePolicy(seed=1, degraded="ignore")
    assert p.choose(req(64 * BS), _degraded_pair(exact_blocks=1)).node_id == "n1"
    busy = [Candidate("n0", 0, 40, (), NodeLoad(), trust="degraded"),
            Candidate("n1", 0, 0, (), NodeLoad(running_requests=3))]
    d = p.choose(req(64 * BS), busy)
    assert d.node_id == "n0" and d.matched_blocks == 0  # chosen on load alone
    assert "replicating" not in d.why


def test_place_takes_the_degraded_option_for_its_default_policy() -> None:
    answer = LookupResult("m", BS, 64, _degraded_pair(), 64 * BS)
    assert place(answer).node_id == "n1"
    assert place(answer, degraded="trust").node_id == "n0"
    with pytest.raises(ValueError, match="give it to the policy"):
        place(answer, PrefixAwarePolicy(), degraded="trust")
    with pytest.raises(ValueError, match="degraded must be one of"):
        PrefixAwarePolicy(degraded="maybe")
    with pytest.raises(ValueError, match="degraded_weight"):
        PrefixAwarePolicy(degraded_weight=2.0)
