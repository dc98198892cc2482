"""The cluster simulator: workloads hash for real, runs are deterministic, the CLI prints JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvcoord.hashing import HashProfile, block_hashes64, hash_request_tokens
from kvcoord.index.memory import MemoryIndex
from kvcoord.router.client import CoordinatorClient
from kvcoord.router.placement import LatencyModel
from kvcoord.router.policy import POLICY_NAMES, make_policy
from kvcoord.sim.cluster import ClusterConfig, PolicyResult, simulate
from kvcoord.sim.remote import CoordinatorBackend, run_tag
from kvcoord.sim.report import average_seeds, deterministic_view, summarize, table
from kvcoord.sim.workload import SyntheticSpec, load_mooncake, synthetic
from tests.procs import REPO, TRACES, free_port, kvcoord_cmd, running, wait_for_port

PROFILE = HashProfile("xxhash_cbor", 16, seed="test-sim")
SPEC = SyntheticSpec(requests=150, groups=4, prompts_per_group=6, system_tokens=512, question_tokens=64,
                     output_tokens=32, turns=3, rate=40.0)
CONFIG = ClusterConfig(nodes=4, blocks_per_node=600, latency=LatencyModel(max_running=4))


@pytest.fixture()
def tiny_trace(tmp_path: Path) -> Path:
    src = TRACES / "mooncake_conversation.jsonl"
    if not src.exists():
        pytest.skip("shared traces not present")
    out = tmp_path / "tiny.jsonl"
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    out.write_text("".join(lines), encoding="utf-8")
    return out


def run_all(seed: int) -> list[dict[str, object]]:
    w = synthetic(SPEC, PROFILE, seed=seed)
    rows = []
    for name in POLICY_NAMES:
        rows.append(summarize(simulate(w, make_policy(name, seed), PROFILE, CONFIG, MemoryIndex())))
    return rows


def test_same_seed_gives_the_same_table() -> None:
    a, b = run_all(3), run_all(3)
    assert deterministic_view(a) == deterministic_view(b)
    assert deterministic_view(a) != deterministic_view(run_all(4))
    text = table(a)
    assert text.count("\n") == len(POLICY_NAMES) + 1 and "prefix-aware" in text


def test_small_synthetic_run_accounts_every_token_and_prefix_aware_hits_more() -> None:
    w = synthetic(SPEC, PROFILE, seed=1)
    total = sum(r.num_tokens for r in w.requests)
    rows = {}
    for name in ("prefix-aware", "round-robin"):
        r = simulate(w, make_policy(name, 1), PROFILE, CONFIG, MemoryIndex())
        assert r.prompt_tokens == total == r.hit_tokens + r.prefill_tokens
        assert len(r.ttft) == len(w.requests) == sum(r.node_requests)
        assert all(t >= 0 for t in r.ttft)
        assert all(c >= t for c, t in zip(sorted(r.completion), sorted(r.ttft), strict=True))
        rows[name] = r
    assert rows["prefix-aware"].hit_rate > rows["round-robin"].hit_rate


def test_synthetic_requests_share_system_prompts_and_grow_by_turn() -> None:
    w = synthetic(SPEC, PROFILE, seed=2)
    assert [r.arrival for r in w.requests] == sorted(r.arrival for r in w.requests)
    first = w.requests[0]
    assert list(first.hashes) == block_hashes64(PROFILE, list(first.tokens))
    lengths = {r.num_tokens for r in w.requests}
    assert min(lengths) == SPEC.system_tokens + SPEC.question_tokens
    assert max(lengths) == SPEC.system_tokens + 3 * SPEC.question_tokens + 2 * SPEC.output_tokens
    system_blocks = SPEC.system_tokens // 16
    heads = {tuple(r.hashes[:system_blocks]) for r in w.requests}
    assert len(heads) <= SPEC.groups


def test_trace_expands_hash_ids_into_real_hashed_tokens(tiny_trace: Path) -> None:
    w = load_mooncake(tiny_trace, PROFILE)
    records = [json.loads(line) for line in tiny_trace.read_text().splitlines()]
    assert len(w.requests) == len(records)
    for r, rec in zip(w.requests, records, strict=True):
        assert r.num_tokens == rec["input_length"] and r.output_tokens == rec["output_length"]
        assert list(r.digests) == hash_request_tokens(PROFILE, list(r.tokens))
    # Requests 0 and 1 share hash id 0 (512 tokens = 32 blocks) and nothing after it.
    a, b = w.requests[0], w.requests[1]
    assert list(a.tokens[:512]) == list(b.tokens[:512]) and a.tokens[512:528] != b.tokens[512:528]
    assert a.hashes[:32] == b.hashes[:32] and a.hashes[32] != b.hashes[32]
    limited = load_mooncake(tiny_trace, PROFILE, limit=5, time_scale=0.5)
    assert len(limited.requests) == 5


def test_bad_trace_line_is_reported_with_its_number(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_mooncake(bad, PROFILE)
    short = tmp_path / "short.jsonl"
    short.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="does not fit"):
        load_mooncake(short, PROFILE)


def test_a_flush_empties_a_node_cache_and_costs_hits() -> None:
    """A flush drops every cached block of its node (their ``BlockRemoved`` reach the index): at time 0
    it changes nothing, mid-run on every node it costs hits, and every token is still accounted."""
    w = synthetic(SPEC, PROFILE, seed=1)
    mid = w.requests[len(w.requests) // 2].arrival

    def run(*flushes: tuple[float, int]) -> PolicyResult:
        config = ClusterConfig(nodes=4, blocks_per_node=600, latency=LatencyModel(max_running=4),
                               flushes=flushes)
        r = simulate(w, make_policy("prefix-aware", 1), PROFILE, config, MemoryIndex())
        assert r.prompt_tokens == r.hit_tokens + r.prefill_tokens
        return r

    plain = run()
    assert deterministic_view([summarize(run((0.0, 0), (0.0, 3)))]) == deterministic_view([summarize(plain)])
    assert run(*((mid, n) for n in range(4))).hit_rate < plain.hit_rate
    with pytest.raises(ValueError, match=r"node in 0\.\.3"):
        ClusterConfig(nodes=4, flushes=((1.0, 4),))


def test_prompt_larger_than_a_node_is_refused_before_simulating() -> None:
    w = synthetic(SPEC, PROFILE, seed=1)
    with pytest.raises(ValueError, match="blocks-per-node"):
        tiny = ClusterConfig(nodes=2, blocks_per_node=10)
        simulate(w, make_policy("random", 0), PROFILE, tiny, MemoryIndex())


def test_cli_runs_on_a_trace_subset_and_prints_json(tiny_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    proc = subprocess.run(
        kvcoord_cmd("simulate", "--trace", str(tiny_trace), "--limit", "30", "--nodes", "3",
                    "--blocks-per-node", "12000", "--flush-at", "0.5:2", "--json", "-", "--plot", str(png)),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [row["policy"] for row in report["policies"]] == list(POLICY_NAMES)
    assert report["workload"]["requests"] == 30 and report["cluster"]["nodes"] == 3
    assert report["cluster"]["work_weight"] == 12 and report["cluster"]["flush_at"] == [[0.5, 2]]
    assert "| policy" in proc.stderr
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(("flush", "message"), [
    ("40", "is not SECONDS:NODE"), ("x:0", "is not SECONDS:NODE"), ("-1:0", "SECONDS >= 0"),
    ("5:9", "a flush at 5 s of node 9: the time must be >= 0 and the node in 0..1"),
])
def test_cli_bad_flush_exits_with_one_line(flush: str, message: str) -> None:
    proc = subprocess.run(kvcoord_cmd("simulate", "--limit", "5", "--nodes", "2", f"--flush-at={flush}"),
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_cli_bad_input_exits_with_one_line() -> None:
    proc = subprocess.run(
        kvcoord_cmd("simulate", "--limit", "5", "--policies", "prefix-aware,nearest"),
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "kvcoord simulate: unknown policy 'nearest' (known: "
        "prefix-aware, approximate, least-loaded, round-robin, random)"
    ]


def test_coordinator_mode_streams_through_reporters_and_gives_the_same_table(tmp_path: Path) -> None:
    """``--coordinator``: events go through real reporters to a ``kvcoord serve`` subprocess, lookups
    through the gRPC client; every modelled number equals the in-process run's."""
    w = synthetic(SyntheticSpec(requests=60, groups=3, prompts_per_group=4, system_tokens=256,
                                question_tokens=32, output_tokens=16, turns=3, rate=40.0), PROFILE, seed=5)
    port, metrics = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}")
    with running(cmd, log=log):
        try:
            wait_for_port(port, timeout=20)
        except TimeoutError:
            raise AssertionError(f"kvcoord serve did not start:\n{log.read_text()}") from None
        backend = CoordinatorBackend(f"127.0.0.1:{port}", PROFILE, tag=run_tag("prefix-aware"))
        seen: list[str] = []

        def progress(done: int, total: int) -> None:  # the run has started: its nodes are registered
            if done == 0:
                with CoordinatorClient(f"127.0.0.1:{port}") as client:
                    seen.extend(n.node_id for n in client.list_nodes(backend.model))

        remote = simulate(w, make_policy("prefix-aware", 2), PROFILE, CONFIG, backend, progress=progress)
        with CoordinatorClient(f"127.0.0.1:{port}") as client:
            left = client.list_nodes()  # every simulated node is removed when its run ends
        proc = subprocess.run(
            kvcoord_cmd("simulate", "--requests", "20", "--nodes", "2", "--policies", "least-loaded",
                        "--coordinator", f"127.0.0.1:{port}", "--json", "-"),
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )
    local = simulate(w, make_policy("prefix-aware", 2), PROFILE, CONFIG, MemoryIndex())
    assert deterministic_view([summarize(remote)]) == deterministic_view([summarize(local)])
    assert remote.hit_tokens > 0
    assert sorted(seen) == [f"{backend.prefix}node-{i}" for i in range(CONFIG.nodes)]
    assert left == []
    assert proc.returncode == 0, proc.stderr + "\ncoordinator log:\n" + log.read_text()[-3000:]
    assert json.loads(proc.stdout)["cluster"]["index"] == f"coordinator 127.0.0.1:{port}"


def test_coordinator_flag_is_validated_before_anything_runs() -> None:
    proc = subprocess.run(
        kvcoord_cmd("simulate", "--limit", "5", "--coordinator", "nowhere"),
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "kvcoord simulate: argument --coordinator: 'nowhere' is not HOST:PORT (a port is required, e.g. "
        "127.0.0.1:50051) (see kvcoord simulate --help)"
    )


def test_several_seeds_are_averaged_with_the_hit_range() -> None:
    w = synthetic(SPEC, PROFILE, seed=1)
    runs = []
    for seed in (1, 2, 3):
        row = summarize(simulate(w, make_policy("random", seed), PROFILE, CONFIG, MemoryIndex()))
        row["seed"] = seed
        runs.append(row)
    avg = average_seeds(runs)
    hits = [float(r["token_hit_rate"]) for r in runs]
    assert avg["seeds"] == [1, 2, 3] and "seed" not in avg
    assert avg["token_hit_rate"] == pytest.approx(sum(hits) / 3, abs=1e-6)
    assert (avg["token_hit_rate_min"], avg["token_hit_rate_max"]) == (min(hits), max(hits))
    assert isinstance(avg["prefill_tokens"], int)
    assert avg["prefill_tokens"] == round(sum(int(r["prefill_tokens"]) for r in runs) / 3)
    text = table([avg])
    assert "mean of 3 seeds" in text and f"{min(hits):.1%}-{max(hits):.1%}" in text
    assert average_seeds(runs[:1])["token_hit_rate"] == runs[0]["token_hit_rate"]
