"""The alert rules against synthetic series (``promtool test rules`` on tests/repo/alerts_promtool.yml), and
every metric kvcoord defines read by a rule or a dashboard panel, or listed with the reason it is not.

Rules whose cause tests/repo/test_alerts.py cannot set off cheaply with real processes (a Redis
failover, WAITs short of replicas, a flushed index, a saturated pool, a key over its quota) are
unit-tested here instead: each has a case that fires it and one that leaves it quiet.
tests/repo/test_alerts.py asserts that every rule in
deploy/prometheus/alerts.yml is caused there or tested here.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import REPO

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvcoord.json"
UNIT_TESTS = Path(__file__).with_name("alerts_promtool.yml")


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def _cases() -> list[tuple[str, bool]]:
    """(alert, fires) for every alert_rule_test of the unit tests."""
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    return [(t["alertname"], bool(t.get("exp_alerts"))) for case in doc["tests"]
            for t in case.get("alert_rule_test", [])]


def promtool_tested() -> set[str]:
    """The alerts the promtool unit tests make fire."""
    return {name for name, fires in _cases() if fires}


def test_each_unit_tested_alert_fires_once_and_stays_quiet_once() -> None:
    names = {r["alert"] for r in _rules()}
    cases = _cases()
    assert {n for n, _ in cases} <= names, "a unit test names an alert alerts.yml does not have"
    for name in {n for n, _ in cases}:
        assert (name, True) in cases and (name, False) in cases, f"{name}: needs a firing and a quiet case"
    assert len(promtool_tested()) >= 9


def _promtool_test(tmp: Path, broken: str = "") -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of the unit tests on alerts.yml without annotations (promtool compares them
    whole; the cases give labels), with rule ``broken``'s comparison turned around."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
            if rule["alert"] == broken:
                rule["expr"] = rule["expr"].replace("> 0", "== 0")
    (tmp / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp / "alerts_test.yml")
    return subprocess.run([promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                          timeout=120, cwd=tmp)


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    out = _promtool_test(tmp_path)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The cases bite: with one rule's comparison turned around, promtool fails on that rule."""
    out = _promtool_test(tmp_path, broken="KvcoordRedisWaitShort")
    assert out.returncode != 0 and "KvcoordRedisWaitShort" in out.stdout + out.stderr, out.stdout + out.stderr


# --- every metric kvcoord defines is watched, or says why not ------------------------------------------
DECISION_PREFIXES = ("kvcoord_route", "kvcoord_epp")
"""The prefixes ``DecisionMetrics(registry, prefix)`` is created with (route's and the picker's)."""
UNWATCHED = {
    "kvcoord_build_info": "a label carrier (version, native paths), read with a join, not on its own",
    "kvcoord_index_blocks_upper_bound": "says how to read kvcoord_index_blocks (a per-shard sum)",
    "kvcoord_hash_verifications_total": "the sampled chains behind kvcoord_hash_mismatches_total (alerted)",
    "kvcoord_hash_profile_learned_total": "a one-off per model at start-up (kvcoord nodes shows the profile)",
    "kvcoord_index_call_seconds": "per-call detail under kvcoord_index_round_trip_seconds (a panel)",
    "kvcoord_index_call_errors_total": "per-call detail under kvcoord_index_errors_total (a panel)",
    "kvcoord_index_mirror_ready": "mirror=1 only; KvcoordLookupDeadlineExceeded covers a mirror that lags",
    "kvcoord_index_mirror_loads_total": "mirror=1 only (docs/operations.md, Redis)",
    "kvcoord_index_mirror_feed_entries_total": "mirror=1 only (docs/operations.md, Redis)",
    "kvcoord_index_mirror_lookups_total": "mirror=1 only (docs/operations.md, Redis)",
    "kvcoord_index_walked_lookups_total": "with kvcoord_index_mirror_lookups_total, which path answered "
                                          "lookups (failures: kvcoord_index_errors_total)",
    "kvcoord_lookup_answers_total": "HTTP fast path against the general one: a tuning figure",
    "kvcoord_lookup_worker_frames_applied_total": "the lookup workers' progress; their lag is alerted on",
    "kvcoord_pool_unknown_announcements_total": "the node still reaches its pools; logged once per name",
    "kvcoord_redis_wait_seconds_total": "with kvcoord_redis_wait_total, a mean for tuning wait_replicas",
    "kvcoord_reserved_prefill_tokens": "the load reservations stand for, beside kvcoord_reservations",
    "kvcoord_route_first_byte_seconds": "the engines' latency; route's own is kvcoord_route_overhead_seconds",
    "kvcoord_route_request_seconds": "the engines' latency; route's own is kvcoord_route_overhead_seconds",
    "kvcoord_route_predicted_hit_tokens": "per request; its sum is kvcoord_route_predicted_tokens (a panel)",
    "kvcoord_route_achieved_hit_tokens": "per request; its sum is kvcoord_route_achieved_tokens (a panel)",
    "kvcoord_route_http_refused_total": "slow or oversized client heads: logged, and a client-side problem",
    "kvcoord_route_key_tokens_total": "per-key billing figure; rate limits are watched by key requests",
    "kvcoord_route_sessions_dropped_total": "expired and evicted sessions: the panel shows sessions known",
    "kvcoord_route_pd_total": "disaggregated routers only (docs/route.md)",
    "kvcoord_route_prefill_placements_total": "disaggregated routers only (docs/route.md)",
    "kvcoord_route_prefill_seconds": "disaggregated routers only (docs/route.md)",
    "kvcoord_epp_bad_headers_total": "headers the picker ignored (logged): a client's mistake",
    **{f"kvcoord_epp_{name}": "the picker's decision quality, the families route's row reads"
       for name in ("predicted_hit_blocks", "predicted_hit_tokens", "best_hit_blocks", "achieved_hit_tokens",
                    "prompt_tokens_total", "predicted_tokens_total", "best_tokens_total",
                    "achieved_tokens_total", "hit_outcomes_total", "below_best_total")},
}
"""Families no rule or panel reads, and why."""


def defined_metrics() -> set[str]:
    """Every ``kvcoord_*`` family kvcoord defines (``Counter`` ones with their ``_total``), from the source:
    prometheus_client's classes and the ``*MetricFamily`` of its collectors."""
    out: set[str] = set()
    for path in sorted((REPO / "kvcoord").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
                    and (node.func.id in ("Counter", "Gauge", "Histogram", "Summary")
                         or node.func.id.endswith("MetricFamily"))):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
            elif isinstance(arg, ast.JoinedStr) and ast.unparse(arg).startswith("f'{prefix}_"):
                names = [p + ast.unparse(arg)[len("f'{prefix}"):-1] for p in DECISION_PREFIXES]
            else:
                continue
            total = "_total" if node.func.id.startswith("Counter") else ""
            out |= {n + total for n in names if n.startswith("kvcoord_")}
    return out


def test_every_metric_is_in_a_rule_or_a_panel_or_says_why_not() -> None:
    """A new metric needs an alert (an operator must act), a panel (one should watch) or a line in
    UNWATCHED; a name listed there that a rule or panel reads, or that no longer exists, fails too."""
    deploy = ALERTS.read_text() + DASHBOARD.read_text()
    defined = defined_metrics()
    assert len(defined) >= 90, sorted(defined)

    def read(name: str) -> bool:
        base = name.removesuffix("_total")
        return re.search(rf"\b{re.escape(base)}(?:_total|_bucket|_sum|_count)?\b", deploy) is not None

    unwatched = sorted(n for n in defined if not read(n) and n not in UNWATCHED)
    assert not unwatched, f"no rule or panel reads {unwatched}: add one, or a reason to UNWATCHED"
    stale = sorted(n for n in UNWATCHED if n not in defined or read(n))
    assert not stale, f"UNWATCHED lists {stale}, which no longer exist or are now read"
