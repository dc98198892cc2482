"""The lookup workers' metrics in the main process's ``/metrics`` (kvcoord/coordinator/worker_metrics.py):
with ``kvcoord serve --lookup-workers 2`` as real processes, the lookups the workers answered are counted
exactly in the main process's scrape, per worker figures are there, and a worker killed with SIGKILL and
restarted takes nothing off a counter."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.coordinator.test_lookup_workers import QUERIES, Serve, post, serve
from tests.http_util import Samples, metrics, sample
from tests.procs import until

pytestmark = pytest.mark.slow


def scrape(co: Serve) -> Samples:
    """The main process's ``/metrics``."""
    return metrics(f"http://127.0.0.1:{co.metrics}/metrics")


def lookups(co: Serve, count: int) -> dict[str, int]:
    """``count`` lookups over fresh connections to the shared port (all answered 200): how many each
    path took (``/query`` or ``/query_by_hash``) and each worker answered."""
    seen: dict[str, int] = {}
    for i in range(count):
        path, body = QUERIES[i % len(QUERIES)]
        status, worker, answer = post(co.http, path, body)
        assert status == 200 and worker in ("1", "2"), answer
        seen[path] = seen.get(path, 0) + 1
        seen[worker] = seen.get(worker, 0) + 1
    return seen


def watch(co: Serve, floor: Callable[[Samples], None]) -> Callable[[], Samples]:
    """A scrape that first checks ``floor`` of every sample it sees (counters that must not go down)."""
    def scraped() -> Samples:
        samples = scrape(co)
        floor(samples)
        return samples
    return scraped


def test_workers_lookups_are_counted_in_the_main_scrape_through_a_restart(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        before = scrape(co)
        assert sample(before, "kvcoord_lookup_answers_total") == 0
        assert sample(before, "kvcoord_lookup_worker_restarts_total") == 0
        sent = lookups(co, 40)
        assert sent.get("1") and sent.get("2"), sent  # both workers answered some (fresh connections)
        highest: dict[str, float] = {}

        def monotonic(samples: Samples) -> None:
            for name in ("kvcoord_lookup_answers_total", "kvcoord_lookup_latency_seconds_count",
                         "kvcoord_lookup_worker_frames_applied_total"):
                now = sample(samples, name)
                assert now >= highest.get(name, 0.0), (name, now, highest)
                highest[name] = now

        scraped = watch(co, monotonic)
        samples = until(lambda: (got := scraped()) and sample(got, "kvcoord_lookup_answers_total") >= 40
                        and got, "the workers to report their lookups", diagnose=lambda: sent)
        assert sample(samples, "kvcoord_lookup_answers_total") == 40
        by_query = {"tokens": sent["/query"], "hashes": sent["/query_by_hash"]}
        for query, n in by_query.items():
            assert sample(samples, "kvcoord_lookup_latency_seconds_count", query=query) == n
            assert sample(samples, "kvcoord_lookup_latency_seconds_bucket", query=query, le="+Inf") == n
        assert sample(samples, "kvcoord_lookup_matched_fraction_count") == 40
        for worker in ("1", "2"):
            assert sample(samples, "kvcoord_lookup_worker_frames_applied_total", worker=worker) > 0
            assert ("kvcoord_lookup_worker_lag_seconds", (("worker", worker),)) in samples

        os.kill(co.pids[0], signal.SIGKILL)
        until(lambda: sample(scraped(), "kvcoord_lookup_worker_restarts_total", worker="1") == 1,
              "worker 1's restart in the scrape", diagnose=co.log.read_text)
        assert sample(scrape(co), "kvcoord_lookup_worker_restarts_total", worker="2") == 0
        answered: dict[str, int] = {}
        until(lambda: [answered.__setitem__(k, answered.get(k, 0) + v) for k, v in lookups(co, 4).items()]
              and answered.get("1") and answered.get("2"), "both workers to answer again")
        more = answered["1"] + answered["2"]
        samples = until(lambda: (got := scraped())
                        and sample(got, "kvcoord_lookup_answers_total") >= 40 + more and got,
                        "the restarted worker's lookups on top of its predecessor's")
        assert sample(samples, "kvcoord_lookup_answers_total") == 40 + more
        assert sample(samples, "kvcoord_lookup_latency_seconds_count") == 40 + more
