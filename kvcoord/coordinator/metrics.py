"""Prometheus metrics of one coordinator, in its own registry so several servers fit one process."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as PyCounter
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcoord import __version__
from kvcoord.coordinator.engines import RELAY_STATES
from kvcoord.coordinator.httpd import REFUSALS as HTTP_REFUSALS
from kvcoord.coordinator.metrics_http import MetricsEndpoint
from kvcoord.coordinator.worker_metrics import ProcessSums
from kvcoord.engine.relay import MALFORMED_KINDS
from kvcoord.events import Tier
from kvcoord.index.base import BackendMetrics, Index, IndexStats
from kvcoord.index.instrumented import OPS, InstrumentedIndex
from kvcoord.load import TRUSTS
from kvcoord.media import INDEXED_GROUP_KINDS, MISFIT_STORES, UNKNOWN_MEDIA
from kvcoord.native import native, native_paths

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Every label value the coordinator's call sites pass (tests/repo/test_alerts.py checks the sources against
# these). Their series exist at 0 from the start: a counter child born at its first increment has no
# earlier sample, so rate()/increase() read no increase and an alert on the first event never fires.
BATCH_OUTCOMES = ("applied", "duplicate", "gap", "awaiting_snapshot", "rejected", "too_large")
EVENT_TYPES = ("block_stored", "block_removed", "all_blocks_cleared")
REJECTED_TYPES = (*EVENT_TYPES, "unknown", "none")
"""``events_rejected{type}``: an event with no kind set is ``unknown``; an empty batch adds 0 to ``none``."""
REJECT_REASONS = ("unknown_dp_rank", "invalid_event", "max_hashes_per_batch", "max_entries_per_node")
SNAPSHOT_REASONS = ("hello", "gap", "invalid_batch", "index_reset")
VERIFY_RESULTS = ("ok", "mismatch", "skipped")
INDEX_RESET_NOTICES = ("lookup", "write", "generation_check")
"""``index_resets{noticed_by}``: what found the index's contents lost (``IndexHealth``)."""
STREAM_REFUSALS = ("max_streams", "hello_timeout", "snapshot_budget")
"""``ingest_streams_refused{reason}``: past ``max_streams``, no Hello within ``hello_timeout_s``, or a
snapshot past ``max_staged_snapshot_blocks``."""


class Tally(Protocol):
    """A histogram's counts as plain numbers: ``kvcoord._native.Tally`` or its twin :class:`PyTally`."""

    def observe(self, value: float, /) -> None: ...
    def counts(self) -> tuple[tuple[int, ...], float]: ...


class PyTally:
    """The Python twin of ``kvcoord._native.Tally`` (tally.c): the fallback, and the tests' oracle.

    Why not prometheus_client's Histogram: its ``observe`` takes a lock and walks Python objects (~1.5 us),
    more than a native lookup answer costs; a tally is exported at scrape time (:class:`LookupCollector`).
    """

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if any(not b < c for b, c in pairwise(bounds)):
            raise ValueError("bounds must increase")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float, /) -> None:
        """One value into the first bucket whose bound is not below it (the last: past every bound)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def counts(self) -> tuple[tuple[int, ...], float]:
        return tuple(self._counts), self._sum


def new_tally(bounds: tuple[float, ...]) -> Tally:
    """A native tally where the extension is built, else its twin."""
    return native.Tally(bounds) if native is not None else PyTally(bounds)


def _histogram_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs, ``+Inf`` last, labelled as prometheus_client labels them (``repr``
    of the float, for bounds like these)."""
    out, cum = [], 0
    for bound, n in zip(bounds, counts, strict=False):
        cum += n
        out.append((repr(float(bound)), float(cum)))
    out.append(("+Inf", float(sum(counts))))
    return out


class UnknownMediaCollector(Collector):
    """``kvcoord_unknown_medium_events_total{medium}``: events skipped because their medium maps to no tier,
    from this process's tally (its own relays, and what agents' heartbeats report): at most 32 names, the
    rest as ``other``."""

    def collect(self) -> list[Metric]:
        skipped = CounterMetricFamily(
            "kvcoord_unknown_medium_events",
            "KV events skipped (not indexed, scoring 0) because their medium maps to no tier, by medium: "
            "map it with [media] or the agent's --media", labels=["medium"])
        for name, count in sorted(UNKNOWN_MEDIA.total.items()):
            skipped.add_metric([name], float(count))
        misfit = CounterMetricFamily(
            "kvcoord_misfit_stored_events",
            "BlockStored events skipped (not indexed) because their token count is not block_size times "
            "their hashes (a sparse group of a hybrid model), by kv_cache_spec_kind", labels=["group_kind"])
        misfits = {kind: 0 for kind in INDEXED_GROUP_KINDS} | MISFIT_STORES.total  # those from 0 (alerted)
        for name, count in sorted(misfits.items()):
            misfit.add_metric([name], float(count))
        return [skipped, misfit]


class LookupCollector(Collector):
    """Lookup latency by query kind, the best node's share of each query, and the answers by path, from
    plain tallies and counts that the lookup paths update without prometheus_client."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> list[Metric]:
        m = self._m
        latency = HistogramMetricFamily("kvcoord_lookup_latency_seconds", "Lookup handling time",
                                        labels=["query"])
        for query, tally in sorted(m.lookup_tallies.items()):
            counts, total = tally.counts()
            latency.add_metric([query], _histogram_buckets(_LATENCY_BUCKETS, counts), sum_value=total)
        answers = CounterMetricFamily(
            "kvcoord_lookup_answers",
            "HTTP lookups answered, by path: fast (a plain lookup, from a view of its partition) or handler "
            "(the general path)", labels=["path"])
        for path, count in sorted(m.lookup_answers.items()):
            answers.add_metric([path], float(count))
        errors = CounterMetricFamily(
            "kvcoord_lookup_errors",
            "Lookups answered with an error (HTTP 4xx/5xx, a gRPC status), by kind: invalid, not_found, "
            "no_profile, unavailable (the index down; on a lookup worker, its copy not current), "
            "tokenizer_down, unimplemented, internal", labels=["kind"])
        for kind, count in sorted(m.lookup_errors.items()):
            errors.add_metric([kind], float(count))
        matched = HistogramMetricFamily("kvcoord_lookup_matched_fraction",
                                        "Best node's matched blocks / query blocks")
        counts, total = m.matched_fraction.counts()
        matched.add_metric([], _histogram_buckets(_FRACTION_BUCKETS, counts), sum_value=total)
        return [latency, answers, errors, matched]


class IndexCallCollector(Collector):
    """The index's core calls, as :class:`InstrumentedIndex` counts them: seconds of those that returned
    and the number that raised, per call, and the writes refused by fencing."""

    def __init__(self, index: InstrumentedIndex) -> None:
        self._ix = index

    def collect(self) -> list[Metric]:
        ix, labels = self._ix, ["backend", "op"]
        seconds = HistogramMetricFamily("kvcoord_index_call_seconds", "Index calls that returned, by call",
                                        labels=labels)
        errors = CounterMetricFamily("kvcoord_index_call_errors", "Index calls that raised, by call",
                                     labels=labels)
        for op in OPS:
            counts, total = ix.seconds[op].counts()
            buckets = _histogram_buckets(_LATENCY_BUCKETS, counts)
            seconds.add_metric([ix.backend, op], buckets, sum_value=total)
            errors.add_metric([ix.backend, op], float(ix.errors[op]))
        fenced = CounterMetricFamily(
            "kvcoord_index_fenced_writes",
            "Writes the backend refused: another replica had claimed the node since (fencing tokens)",
            labels=["backend"],
        )
        fenced.add_metric([ix.backend], float(ix.fenced_writes))
        return [seconds, errors, fenced]


class IndexBackendCollector(Collector):
    """Exports a backend's own plain counters (``RedisIndex.metrics``) at scrape time.

    The backend does not import prometheus; reading its counters here costs nothing on its hot path.
    """

    def __init__(self, metrics: BackendMetrics, backend: str) -> None:
        self._m = metrics
        self._buckets = metrics.latency_buckets
        self._backend = backend

    def collect(self) -> list[Metric]:
        m = self._m
        buckets = _histogram_buckets(self._buckets, list(m.latency_counts))
        rt = HistogramMetricFamily(
            "kvcoord_index_round_trip_seconds", "Index backend round trips (successful)", labels=["backend"]
        )
        rt.add_metric([self._backend], buckets, sum_value=float(m.round_trip_seconds))
        errors = CounterMetricFamily(
            "kvcoord_index_errors", "Failed index backend round trips, by kind", labels=["backend", "kind"]
        )
        conn = int(m.connection_errors)
        errors.add_metric([self._backend, "connection"], float(conn))
        errors.add_metric([self._backend, "other"], float(max(0, int(m.errors) - conn)))
        reconnects = CounterMetricFamily(
            "kvcoord_index_reconnects",
            "Times the index backend answered again after failing",
            labels=["backend"],
        )
        reconnects.add_metric([self._backend], float(m.reconnects))
        readonly = CounterMetricFamily(
            "kvcoord_index_not_primary",
            "Round trips refused by a node that is no longer the primary (READONLY, ROLE replica)",
            labels=["backend"],
        )
        readonly.add_metric([self._backend], float(m.readonly_errors))
        failovers = CounterMetricFamily(
            "kvcoord_index_failovers", "Failovers of the primary the sentinels announced", labels=["backend"]
        )
        failovers.add_metric([self._backend], float(m.failovers))
        out: list[Metric] = [rt, errors, reconnects, readonly, failovers]
        reclaimed = CounterMetricFamily(
            "kvcoord_index_reclaimed_entries",
            "Entries of removed/cleared locations reclaimed by the backend",
            labels=["backend"],
        )
        reclaimed.add_metric([self._backend], float(m.reclaimed_entries))
        out.append(reclaimed)
        reclaimed_nodes = CounterMetricFamily(
            "kvcoord_index_reclaimed_nodes",
            "Nodes of a dead replica whose entries this replica removed after their lease",
            labels=["backend"],
        )
        reclaimed_nodes.add_metric([self._backend], float(m.reclaimed_nodes))
        out.append(reclaimed_nodes)
        walked = CounterMetricFamily(
            "kvcoord_index_walked_lookups",
            "Lookups read from the backend on its pipelined fast path and walked in process (not the mirror)",
            labels=["backend"],
        )
        walked.add_metric([self._backend], float(m.walked_lookups))
        out.append(walked)
        waits = CounterMetricFamily("kvcoord_redis_wait", "Index writes followed by WAIT (?wait_replicas)",
                                    labels=["backend"])
        waits.add_metric([self._backend], float(m.waits))
        short = CounterMetricFamily("kvcoord_redis_wait_short", "WAITs that returned fewer replicas than "
                                    "wait_replicas: the write was not acknowledged and is retried",
                                    labels=["backend"])
        short.add_metric([self._backend], float(m.wait_short))
        wait_s = CounterMetricFamily("kvcoord_redis_wait_seconds", "Seconds in writes followed by WAIT (the "
                                     "script and its WAIT, one round trip)", labels=["backend"])
        wait_s.add_metric([self._backend], float(m.wait_seconds))
        out += [waits, short, wait_s]
        mirror = m.mirror
        if mirror is not None:
            ready = GaugeMetricFamily(
                "kvcoord_index_mirror_ready", "1 while lookups are answered from the index's in-memory copy"
            )
            ready.add_metric([], 1.0 if mirror.ready else 0.0)
            loads = CounterMetricFamily(
                "kvcoord_index_mirror_loads", "Full loads of the copy (start, missed feed entries, restarts)"
            )
            loads.add_metric([], float(mirror.loads))
            entries = CounterMetricFamily("kvcoord_index_mirror_feed_entries", "Change-feed entries replayed")
            entries.add_metric([], float(mirror.entries_applied))
            lookups = CounterMetricFamily("kvcoord_index_mirror_lookups", "Lookups answered from the copy")
            lookups.add_metric([], float(mirror.lookups))
            out += [ready, loads, entries, lookups]
        return out


class Metrics:
    """Every ``kvcoord_*`` series, plus plain counters the Stats RPC reports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sums = ProcessSums()
        """The lookup families, with the lookup workers' counts added (:mod:`.worker_metrics`)."""
        self._declare_ingest(r)
        self._declare_index(r)
        self._declare_histograms(r)
        self._declare_verify_and_resync(r)
        # Plain totals for the Stats RPC (prometheus counters are not meant to be read back).
        self.applied_by_type: PyCounter[str] = PyCounter()
        self.rejected_by_reason: PyCounter[str] = PyCounter()
        self.hash_mismatch_total = 0
        self.snapshots_requested_total = 0
        self.leases_expired_total = 0
        self.endpoint = MetricsEndpoint(self.registry)
        """The /metrics HTTP server, started by ``endpoint.serve``."""
        self._known_series: set[tuple[str, str]] = set()
        self._known_models: set[str] = set()
        # labels(...) costs a lock and a tuple-keyed lookup per call; the hot paths use cached children.
        self._children: dict[tuple[int, str], Any] = {}
        self._rejected_children: dict[tuple[str, str], Any] = {}
        self._create_at_zero()
        self.build_info = Gauge("kvcoord_build_info", "1, labelled with this build: version and the hot "
                                "paths running natively", ["version", "native"], registry=r)
        self.build_info.labels(__version__, ",".join(native_paths()) or "none").set(1)

    def _declare_ingest(self, r: CollectorRegistry) -> None:
        """Events and batches as agents stream them in."""
        self.events_applied = Counter(
            "kvcoord_events_applied", "KV events applied to the index", ["type"], registry=r
        )
        self.events_rejected = Counter(
            "kvcoord_events_rejected", "KV events not applied, by reason", ["type", "reason"], registry=r
        )
        self.batches = Counter(
            "kvcoord_batches", "Event batches received, by outcome", ["outcome"], registry=r
        )

    def _declare_index(self, r: CollectorRegistry) -> None:
        """The index's size and health, the registry's nodes and open streams (refreshed periodically)."""
        self.entries = Gauge(
            "kvcoord_index_entries",
            "(block, location) entries by model and tier",
            ["model", "tier"],
            registry=r,
        )
        self.blocks = Gauge(
            "kvcoord_index_blocks",
            "Distinct blocks by model (an upper bound while kvcoord_index_blocks_upper_bound is 1)",
            ["model"],
            registry=r,
        )
        self.blocks_upper_bound = Gauge(
            "kvcoord_index_blocks_upper_bound",
            "1 when kvcoord_index_blocks is a per-shard sum (an upper bound), 0 when exact",
            registry=r,
        )
        self.index_bytes = Gauge("kvcoord_index_bytes", "Estimated bytes held by the index", registry=r)
        self.index_up = Gauge(
            "kvcoord_index_up", "1 when the index backend answers its ping", ["backend"], registry=r
        )
        self.nodes = Gauge("kvcoord_nodes", "Registered nodes by state", ["state"], registry=r)
        self.nodes_by_trust = Gauge(
            "kvcoord_nodes_by_trust", "Registered nodes (not expired) by trust state", ["trust"], registry=r
        )
        for trust in TRUSTS:
            self.nodes_by_trust.labels(trust).set(0)
        self.registered_engines = Gauge(
            "kvcoord_registered_engines", "Engines registered over HTTP that this replica relays, by state: "
            "active (answered within the lease), connecting, unreachable (in no lookup answer), failed, "
            "pending", ["state"], registry=r)
        for state in RELAY_STATES:
            self.registered_engines.labels(state).set(0)
        self.relay_malformed = Counter(
            "kvcoord_relay_malformed", "Frames and batches of engines registered over HTTP that this "
            "replica's relays could not use, by reason (each lost batch marks its rank degraded)", ["reason"],
            registry=r)
        for reason in MALFORMED_KINDS:  # from 0, so that increase() sees the first one
            self.relay_malformed.labels(reason)
        self.unknown_pools = Counter(
            "kvcoord_pool_unknown_announcements", "Pool names a node announced (Hello, /register) that no "
            "[pools] entry or pool publisher declared at the time (the node still reaches them)", registry=r)
        self.streams = Gauge("kvcoord_ingest_streams", "Open agent ingest streams, engines registered over "
                             "HTTP and relayed here included", registry=r)
        self.streams_refused = Counter(
            "kvcoord_ingest_streams_refused", "Ingest streams refused, or closed for sending no Hello",
            ["reason"], registry=r,
        )
        self.http_refusals = Counter(
            "kvcoord_http_refused", "HTTP API clients refused: a head too slow or too large, or past "
            "max_connections", ["reason"], registry=None,
        )

    def _declare_histograms(self, r: CollectorRegistry) -> None:
        """Lookup latency, how much of a query the best node held, and ingest lag."""
        self.lookup_tallies: dict[str, Tally] = {q: new_tally(_LATENCY_BUCKETS) for q in ("tokens", "hashes")}
        """``kvcoord_lookup_latency_seconds{query}``, per query kind."""
        self.matched_fraction = new_tally(_FRACTION_BUCKETS)
        """``kvcoord_lookup_matched_fraction``."""
        self.lookups_cancelled = Counter(
            "kvcoord_lookups_cancelled", "gRPC lookups the client gave up on before the answer (its deadline "
            "passed or it cancelled, as a router does after --deadline-ms): not answered, not an error",
            registry=r)
        self.lookup_deadline_exceeded = Counter(
            "kvcoord_lookup_deadline_exceeded", "Lookups answered UNAVAILABLE because the index did not "
            "answer within lookup_deadline (a stalled or failing-over backend)", registry=None)
        self.lookup_answers = {"fast": 0, "handler": 0}
        """``kvcoord_lookup_answers_total{path}``: HTTP lookups answered by each path."""
        self.lookup_errors: PyCounter[str] = PyCounter()
        """``kvcoord_lookup_errors_total{kind}``: lookups (HTTP and gRPC) answered with an error."""
        self.sums.register(r, LookupCollector(self), self.lookup_deadline_exceeded, self.http_refusals)
        r.register(UnknownMediaCollector())
        self.ingest_lag = Histogram(
            "kvcoord_ingest_lag_seconds",
            "Engine event timestamp to applied",
            buckets=_LAG_BUCKETS,
            registry=r,
        )

    def _declare_verify_and_resync(self, r: CollectorRegistry) -> None:
        """Hash verification, snapshots and leases: the signs of an engine out of step."""
        self.hash_mismatches = Counter(
            "kvcoord_hash_mismatches", "Engine hashes that did not verify", ["model"], registry=r
        )
        self.hash_verifications = Counter(
            "kvcoord_hash_verifications", "Sampled block chains verified", ["result"], registry=r
        )
        self.profiles_learned = Counter(
            "kvcoord_hash_profile_learned", "Hash profiles learned from a model's events (none configured)",
            ["model", "algo"], registry=r
        )
        self.snapshots_requested = Counter(
            "kvcoord_snapshots_requested", "Snapshot requests sent to agents", ["reason"], registry=r
        )
        self.index_resets = Counter(
            "kvcoord_index_resets", "Times the index was found to have lost its contents (a Redis flushed or "
            "restarted empty), by what noticed it: a lookup, a write (each in its own round trip), or the "
            "periodic generation check", ["noticed_by"], registry=r
        )
        self.snapshots_applied = Counter(
            "kvcoord_snapshots_applied", "Snapshots that replaced a node's entries", registry=r
        )
        self.leases_expired = Counter(
            "kvcoord_leases_expired", "Nodes dropped for missing their lease", registry=r
        )

    def _create_at_zero(self) -> None:
        """Every bounded label set's series exists at 0 from the start (see the note on BATCH_OUTCOMES)."""
        # Bounded label sets only (never per node): models come in through model_seen.
        for outcome in BATCH_OUTCOMES:
            self._child(self.batches, outcome)
        for kind in EVENT_TYPES:
            self._child(self.events_applied, kind)
        for kind in REJECTED_TYPES:
            for reason in REJECT_REASONS:
                self._rejected_child(kind, reason)
        for reason in SNAPSHOT_REASONS:
            self._child(self.snapshots_requested, reason)
        for result in VERIFY_RESULTS:
            self._child(self.hash_verifications, result)
        for notice in INDEX_RESET_NOTICES:
            self._child(self.index_resets, notice)
        for reason in STREAM_REFUSALS:
            self._child(self.streams_refused, reason)
        for reason in HTTP_REFUSALS:
            self._child(self.http_refusals, reason)

    def instrument(self, index: Index) -> InstrumentedIndex:
        """``index`` wrapped so that its core calls are timed and counted, exported here with the
        backend's own counters when it keeps them (a remote backend does)."""
        wrapped = InstrumentedIndex(index, lambda: new_tally(_LATENCY_BUCKETS))
        self.sums.register(self.registry, IndexCallCollector(wrapped))
        if index.remote is not None:
            self.registry.register(IndexBackendCollector(index.remote.metrics, index.backend))
        return wrapped

    def _child(self, metric: Any, label: str) -> Any:
        key = (id(metric), label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(label)
        return child

    def _rejected_child(self, kind: str, reason: str) -> Any:
        key = (kind, reason)
        child = self._rejected_children.get(key)
        if child is None:
            child = self._rejected_children[key] = self.events_rejected.labels(kind, reason)
        return child

    def model_seen(self, *models: str) -> None:
        """Create ``hash_mismatches{model}`` at 0 for each model (configured, or named by a Hello), so
        that ``increase()`` counts a model's first mismatch. Cheap once a model is known."""
        for model in models:
            self._child(self.hash_mismatches, model)

    def batch(self, outcome: str, n: int = 1) -> None:
        """Count event batches by outcome (applied, duplicate, gap, ...)."""
        self._child(self.batches, outcome).inc(n)

    def lookup_done(self, query: str, seconds: float) -> None:
        self.lookup_tally(query).observe(seconds)

    def lookup_tally(self, query: str) -> Tally:
        tally = self.lookup_tallies.get(query)
        if tally is None:
            tally = self.lookup_tallies[query] = new_tally(_LATENCY_BUCKETS)
        return tally

    def applied(self, kind: str, n: int = 1) -> None:
        self._child(self.events_applied, kind).inc(n)
        self.applied_by_type[kind] += n

    def rejected(self, kind: str, reason: str, n: int = 1) -> None:
        self._rejected_child(kind, reason).inc(n)
        self.rejected_by_reason[reason] += n

    def relay_malformed_seen(self, reason: str) -> None:
        self._child(self.relay_malformed, reason).inc()

    def stream_refused(self, reason: str) -> None:
        self._child(self.streams_refused, reason).inc()

    def http_refused(self, reason: str) -> None:
        self._child(self.http_refusals, reason).inc()

    def snapshot_requested(self, reason: str) -> None:
        self._child(self.snapshots_requested, reason).inc()
        self.snapshots_requested_total += 1

    def lease_expired(self) -> None:
        self.leases_expired.inc()
        self.leases_expired_total += 1

    def hash_verified(self, result: str) -> None:
        """One sampled chain recomputed: ``ok``, ``mismatch`` or ``skipped``."""
        self._child(self.hash_verifications, result).inc()

    def hash_mismatch(self, model: str) -> None:
        self._child(self.hash_mismatches, model).inc()
        self.hash_mismatch_total += 1

    def set_index_stats(self, stats: IndexStats) -> None:
        """Refresh the size gauges; series that went to zero are set to 0, not left stale."""
        self.index_bytes.set(stats.bytes)
        self.blocks_upper_bound.set(1 if stats.blocks_upper_bound else 0)
        seen: set[tuple[str, str]] = set()
        for (model, tier), n in stats.entries_by_model_tier.items():
            key = (model, Tier(tier).name)
            seen.add(key)
            self.entries.labels(*key).set(n)
        for key in self._known_series - seen:
            self.entries.labels(*key).set(0)
        self._known_series |= seen
        models = set(stats.blocks_by_model)
        for model, n in stats.blocks_by_model.items():
            self.blocks.labels(model).set(n)
        for model in self._known_models - models:
            self.blocks.labels(model).set(0)
        self._known_models |= models

    def set_registered_engines(self, by_state: dict[str, int]) -> None:
        for state in RELAY_STATES:
            self.registered_engines.labels(state).set(by_state.get(state, 0))

    def set_nodes(self, by_state: dict[str, int], by_trust: dict[str, int]) -> None:
        for state in ("active", "draining", "resyncing", "hash_mismatch", "expired"):
            self.nodes.labels(state).set(by_state.get(state, 0))
        for trust in TRUSTS:
            self.nodes_by_trust.labels(trust).set(by_trust.get(trust, 0))
