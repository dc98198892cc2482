"""The alert rules against synthetic series: ``promtool test rules`` on tests/alerts_promtool.yml.

Rules whose cause tests/test_alerts.py cannot set off cheaply with real processes (a Redis failover, WAITs
short of replicas, a flushed index, a saturated pool, a key over its quota) are unit-tested here instead:
each has a case that fires it and one that leaves it quiet. tests/test_alerts.py asserts that every rule in
deploy/prometheus/alerts.yml is caused there or tested here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import REPO

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
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
