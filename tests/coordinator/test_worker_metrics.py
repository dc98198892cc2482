"""kvcoord/coordinator/worker_metrics.py on real objects: a worker's :class:`Metrics` reported over a
stream as the pipe carries it, summed into the main process's series of the same name and labels, kept
when the worker's process ends and added to by its successor, and an unreadable report refused.
tests/coordinator/test_lookup_worker_metrics.py runs the same through real processes."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.worker_metrics import Report, WorkerReports, encode_report
from kvcoord.index.memory import MemoryIndex
from tests.http_util import Samples, parse_samples
from tests.procs import until_async


def samples(m: Metrics) -> Samples:
    return parse_samples(generate_latest(m.registry).decode())


def answers(m: Metrics, path: str) -> float:
    return samples(m)[("kvcoord_lookup_answers_total", (("path", path),))]


def worker_metrics(lookups: int) -> Metrics:
    """A worker's metrics after ``lookups`` fast lookups, a refused client and a missed deadline."""
    m = Metrics()
    m.instrument(MemoryIndex())
    for _ in range(lookups):
        m.lookup_done("tokens", 0.0003)
        m.lookup_answers["fast"] += 1
        m.matched_fraction.observe(1.0)
    m.http_refused("max_connections")
    m.lookup_deadline_exceeded.inc()
    return m


def report(m: Metrics, frames: int, sent: float = 0.0) -> bytes:
    return encode_report(Report(sent or time.monotonic(), frames, m.sums.own_samples()))


async def test_worker_counts_add_to_the_main_series_and_outlive_the_worker() -> None:
    main = Metrics()
    main.instrument(MemoryIndex())
    main.lookup_answers["fast"] += 2  # the main process's own
    reports = WorkerReports(2, main.sums)
    main.registry.register(reports)
    created = ("kvcoord_lookup_deadline_exceeded_created", ())
    created_at = samples(main)[created]

    first = asyncio.StreamReader()
    reading = asyncio.ensure_future(reports.read(1, first))
    first.feed_data(report(worker_metrics(3), frames=5))
    await until_async(lambda: asyncio.sleep(0, answers(main, "fast") == 5), "the first report summed")
    first.feed_data(report(worker_metrics(4), frames=6))  # totals, not increments: the later one counts
    await until_async(lambda: asyncio.sleep(0, answers(main, "fast") == 6), "the second report")
    first.feed_data(encode_report(Report(time.monotonic(), 7)))  # no samples: the frames and lag only
    frames = ("kvcoord_lookup_worker_frames_applied_total", (("worker", "1"),))
    await until_async(lambda: asyncio.sleep(0, samples(main)[frames] == 7), "a report without samples")
    first.feed_eof()  # the worker exited
    await reading
    got = samples(main)
    assert got[("kvcoord_lookup_answers_total", (("path", "fast"),))] == 6
    assert got[("kvcoord_lookup_latency_seconds_count", (("query", "tokens"),))] == 4
    assert got[("kvcoord_lookup_latency_seconds_bucket", (("le", "0.0005"), ("query", "tokens")))] == 4
    assert got[("kvcoord_lookup_matched_fraction_count", ())] == 4
    assert got[("kvcoord_http_refused_total", (("reason", "max_connections"),))] == 1
    assert got[("kvcoord_lookup_deadline_exceeded_total", ())] == 1
    assert got[frames] == 7
    assert got[("kvcoord_lookup_worker_frames_applied_total", (("worker", "2"),))] == 0
    assert got[created] == created_at  # the main process's own, not a sum of times

    # its successor starts from 0; its counts go on top of the dead one's
    reports.restarted(1)
    second = asyncio.StreamReader()
    reading = asyncio.ensure_future(reports.read(1, second))
    successor = worker_metrics(1)
    successor.lookup_tally("images").observe(0.002)  # a series the main process never had
    second.feed_data(report(successor, frames=2, sent=time.monotonic()))
    await until_async(lambda: asyncio.sleep(0, answers(main, "fast") == 7), "the successor's report")
    got = samples(main)
    assert got[("kvcoord_lookup_latency_seconds_count", (("query", "images"),))] == 1
    assert got[("kvcoord_http_refused_total", (("reason", "max_connections"),))] == 2
    assert got[frames] == 9
    assert got[("kvcoord_lookup_worker_restarts_total", (("worker", "1"),))] == 1
    assert got[("kvcoord_lookup_worker_lag_seconds", (("worker", "1"),))] < 60
    second.feed_eof()
    await reading
    assert answers(main, "fast") == 7


async def test_an_unreadable_report_is_refused_and_its_last_counts_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    main = Metrics()
    reports = WorkerReports(1, main.sums)
    stream = asyncio.StreamReader()
    stream.feed_data(report(worker_metrics(2), frames=1))
    stream.feed_data(b"\x00" * 7 + b"\x05" + b"junk!")  # a length, then no report
    stream.feed_data(report(worker_metrics(9), frames=1))  # never read: the stream is given up
    await asyncio.wait_for(reports.read(1, stream), timeout=30)
    assert answers(main, "fast") == 2
    assert "lookup worker 1: unreadable metrics report" in caplog.text
    huge = asyncio.StreamReader()
    huge.feed_data((1 << 40).to_bytes(8, "big"))
    await asyncio.wait_for(reports.read(1, huge), timeout=30)
    assert answers(main, "fast") == 2
