"""``kvcoord simulate`` with disaggregated prefill and decode (kvcoord/sim/disagg.py): the first nodes
prefill, the others decode, each policy places both as ``kvcoord route`` does (the decode node first, a
prefill node when the decode node lacks more than ``max_local_prefill_tokens``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvcoord.hashing import HashProfile
from kvcoord.index.memory import MemoryIndex
from kvcoord.router.placement import LatencyModel
from kvcoord.router.policy import make_policy
from kvcoord.sim.cluster import ClusterConfig, PolicyResult, simulate
from kvcoord.sim.disagg import PdSimConfig
from kvcoord.sim.workload import SyntheticSpec, synthetic
from tests.procs import kvcoord_cmd

PROFILE = HashProfile("xxhash_cbor", 16, seed="test-sim")
SPEC = SyntheticSpec(requests=160, groups=4, prompts_per_group=10, system_tokens=512, question_tokens=64,
                     output_tokens=16, turns=4, rate=10.0)
LATENCY = LatencyModel(max_running=8)
PD = PdSimConfig(prefill_nodes=2, transfer_s=100e-6, max_local_prefill_tokens=256)


def run(name: str, pd: PdSimConfig = PD) -> PolicyResult:
    config = ClusterConfig(nodes=5, blocks_per_node=2000, latency=LATENCY, pd=pd)
    return simulate(synthetic(SPEC, PROFILE, seed=3), make_policy(name, 1, latency=LATENCY), PROFILE, config,
                    MemoryIndex())


def test_decode_nodes_holding_the_conversation_skip_the_remote_prefill() -> None:
    got = {name: run(name) for name in ("prefix-aware", "approximate", "least-loaded")}
    for r in got.values():
        assert r.pd["remote_prefills"] + r.pd["skipped_prefills"] == r.requests
        assert len(r.ttft) == len(r.completion) == r.requests  # one first token per request, from decode
        assert all(t > 0 for t in r.ttft)
        assert sum(r.node_requests[2:]) == r.requests  # every request decodes on a decode node
    index, blind = got["prefix-aware"], got["least-loaded"]
    assert blind.pd["skipped_prefills"] == 0  # no prefix known: always a remote prefill, as vLLM's proxy
    assert index.pd["skipped_prefills"] > 0.3 * index.requests  # later turns: the decode node holds them
    assert index.pd["transferred_blocks"] < blind.pd["transferred_blocks"]
    assert index.prefill_tokens < blind.prefill_tokens
    assert run("prefix-aware").pd == index.pd  # seeded: the same run twice
    never = run("prefix-aware", PdSimConfig(prefill_nodes=2, max_local_prefill_tokens=0))
    assert never.pd["skipped_prefills"] == 0 and never.pd["remote_prefills"] == never.requests
    plain = run("prefix-aware", PdSimConfig())
    assert plain.pd == {} and len(plain.ttft) == plain.requests


def test_cli_reports_the_pd_columns() -> None:
    proc = subprocess.run(
        kvcoord_cmd("simulate", "--requests", "80", "--nodes", "4", "--blocks-per-node", "2000",
                    "--groups", "4", "--prompts-per-group", "8", "--system-tokens", "512",
                    "--question-tokens", "64", "--output-tokens", "16", "--rate", "10",
                    "--policies", "prefix-aware,least-loaded", "--prefill-nodes", "1",
                    "--kv-transfer-us-per-block", "50", "--max-local-prefill-tokens", "256", "--json", "-"),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipped remote prefills" in proc.stderr and "blocks moved P->D" in proc.stderr
    report = json.loads(proc.stdout)
    assert report["cluster"]["prefill_nodes"] == 1 and report["cluster"]["kv_transfer_us_per_block"] == 50
    rows = {r["policy"]: r for r in report["policies"]}
    assert rows["least-loaded"]["skipped_prefills"] == 0 and rows["prefix-aware"]["skipped_prefills"] > 0


@pytest.mark.parametrize(("flags", "words"), [
    (("--prefill-nodes", "4"), "--prefill-nodes 4 leaves no decode node"),
    (("--kv-transfer-us-per-block", "-1"), "must be >= 0"),
])
def test_cli_pd_mistakes_are_one_line(flags: tuple[str, ...], words: str) -> None:
    proc = subprocess.run(kvcoord_cmd("simulate", "--requests", "10", "--nodes", "4", *flags),
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and words in lines[0], proc.stderr
