"""``kvcoord simulate`` with caches past the GPU: a CPU tier per node, a shared pool some nodes reach, and
peer pulls (kvcoord/sim/tiers.py). The index-backed policy sees them; the router's own memory does not."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvcoord.agent.pool import BlockPool
from kvcoord.hashing import HashProfile
from kvcoord.index.memory import MemoryIndex
from kvcoord.load import NodeLoad
from kvcoord.router.placement import LatencyModel
from kvcoord.router.policy import make_policy
from kvcoord.sim.cluster import ClusterConfig, IndexAdapter, PolicyResult, simulate
from kvcoord.sim.tiers import TierConfig, Tiers
from kvcoord.sim.workload import SyntheticSpec, synthetic
from tests.procs import REPO, kvcoord_cmd

PROFILE = HashProfile("xxhash_cbor", 16, seed="test-sim")
SPEC = SyntheticSpec(requests=200, groups=4, prompts_per_group=12, system_tokens=256, question_tokens=256,
                     output_tokens=32, turns=4, rate=20.0)
TIERS = TierConfig(cpu_blocks=3000, pool_blocks=3000, pool_nodes=2, pull_s=50e-6)
LATENCY = LatencyModel(max_running=4, pull_s_per_block=TIERS.pull_s)
CONFIG = ClusterConfig(nodes=4, blocks_per_node=150, latency=LATENCY, tiers=TIERS)
"""GPUs far too small for the conversations, a CPU tier 20x larger, a pool half the fleet reaches."""


def run(name: str) -> PolicyResult:
    w = synthetic(SPEC, PROFILE, seed=2)
    # The router's memory forgets after 0.5 s, well before the CPU tier and the pool do.
    return simulate(w, make_policy(name, 1, latency=LATENCY, ttl=0.5), PROFILE, CONFIG, MemoryIndex())


def test_index_policy_finds_cpu_tier_pool_and_peer_blocks_the_router_memory_misses() -> None:
    got = {name: run(name) for name in ("prefix-aware", "approximate", "least-loaded")}
    for r in got.values():
        assert r.hit_tokens == sum(r.tier_hit_tokens.values())
        assert r.prompt_tokens == r.hit_tokens + r.prefill_tokens
    index, memory = got["prefix-aware"].tier_hit_tokens, got["approximate"].tier_hit_tokens
    assert got["prefix-aware"].hit_tokens > 1.1 * got["approximate"].hit_tokens
    assert index["cpu"] > memory["cpu"] > 0  # evicted from GPU, still on the node's CPU tier
    assert index["pool"] > 0 and memory["pool"] > 0  # engines load the pool whoever routed them
    assert index["pull"] > 0 and memory["pull"] == 0  # pull hints come from the index only
    assert got["least-loaded"].tier_hit_tokens["pull"] == 0
    assert run("prefix-aware").tier_hit_tokens == index  # seeded: the same run twice


def test_index_shows_evicted_blocks_on_the_cpu_tier_and_the_pool_to_every_node() -> None:
    w = synthetic(SyntheticSpec(requests=2, groups=1, prompts_per_group=2, system_tokens=64,
                                question_tokens=64, turns=1), PROFILE, seed=0)
    tiers = Tiers(TierConfig(cpu_blocks=100, pool_blocks=100, pull_s=1e-6), ["a", "b"], 16)
    index = IndexAdapter(MemoryIndex())
    gpu = BlockPool(12, PROFILE, removal_events="vllm")  # 11 usable: the second prompt evicts the first
    for req in w.requests:
        hits = gpu.find_longest_cache_hit(req.digests)
        gpu.touch(hits)
        blocks = hits + gpu.get_new_blocks(-(-req.num_tokens // 16) - len(hits))
        gpu.cache_full_blocks(blocks, req.digests, len(hits), req.num_tokens // 16, req.tokens)
        for where, batch in tiers.published("a", gpu.take_events()).items():
            index.apply(where, batch)
        gpu.free_blocks(reversed(blocks))
    first = w.requests[0].hashes
    matches = index.match(first)
    loads = {("a", 0): NodeLoad(), ("b", 0): NodeLoad()}
    got = {c.node_id: c for c in tiers.candidates(loads, matches, first, index.match)}
    gpu_blocks, cpu_blocks, _ = got["a"].tier_counts()
    assert got["a"].matched_blocks == len(first) and cpu_blocks > 0 and gpu_blocks + cpu_blocks == len(first)
    assert got["b"].pool == "shared" and got["b"].pool_blocks() == len(first)  # b never served it
    assert got["b"].pull is None  # the pool already gives b as much as a peer pull would
    assert tiers.extend("b", first, 0, len(first)) == (0, len(first))  # b loads it all from the pool


def test_cli_reports_where_the_saved_tokens_came_from() -> None:
    proc = subprocess.run(
        kvcoord_cmd("simulate", "--requests", "120", "--nodes", "4", "--blocks-per-node", "150",
                    "--max-running", "4", "--groups", "4", "--prompts-per-group", "12",
                    "--system-tokens", "256",
                    "--question-tokens", "256", "--output-tokens", "32", "--rate", "20", "--ttl", "0.5",
                    "--cpu-blocks-per-node", "3000", "--pool-blocks", "3000", "--pool-nodes", "2",
                    "--pull-us-per-block", "50", "--policies", "prefix-aware,approximate", "--json", "-"),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cluster"]["cpu_blocks_per_node"] == 3000 and report["cluster"]["pool_nodes"] == 2
    rows = {r["policy"]: r for r in report["policies"]}
    for r in rows.values():
        assert r["hit_tokens"] == sum(r[f"hit_tokens_{k}"] for k in ("gpu", "cpu", "pool", "pull"))
    assert "CPU tier (evicted from GPU)" in proc.stderr and "pulled from peers" in proc.stderr
    assert "prefix-aware (index) saves" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--cpu-blocks-per-node", "-1"], "--cpu-blocks-per-node"),
    (["--pool-load-us-per-block", "x"], "--pool-load-us-per-block"),
    (["--nodes", "2", "--pool-blocks", "10", "--pool-nodes", "3"], "--pool-nodes 3 is more than --nodes 2"),
])
def test_bad_tier_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    proc = subprocess.run(kvcoord_cmd("simulate", "--requests", "5", *flags),
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
