"""The lookup workers' metrics in the main process's ``/metrics`` (``kvcoord serve --lookup-workers N``).

Each worker (:mod:`kvcoord.coordinator.lookup_worker`) sends a :class:`Report` every :data:`REPORT_EVERY`
seconds over its stdout pipe (length-prefixed msgpack, decoded into a typed struct: nothing from a child
is unpickled): the frames it applied and when the main process sent the newest of them, and in every
:data:`SAMPLES_EVERY`-th its samples of the lookup families (:class:`ProcessSums`: latency, answers by
path, the matched fraction, deadlines missed, HTTP refusals, the index's calls). The main process adds
the workers' samples to its own series of the same name and labels, as prometheus_client's multiprocess
mode sums counters: an operator sees one lookup rate per coordinator. A worker's totals outlive it: a
restarted worker's counts go on top of the last ones its predecessor reported, so counters never go down
(what a killed worker answered after its last samples, at most half a second of lookups, is lost with it;
one stopped by SIGTERM sends its last). Per worker (label ``worker``): frames applied, its lag behind the
main process, restarts (:class:`WorkerReports`).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvcoord.coordinator")

__all__ = ["REPORT_EVERY", "SAMPLES_EVERY", "ProcessSums", "Report", "WorkerReports", "encode_report"]

REPORT_EVERY = 0.1
"""Seconds between a worker's reports."""
SAMPLES_EVERY = 5
"""Every this many reports carry the samples (collecting them costs about 3 ms; the others, only the
frames and lag)."""
MAX_REPORT_BYTES = 16 * 1024 * 1024
"""A report longer than this is taken for a broken pipe (the worker's reports are then ignored)."""

Labels = list[tuple[str, str]]
Key = tuple[str, tuple[tuple[str, str], ...]]
"""A sample's name and its labels, sorted."""

_LEN = struct.Struct("!Q")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
"""A family's sample names (besides its own name, a gauge's, which workers do not add to)."""


class Report(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What one worker process counted since it started."""

    sent: float
    """The main process's ``time.monotonic()`` when it sent the newest frame the worker applied."""
    frames: int
    """Frames (snapshots and deltas) the worker applied."""
    samples: list[tuple[str, Labels, float]] | None = None
    """Its samples of the families :class:`ProcessSums` sums (``_created`` left out); None: as in its last
    report."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Report)


def encode_report(report: Report) -> bytes:
    body = _encoder.encode(report)
    return _LEN.pack(len(body)) + body


def _key(name: str, labels: Iterable[tuple[str, str]]) -> Key:
    return name, tuple(sorted(labels))


class _Summed(Collector):
    """Some families of this process, with the samples of the same series in ``sums.added`` added."""

    def __init__(self, sources: tuple[Collector, ...], sums: ProcessSums) -> None:
        self.sources = sources
        self._sums = sums

    def own(self) -> list[Metric]:
        return [family for source in self.sources for family in source.collect()]

    def collect(self) -> list[Metric]:
        families = self.own()
        added = self._sums.added
        if not added:
            return families
        for family in families:
            seen: set[Key] = set()
            for i, s in enumerate(family.samples):
                key = _key(s.name, s.labels.items())
                seen.add(key)
                if key in added and not s.name.endswith("_created"):
                    family.samples[i] = s._replace(value=s.value + added[key])
            for (name, labels), value in added.items():  # a series only workers have (none at the start)
                if (name, labels) not in seen and name.removeprefix(family.name) in _SUFFIXES:
                    family.add_sample(name, dict(labels), value)
        return families


class ProcessSums:
    """The families whose series the lookup workers count too, summed over the processes."""

    def __init__(self) -> None:
        self.added: dict[Key, float] = {}
        """The workers' samples, replaced whole (the scrape runs on another thread)."""
        self._collectors: list[_Summed] = []

    def register(self, registry: CollectorRegistry, *sources: Collector) -> None:
        """Export ``sources`` through ``registry``, summed (each registered here, not in ``registry``)."""
        collector = _Summed(sources, self)
        self._collectors.append(collector)
        registry.register(collector)

    def own_samples(self) -> list[tuple[str, Labels, float]]:
        """This process's samples of the summed families (a worker's report)."""
        return [(s.name, sorted(s.labels.items()), s.value) for c in self._collectors for family in c.own()
                for s in family.samples if not s.name.endswith("_created")]


@dataclass(slots=True, eq=False)
class _Live:
    """One worker process's last reported figures."""

    frames: int = 0
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)


async def _next(number: int, stream: asyncio.StreamReader) -> Report | None:
    """A worker's next report; None at the end of its pipe, or after one that cannot be read (logged)."""
    try:
        (size,) = _LEN.unpack(await stream.readexactly(_LEN.size))
        if size > MAX_REPORT_BYTES:
            raise ValueError(f"a report of {size} bytes")
        return _decoder.decode(await stream.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except (ValueError, msgspec.DecodeError) as exc:
        log.error("lookup worker %d: unreadable metrics report (%s); its reports are ignored", number, exc)
        return None


@dataclass(slots=True)
class _Tally:
    """One worker number, across its processes."""

    number: int
    restarts: int = 0
    frames: int = 0
    """Frames applied by its processes that exited."""
    samples: dict[Key, float] = field(default_factory=dict)
    """The last samples reported by its processes that exited, summed."""
    live: list[_Live] = field(default_factory=list)
    """Its processes whose reports are still read (one, but for a moment at a restart)."""
    sent: float = 0.0
    """Newest ``Report.sent`` (or when it started)."""


class WorkerReports(Collector):
    """The main process's side: reads each worker's reports, feeds ``sums`` and exports per worker."""

    def __init__(self, count: int, sums: ProcessSums) -> None:
        self.tallies = [_Tally(n + 1, sent=time.monotonic()) for n in range(count)]
        self.sums = sums

    def restarted(self, number: int) -> None:
        self.tallies[number - 1].restarts += 1

    async def read(self, number: int, stream: asyncio.StreamReader) -> None:
        """Take one worker process's reports until its pipe closes; then keep its last counts."""
        tally = self.tallies[number - 1]
        process = _Live()
        tally.live.append(process)
        try:
            while (report := await _next(number, stream)) is not None:
                tally.sent = max(tally.sent, report.sent)
                process.frames = report.frames
                if report.samples is not None:
                    process.samples = report.samples
                    self._sum()
        finally:
            tally.live.remove(process)
            tally.frames += process.frames
            for name, labels, value in process.samples:
                key = _key(name, labels)
                tally.samples[key] = tally.samples.get(key, 0.0) + value
            self._sum()

    def _sum(self) -> None:
        added: dict[Key, float] = {}
        for tally in self.tallies:
            for key, value in tally.samples.items():
                added[key] = added.get(key, 0.0) + value
            for process in tally.live:
                for name, labels, value in process.samples:
                    key = _key(name, labels)
                    added[key] = added.get(key, 0.0) + value
        self.sums.added = added

    def collect(self) -> list[Metric]:
        now = time.monotonic()
        frames = CounterMetricFamily(
            "kvcoord_lookup_worker_frames_applied",
            "Frames of the main process's feed (snapshots and changes) each lookup worker applied, its "
            "restarts included", labels=["worker"])
        lag = GaugeMetricFamily(
            "kvcoord_lookup_worker_lag_seconds",
            "Age of the main process's state each lookup worker answered from at its last report (0.1 s "
            "apart; a worker answers 503 past 0.5 s without a frame)", labels=["worker"])
        restarts = CounterMetricFamily(
            "kvcoord_lookup_worker_restarts", "Lookup worker processes that exited and were started again",
            labels=["worker"])
        for tally in self.tallies:
            worker = [str(tally.number)]
            frames.add_metric(worker, float(tally.frames + sum(p.frames for p in tally.live)))
            lag.add_metric(worker, max(0.0, now - tally.sent))
            restarts.add_metric(worker, float(tally.restarts))
        return [frames, lag, restarts]
