"""The alert rules fire and the dashboard shows data, checked against a real Prometheus.

The end-to-end test starts a real ``prometheus`` that scrapes two real ``kvcoord serve`` processes and a
real ``kvcoord route`` every second and evaluates deploy/prometheus/alerts.yml with only the ``for:``
durations shortened. Then it causes each rule's condition for real: an engine whose hashes do not verify,
events with an old engine timestamp, a node that stops heart-beating, an invalid batch, a killed
redis-server, a stopped coordinator; and for the router, two sim-engines whose agents announce each
other's ``--serving-url`` (swapped sidecar flags: the index is right about which engine holds a prefix, but
the router sends the request to the other one, whose cache is cold, so achieved falls far below
predicted), a router left without its coordinator, and a router killed (SIGKILL). The engine whose hashes
do not verify is also the node in trust state ``degraded``. Alerts on a target being down are shown
not to fire while it is scraped. It waits for Prometheus to report each alert
``firing``, and runs every Grafana panel query against the same Prometheus. The fast tests check that
every labelled counter the alerts and panels read exists at 0 before its first increment; without that,
``rate()`` and ``increase()`` see no increase and an alert on a first event never fires.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import re
import shutil
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcoord.coordinator import metrics as kvmetrics
from kvcoord.coordinator.incoming import KINDS as _BATCH_KINDS
from kvcoord.coordinator.metrics import Metrics
from kvcoord.engine.relay import MALFORMED_KINDS
from kvcoord.events import BlockStored
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.media import INDEXED_GROUP_KINDS
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pb_grpc
from kvcoord.validate import pack_u64
from kvcoord.wire import events_to_proto, pack_tokens
from tests.http_util import get_text, http_json, http_request
from tests.procs import FIXTURES, REPO, free_port, kvcoord_cmd, running, stop, until, wait_for_port
from tests.redis_servers import REDIS_SERVER, redis_server
from tests.repo.test_alert_rules import promtool_tested

PROMETHEUS_BIN = shutil.which("prometheus")
DEPLOY_PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvcoord.json"

MODEL = "Qwen/Qwen3-0.6B"
PROFILE = HashProfile("sha256_cbor", 16, seed="42")
"""The coordinator's profile for MODEL: the fixture engine's (PYTHONHASHSEED=42)."""
UNSEEDED = HashProfile("sha256_cbor", 16, seed="vllm-none-hash")
"""The same engine started without PYTHONHASHSEED (vLLM >= 0.29): hashes that do not verify."""
LEASE_MODEL = "lease-demo"
"""A model only a Hello names (the lease coordinator has no [models])."""

DEADLINE = 180.0
"""Seconds any one wait may take. Generous: only a broken rule or metric should hit it."""
SLOP = 2.0
"""An alert's activeAt may precede the moment its cause was set off by up to one scrape in flight
(scrapes time out after the 1 s interval); twice that, to be safe."""

T = TypeVar("T")


# --- fast: the counters exist at 0 before their first increment ----------------------------------
def _label_strings(node: ast.expr) -> set[str]:
    """The string constants an argument can evaluate to (both arms of ``a if c else b``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _label_strings(node.body) | _label_strings(node.orelse)
    return set()


def _literals(method: str, pos: int, receiver: Callable[[str], bool]) -> set[str]:
    """String literals passed as argument ``pos`` of ``<receiver>.<method>(...)`` in kvcoord/coordinator."""
    out: set[str] = set()
    for path in sorted((REPO / "kvcoord" / "coordinator").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == method and receiver(ast.unparse(node.func.value))
                    and pos < len(node.args)):  # fmt: skip
                out |= _label_strings(node.args[pos])
    return out


def _metrics(receiver: str) -> bool:
    """``m``, ``st.metrics``, ``self.state.metrics``: a Metrics object."""
    return receiver == "m" or receiver.endswith("metrics")


def _self(receiver: str) -> bool:
    return receiver == "self"


def test_label_sets_are_exactly_what_the_call_sites_pass() -> None:
    """The children created at 0 are every literal the code passes, and nothing it never does: a new
    outcome or reason at a call site must be added to metrics.py too (or its first one goes unseen)."""
    assert set(kvmetrics.BATCH_OUTCOMES) == _literals("batch", 0, _metrics)
    # snapshot_requested(reason) directly, and through the ingest session's _request_snapshot
    assert set(kvmetrics.SNAPSHOT_REASONS) == (
        _literals("snapshot_requested", 0, _metrics) | _literals("_request_snapshot", 1, _self))
    assert set(kvmetrics.VERIFY_RESULTS) == _literals("_result", 0, _self)  # the verifier's callback
    # Reasons come through the ingest session's _reject and _count_rejected. The "undecodable_<kind>" form
    # needs an EventDecodeError, which the protobuf decoders the coordinator uses never raise: left to
    # first use.
    reasons = (_literals("_reject", 2, _self) | _literals("_count_rejected", 1, _self)
               | _literals("rejected", 1, _metrics))
    assert set(kvmetrics.REJECT_REASONS) == reasons
    kinds = set(_BATCH_KINDS) - {"unknown"}  # what batches are counted by, less an event of no known kind
    assert set(kvmetrics.EVENT_TYPES) == kinds == _literals("applied", 0, _metrics)
    # a rejected event's type: its kind as batches count it ("unknown" for none known), or "none"
    types = set(_BATCH_KINDS) | _literals("rejected", 0, _metrics)
    assert set(kvmetrics.REJECTED_TYPES) == types


def _malformed_literals() -> set[str]:
    """The reasons the relays count malformed: literal kinds of ``EventDecodeError``/``FrameError`` and of
    ``_bad_batch`` in kvcoord/events.py and kvcoord/engine, and the ``kind = "..."`` the decoders pick."""
    out: set[str] = set()
    for path in [REPO / "kvcoord" / "events.py", *sorted((REPO / "kvcoord" / "engine").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args:
                name = ast.unparse(node.func)
                if name in ("EventDecodeError", "FrameError"):
                    out |= _label_strings(node.args[0])
                elif name.endswith("._bad_batch") and len(node.args) > 1:
                    out |= _label_strings(node.args[1])
            elif (isinstance(node, ast.Assign) and path.name == "events.py"
                  and [ast.unparse(t) for t in node.targets] == ["kind"]):
                out |= _label_strings(node.value)
    return out


def test_relay_malformed_reasons_and_alerted_group_kinds_are_complete() -> None:
    """``relay_malformed_total``'s children at 0 are every reason a relay counts; KvcoordMisfitStores
    watches exactly the indexed group kinds, whose children are at 0."""
    assert set(MALFORMED_KINDS) == _malformed_literals()
    rules = [r for g in yaml.safe_load((DEPLOY_PROMETHEUS / "alerts.yml").read_text())["groups"]
             for r in g["rules"]]
    [expr] = [r["expr"] for r in rules if r["alert"] == "KvcoordMisfitStores"]
    alerted = expr.split('group_kind=~"', 1)[1].split('"', 1)[0].split("|")
    assert sorted(alerted) == sorted(INDEXED_GROUP_KINDS)


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_fresh_metrics_export_every_known_counter_child_at_zero() -> None:
    m = Metrics()
    m.model_seen("a", "b")
    m.model_seen("a")  # again: nothing new
    got = _samples(m)
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for o in kvmetrics.BATCH_OUTCOMES:
        expected[("kvcoord_batches_total", (("outcome", o),))] = 0.0
    for k in kvmetrics.EVENT_TYPES:
        expected[("kvcoord_events_applied_total", (("type", k),))] = 0.0
    for k in kvmetrics.REJECTED_TYPES:
        for r in kvmetrics.REJECT_REASONS:
            expected[("kvcoord_events_rejected_total", (("reason", r), ("type", k)))] = 0.0
    for r in kvmetrics.SNAPSHOT_REASONS:
        expected[("kvcoord_snapshots_requested_total", (("reason", r),))] = 0.0
    for r in kvmetrics.VERIFY_RESULTS:
        expected[("kvcoord_hash_verifications_total", (("result", r),))] = 0.0
    for model in ("a", "b"):
        expected[("kvcoord_hash_mismatches_total", (("model", model),))] = 0.0
    for r in MALFORMED_KINDS:
        expected[("kvcoord_relay_malformed_total", (("reason", r),))] = 0.0
    for name in {n for n, _ in expected}:
        have = {k: v for k, v in got.items() if k[0] == name}
        assert have == {k: v for k, v in expected.items() if k[0] == name}, name
    # Misfits are a process-wide tally (earlier tests in this process may have counted some): the indexed
    # kinds are there, at 0 unless counted.
    misfit = {k[1][0][1] for k in got if k[0] == "kvcoord_misfit_stored_events_total"}
    assert set(INDEXED_GROUP_KINDS) <= misfit, misfit
    # The children counted later are the ones created up front (cached), and the Stats totals still count.
    m.hash_mismatch("a")
    m.rejected("block_stored", "invalid_event", 3)
    m.batch("rejected")
    m.snapshot_requested("invalid_batch")
    got = _samples(m)
    assert got[("kvcoord_hash_mismatches_total", (("model", "a"),))] == 1.0
    rejected = (("reason", "invalid_event"), ("type", "block_stored"))
    assert got[("kvcoord_events_rejected_total", rejected)] == 3.0
    assert got[("kvcoord_batches_total", (("outcome", "rejected"),))] == 1.0
    assert got[("kvcoord_snapshots_requested_total", (("reason", "invalid_batch"),))] == 1.0
    totals = (m.hash_mismatch_total, m.rejected_by_reason["invalid_event"], m.snapshots_requested_total)
    assert totals == (1, 3, 1)
    # A label value no call site names today still works (created at its first use).
    m.batch("something_new")
    assert _samples(m)[("kvcoord_batches_total", (("outcome", "something_new"),))] == 1.0


# --- a real Prometheus -----------------------------------------------------------------------------
class Prometheus:
    """The HTTP API of the test's own Prometheus."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        reply = http_request("GET", url)
        assert reply.status == 200, f"{path} {params}: HTTP {reply.status}: {reply.text[:500]}"  # a bad query
        body = reply.json()
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            return http_request("GET", self.base + "/-/ready", timeout=5).status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]

    def last_evaluation(self) -> float:
        """Wall time of the oldest group's last evaluation (0 before the first)."""
        groups = self.get("/api/v1/rules")["groups"]
        return min((_ts(g.get("lastEvaluation", "")) for g in groups), default=0.0)

    def firing(self, name: str, labels: dict[str, str]) -> dict[str, Any] | None:
        for a in self.alerts():
            if a["labels"].get("alertname") == name and a["state"] == "firing" and (
                    labels.items() <= a["labels"].items()):
                return a
        return None


def _ts(rfc3339: str) -> float:
    """Seconds since the epoch of an RFC 3339 time from the API; 0 for Go's zero time or none."""
    if not rfc3339 or rfc3339.startswith("0001-"):
        return 0.0
    return datetime.fromisoformat(rfc3339).timestamp()


def wait_until(cond: Callable[[], T | None], what: str, diagnose: Callable[[], object] = lambda: "",
               timeout: float = DEADLINE) -> T:
    """:func:`tests.procs.until` at this file's pace (Prometheus evaluates every second or so)."""
    got: T = until(cond, what, timeout, diagnose, interval=0.25)
    return got


def shortened_rules(dest: Path) -> list[dict[str, Any]]:
    """alerts.yml with every ``for:`` cut to 1s, written to ``dest``; returns the rules.

    ``for: 1s`` still takes each alert through pending before firing. The range windows ([5m], [10m],
    [15m]) are kept as shipped: a window longer than the test only means a condition, once caused,
    holds for the rest of the test, and rate()/increase() need just two samples inside it, which 1s
    scrapes give at once (the counters exist at 0 before their first increment)."""
    doc = yaml.safe_load((DEPLOY_PROMETHEUS / "alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    for r in rules:
        if "for" in r:
            r["for"] = "1s"
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return rules


def scrape_config(dest: Path, coordinators: Sequence[str], routers: Sequence[str],
                  pickers: Sequence[str] = ()) -> tuple[str, str]:
    """The shipped prometheus.yml with 1s intervals and the test's targets; returns the job names
    (coordinators, routers). Its rule_files stay as shipped: relative, so they resolve next to ``dest``.
    ``pickers`` (kvcoord epp, which the compose demo does not run) get a job of their own, as the epp
    overlay's ServiceMonitor gives them."""
    cfg = yaml.safe_load((DEPLOY_PROMETHEUS / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    coord_job, route_job = cfg["scrape_configs"]
    coord_job["static_configs"] = [{"targets": list(coordinators)}]
    route_job["static_configs"] = [{"targets": list(routers)}]
    if pickers:
        picker_job = {"job_name": "kvcoord-epp", "static_configs": [{"targets": list(pickers)}]}
        cfg["scrape_configs"].append(picker_job)
    assert cfg["rule_files"] == ["alerts.yml"], cfg["rule_files"]
    dest.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(coord_job["job_name"]), str(route_job["job_name"])


# --- Grafana panel queries -------------------------------------------------------------------------
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "1s",
    "${__interval}": "1s",
    "$__range": "1h",
    "${__range}": "1h",
    "$instance": ".*",
    "${instance}": ".*",
}
"""Grafana's built-ins as a dashboard over 1s scrapes would resolve them (``$instance`` as "All")."""


def panel_queries() -> list[tuple[str, str]]:
    """(panel title and refId, PromQL with dashboard variables resolved) for every panel target,
    rows' nested panels included."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    out = []
    for p in walk(json.loads(DASHBOARD.read_text())["panels"]):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
                expr = expr.replace(var, GRAFANA_VARIABLES[var])
            assert "$" not in expr, f"panel {p['title']!r}: unresolved variable in {expr}"
            out.append((f"{p['title']!r} {t.get('refId', '')}", expr))
    return out


def panel_problems(prom: Prometheus) -> list[str]:
    """Panel queries that return no series, or only NaN/Inf (what Grafana shows as No data or NaN)."""
    problems = []
    for where, expr in panel_queries():
        result = prom.query(expr)
        values = [float(r["value"][1]) for r in result]
        if not result:
            problems.append(f"{where}: no data for {expr}")
        elif not any(math.isfinite(v) for v in values):
            problems.append(f"{where}: only {values} for {expr}")
    return problems


async def gateway_request(address: str) -> bool:
    """One chat through kvcoord epp as Envoy sends it (headers, buffered body), then the response headers
    naming the endpoint that served it; True when the picker picked."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    body = json.dumps({"model": SIM_MODEL, "messages": Chats.messages(0)}).encode()
    async with grpc.aio.insecure_channel(address) as ch:
        call = epg.ExternalProcessorStub(ch).Process()
        await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders()))
        await asyncio.wait_for(call.read(), DEADLINE)
        await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
        picked = await asyncio.wait_for(call.read(), DEADLINE)
        if picked.WhichOneof("response") != "request_body":
            await call.done_writing()
            return False
        mutation = picked.request_body.response.header_mutation
        endpoint = next(h.header.raw_value.decode() for h in mutation.set_headers
                        if h.header.key == "x-gateway-destination-endpoint")
        served = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
        served.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"].string_value = endpoint
        await call.write(served)
        await asyncio.wait_for(call.read(), DEADLINE)
        await call.done_writing()
    return True


class Gateway:
    """A gateway's requests through kvcoord epp, a few a second (a histogram's rate needs more than one)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.running = True
        self.picked = 0

    async def run(self) -> None:
        while self.running:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                self.picked += await gateway_request(self.address)
            await asyncio.sleep(0.2)


# --- agents and routers, on a loop of their own ------------------------------------------------------
class Background:
    """An asyncio loop on a thread: agents heartbeat and routers look up while the test polls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="alerts-agents", daemon=True)
        self.tasks: list[concurrent.futures.Future[Any]] = []

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.tasks.append(fut)
        return fut

    def __exit__(self, *exc: object) -> None:
        for fut in self.tasks:
            fut.cancel()

        async def drain() -> None:  # let the cancelled tasks run their cleanup (close channels)
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


class Agent:
    """A hand-driven agent stream: Hello, an empty snapshot, the given batches; then it heart-beats
    until closed. ``replies`` collects everything the coordinator sends."""

    def __init__(self, address: str, node: str, model: str,
                 unknown_media: dict[str, int] | None = None) -> None:
        self.address, self.node, self.model = address, node, model
        self.unknown_media = unknown_media
        """Reported in every heartbeat: events skipped since the last for a medium no tier maps."""
        self.epoch = time.time_ns()
        self.replies: list[pb.CoordinatorMessage] = []
        self.error: BaseException | None = None

    async def run(self, batches: Sequence[pb.EventBatch], *, leave: bool = False) -> None:
        """``leave``: end the stream once the batches are answered and stay silent (the lease runs out)."""
        async with grpc.aio.insecure_channel(self.address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Ingest()
            try:
                await call.write(pb.AgentMessage(hello=pb.Hello(
                    node_id=self.node, model=self.model, dp_ranks=[0], epoch=self.epoch, next_seq=1)))
                await call.write(pb.AgentMessage(snapshot=pb.Snapshot(epoch=self.epoch, seq=0, final=True)))
                for b in batches:
                    await call.write(pb.AgentMessage(batch=b))
                reader = asyncio.create_task(self._read(call))
                last = max((b.seq for b in batches), default=0)
                while not self.answered(last):
                    if reader.done():
                        return
                    await asyncio.sleep(0.05)
                if leave:
                    return
                welcome = [r.welcome for r in self.replies if r.WhichOneof("msg") == "welcome"]
                lease = welcome[0].lease_seconds if welcome else 10.0
                while not reader.done():
                    beat = pb.AgentHeartbeat(unknown_media=self.unknown_media)
                    await call.write(pb.AgentMessage(heartbeat=beat))
                    await asyncio.sleep(min(1.0, lease / 4))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                self.error = exc  # the stream ended; reported when a wait times out
            finally:
                call.cancel()

    async def _read(self, call: Any) -> None:
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                self.replies.append(msg)
        except grpc.aio.AioRpcError as exc:
            self.error = exc

    def answered(self, seq: int) -> bool:
        """The coordinator acked ``seq`` or asked for a snapshot instead."""
        return any(r.WhichOneof("msg") == "snapshot_request"
                   or (r.WhichOneof("msg") == "ack" and r.ack.seq >= seq) for r in self.replies)

    def __repr__(self) -> str:
        kinds = [r.WhichOneof("msg") for r in self.replies]
        return f"<agent {self.node}: replies {kinds} error {self.error!r}>"


class Router:
    """Looks the fixture prompt up by tokens and by hashes, over and over, as a router would."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.running = True
        self.answered = 0

    async def run(self, tokens: Sequence[int], hashes: Sequence[int]) -> None:
        queries = (pb.LookupRequest(model=MODEL, tokens=pb.TokenQuery(token_ids=pack_tokens(tokens))),
                   pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=pack_u64(hashes))))
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            while self.running:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Lookup(queries[self.answered % 2], timeout=30)
                    self.answered += 1
                await asyncio.sleep(0.1)  # pacing the traffic, not waiting for anything


def chain(tokens: Sequence[int], hashes: Sequence[int]) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None,
                       token_ids=tuple(tokens[: len(hashes) * PROFILE.block_size]),
                       block_size=PROFILE.block_size, extra_keys=(None,) * len(hashes))


def batch(seq: int, events: Sequence[BlockStored], *, age: float = 0.0, dp_rank: int = 0) -> pb.EventBatch:
    """A numbered batch whose engine timestamp is ``age`` seconds old."""
    wire = events_to_proto(list(events), sample=True)  # sampled: the coordinator verifies each chain
    return pb.EventBatch(seq=seq, ts=time.time() - age, dp_rank=dp_rank, events=wire, sampled=bool(events))


def serve_cmd(grpc_port: int, metrics_port: int, *extra: str) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{grpc_port}",
                       "--metrics-listen", f"127.0.0.1:{metrics_port}", *extra)


# --- a router in front of two sim-engines whose agents announce each other's URL -------------------
SIM_MODEL = "sim-model"
SIM_BLOCK = 8
SIM_HASHING = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(SIM_BLOCK))
SIM_SPEC = f"{SIM_MODEL},algo=sha256_cbor,block_size={SIM_BLOCK},seed=0"
"""The main coordinator's profile for the sim-engines (a tokenizer= is added: engine-1's /tokenize)."""
API_KEY = "sk-alerts-test"
"""The router's one API key (--api-keys), without limits."""


@dataclass
class SimNode:
    node: str
    http: int
    pub: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


def sim_engine_cmd(n: SimNode) -> list[str]:
    """A sim-engine serving HTTP only (no synthetic workload) and publishing its KV events."""
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{n.pub}",
                       "--replay-bind", f"tcp://127.0.0.1:{n.replay}", "--model", SIM_MODEL, *SIM_HASHING,
                       "--http-listen", f"127.0.0.1:{n.http}", "--rate", "0", "--requests", "0",
                       "--num-blocks", "4096")


def agent_cmd(coordinator: str, n: SimNode, serving: SimNode) -> list[str]:
    """An agent relaying ``n``'s KV events and announcing ``serving``'s URL: the other engine's, in the
    test (two sidecars given each other's --serving-url)."""
    return kvcoord_cmd("agent", "--coordinator", coordinator, "--node-id", n.node, "--model", SIM_MODEL,
                       "--zmq-endpoint", f"tcp://127.0.0.1:{n.pub}",
                       "--replay-endpoint", f"tcp://127.0.0.1:{n.replay}", "--serving-url", serving.url)


class Chats:
    """Chat requests through ``kvcoord route``, each with a system prompt of its own (~170 tokens)."""

    def __init__(self, route: str, coordinator: str) -> None:
        self.route, self.coordinator = route, coordinator
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.running = True
        self.statuses: dict[int, int] = {}

    @staticmethod
    def messages(i: int) -> list[dict[str, str]]:
        system = f"prompt-{i} " + " ".join(f"rule-{i}-{k}" for k in range(160))
        return [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]

    async def _post(self, s: aiohttp.ClientSession, i: int, **headers: str) -> None:
        body = {"model": SIM_MODEL, "messages": self.messages(i), "max_tokens": 2}
        async with s.post(f"{self.route}/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1

    async def pairs(self, limit: int = 50) -> None:
        """Each prompt twice: the second once the coordinator's index holds the first one's blocks, so the
        router places it on the node whose events reported them (and, with swapped URLs, reaches the
        other, cold engine)."""
        async with aiohttp.ClientSession(headers=self.headers) as s, \
                grpc.aio.insecure_channel(self.coordinator) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for i in range(limit):
                if not self.running:
                    return
                await self._post(s, i)
                query = pb.LookupRequest(model=SIM_MODEL, prompt=pb.PromptQuery(
                    messages_json=json.dumps(self.messages(i))))
                while self.running:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        if any(n.matched_blocks > 0 for n in (await stub.Lookup(query, timeout=30)).nodes):
                            break
                    await asyncio.sleep(0.05)
                await self._post(s, i)

    async def session_and_stranger(self, i: int) -> None:
        """Two requests of one session (new, then hit or moved), and one without the API key (401)."""
        async with aiohttp.ClientSession(headers=self.headers) as s:
            for _ in range(2):
                await self._post(s, i, **{"x-session-id": f"session-{i}"})
        async with aiohttp.ClientSession() as s:
            await self._post(s, i)

    async def steady(self, first: int) -> None:
        """One new prompt after another until stopped."""
        async with aiohttp.ClientSession(headers=self.headers) as s:
            i = first
            while self.running:
                with contextlib.suppress(aiohttp.ClientError):
                    await self._post(s, i)
                i += 1
                await asyncio.sleep(0.1)  # pacing the traffic, not waiting for anything


def route_down_active(prom: Prometheus) -> bool:
    """KvcoordRouteDown pending or firing."""
    return any(a["labels"].get("alertname") == "KvcoordRouteDown" for a in prom.alerts())


def route_backends(address: str) -> dict[str, str]:
    """The router's node -> URL map (its /health), empty while it does not answer."""
    try:
        status, health = http_json("GET", f"http://{address}/health", timeout=5)
    except OSError:
        return {}
    return dict(health.get("backends", {})) if status == 200 else {}


def route_quality(address: str) -> str:
    """The router's placement and decision-quality counters, for a failure message."""
    try:
        text = get_text(f"http://{address}/metrics", timeout=5)
    except (OSError, AssertionError) as exc:
        return f"router /metrics: {exc}"
    keep = ("_tokens_total", "hit_outcomes_total", "placements_total", "degraded_total", "retries_total")
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("kvcoord_route_") and any(k in line for k in keep))


# --- the end-to-end test ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_alert_fires_and_every_panel_shows_data(tmp_path: Path) -> None:
    """Two coordinators (the Redis-backed one of compose and k8s, and an in-memory one with a 1s lease),
    a router in front of two sim-engines on the first, one Prometheus running the shipped rules; every
    rule is made to fire by its real cause."""
    if PROMETHEUS_BIN is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("redis-server is not installed")
    fixture = json.loads((FIXTURES / "vllm-engine" / "kv_event_base.json").read_text())
    assert fixture["model_name"] == MODEL
    tokens: list[int] = fixture["token_ids"]
    good_hashes: list[int] = fixture["block_hashes"]
    assert block_hashes64(PROFILE, tokens) == good_hashes
    bad_hashes = block_hashes64(UNSEEDED, tokens)
    assert bad_hashes[0] != good_hashes[0]

    rules_dir = tmp_path / "prometheus"
    rules_dir.mkdir()
    rules = shortened_rules(rules_dir / "alerts.yml")
    ports: set[int] = set()
    while len(ports) < 15:  # free_port() may hand out a port twice in a row
        ports.add(free_port())
    main_g, main_m, lease_g, lease_m, prom_port, route_port, dead_port, epp_port, epp_m, *sim = sorted(ports)
    main_inst, lease_inst = f"127.0.0.1:{main_m}", f"127.0.0.1:{lease_m}"
    route_inst = f"127.0.0.1:{route_port}"
    job, route_job = scrape_config(rules_dir / "prometheus.yml", [main_inst, lease_inst], [route_inst],
                                   [f"127.0.0.1:{epp_m}"])
    sims = [SimNode(f"node-{i}", *sim[3 * i:3 * i + 3]) for i in range(2)]

    # alert -> (phase that causes it, labels it must carry)
    expect: dict[str, tuple[str, dict[str, str]]] = {
        "KvcoordHashMismatch": ("traffic", {"model": MODEL}),
        "KvcoordNodeHashMismatch": ("traffic", {}),
        "KvcoordNodeDegraded": ("traffic", {}),
        "KvcoordIngestLagHigh": ("traffic", {}),
        "KvcoordLeasesExpiring": ("traffic", {"instance": lease_inst}),
        "KvcoordEventsRejected": ("traffic", {"reason": "unknown_dp_rank"}),
        "KvcoordIndexBackendDown": ("redis_down", {"instance": main_inst, "backend": "redis"}),
        "KvcoordReservationFeedFailing": ("redis_down", {"instance": main_inst}),
        "KvcoordCoordinatorDown": ("coordinator_down", {"instance": main_inst, "job": job}),
        "KvcoordRouteAchievedBelowPredicted": ("traffic", {"instance": route_inst, "job": route_job}),
        "KvcoordRouteDegraded": ("coordinator_down", {"instance": route_inst, "job": route_job}),
        "KvcoordRouteDown": ("route_down", {"instance": route_inst, "job": route_job}),
        "KvcoordUnknownMedium": ("traffic", {"instance": main_inst, "medium": "NVME"}),
    }
    # every rule in alerts.yml needs a cause here, or a firing case in tests/repo/alerts_promtool.yml
    assert set(expect) | promtool_tested() == {r["alert"] for r in rules}
    names = ("main", "lease", "prometheus", "route", "epp", *(n.node for n in sims),
             *(f"agent-{n.node}" for n in sims))
    logs = {name: tmp_path / f"{name}.log" for name in names}
    fired: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        main = stack.enter_context(running(serve_cmd(
            main_g, main_m, "--index", redis.url, "--lease-seconds", "60",
            "--model", f"{MODEL},algo={PROFILE.algo},block_size={PROFILE.block_size},seed=42",
            "--model", f"{SIM_SPEC},tokenizer={sims[0].url}",
        ), log=logs["main"]))  # fmt: skip
        stack.enter_context(running(serve_cmd(lease_g, lease_m, "--lease-seconds", "1"), log=logs["lease"]))
        try:
            for port in (main_g, main_m, lease_g, lease_m):
                wait_for_port(port, timeout=60)
            main_addr, lease_addr = f"127.0.0.1:{main_g}", f"127.0.0.1:{lease_g}"
            stack.enter_context(running([
                PROMETHEUS_BIN, f"--config.file={rules_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ], log=logs["prometheus"]))  # fmt: skip
            prom = Prometheus(prom_port)
            wait_until(prom.ready, "Prometheus to be ready", timeout=120)
            bg = stack.enter_context(Background())

            def wait_firing(phase: str, since: float) -> None:
                names = [n for n, (p, _) in expect.items() if p == phase]

                def all_firing() -> bool:
                    for n in names:
                        if n not in fired and (a := prom.firing(n, expect[n][1])) is not None:
                            fired[n] = a
                    return all(n in fired for n in names)

                wait_until(all_firing, f"{names} to fire", lambda: (
                    f"not firing: {sorted(set(names) - set(fired))}\nalerts: "
                    f"{json.dumps(prom.alerts(), indent=1)}\n{agents}\n{route_quality(route_inst)}"))
                for n in names:  # fired because of this phase's cause, not before it
                    assert _ts(fired[n]["activeAt"]) >= since - SLOP, (n, fired[n], since)

            agents: list[Agent] = []
            # 1. Baseline: both targets scraped; the counters the rules read are there at 0, and no
            #    alert whose cause has not happened yet is active.
            wait_until(lambda: {r["metric"]["instance"] for r in prom.query(f'up{{job="{job}"}} == 1')}
                       == {main_inst, lease_inst}, "both coordinators scraped")  # fmt: skip
            scraped = time.time()
            zero = prom.query(f'kvcoord_hash_mismatches_total{{instance="{main_inst}"}}')
            got = sorted((r["metric"]["model"], r["value"][1]) for r in zero)
            assert got == [(MODEL, "0"), (SIM_MODEL, "0")], zero
            for name, labels in (("kvcoord_nodes_by_trust", ("trust",)),
                                 ("kvcoord_events_rejected_total", ("type", "reason")),
                                 ("kvcoord_batches_total", ("outcome",)),
                                 ("kvcoord_snapshots_requested_total", ("reason",)),
                                 ("kvcoord_hash_verifications_total", ("result",))):
                result = prom.query(f'{name}{{instance="{main_inst}"}}')
                assert result and {r["value"][1] for r in result} == {"0"}, (name, result)
                assert len({tuple(r["metric"][k] for k in labels) for r in result}) == len(result)
            wait_until(lambda: prom.last_evaluation() >= scraped, "a rule evaluation over the first scrapes")
            early = {a["labels"]["alertname"] for a in prom.alerts()} & {
                "KvcoordRouteDegraded", *(n for n, (p, _) in expect.items() if p == "traffic")}
            assert not early, f"active before their cause: {early}"

            # The router's fleet: two sim-engines, their agents (each announcing the other's URL), the
            # router; scraped, its counters at 0.
            for n in sims:
                stack.enter_context(running(sim_engine_cmd(n), log=logs[n.node]))
            for n, other in zip(sims, sims[::-1], strict=True):
                wait_for_port(n.http, timeout=60)
                stack.enter_context(running(agent_cmd(main_addr, n, other), log=logs[f"agent-{n.node}"]))
            # A static backend nobody listens on: picked once, it costs a retry and a backend failure.
            keys = tmp_path / "keys.json"
            keys.write_text(json.dumps({"keys": [{"name": "alerts", "key": API_KEY}]}))
            route = stack.enter_context(running(kvcoord_cmd(
                "route", "--coordinator", main_addr, "--listen", route_inst, "--model", SIM_MODEL,
                "--deadline-ms", "2000", "--refresh-interval", "0.5", "--seed", "7",
                "--backend", f"node-dead=http://127.0.0.1:{dead_port}", "--api-keys", str(keys),
            ), log=logs["route"]))  # fmt: skip
            wait_for_port(route_port, timeout=60)
            wait_until(lambda: prom.query(f'up{{job="{route_job}"}} == 1'), "the router scraped")
            route_up = time.time()  # KvcoordRouteDown was active before the router started; it resolves
            wait_until(lambda: prom.last_evaluation() >= route_up, "an evaluation with the router up")
            assert not route_down_active(prom), prom.alerts()
            wait_until(lambda: {n.node for n in sims} <= set(route_backends(route_inst)),
                       "the router to learn both engines' URLs from the coordinator",
                       lambda: route_backends(route_inst))
            for name in ("kvcoord_route_predicted_tokens_total", "kvcoord_route_achieved_tokens_total",
                         "kvcoord_route_degraded_total", "kvcoord_route_degraded_mode"):
                result = prom.query(f'{name}{{instance="{route_inst}"}}')
                assert result and {r["value"][1] for r in result} == {"0"}, (name, result)

            # 2. Traffic: a healthy engine and routers looking its prompt up; an engine started without
            #    PYTHONHASHSEED; one whose events arrive two minutes late; one that sends a batch for a dp
            #    rank it never announced; on the other coordinator, a node that leaves without a word; chats
            #    through the router, whose nodes' agents announce each other's engine.
            since = time.time()
            good = Agent(main_addr, "engine-good", MODEL, unknown_media={"NVME": 2})  # a medium no tier maps
            unseeded = Agent(main_addr, "engine-unseeded", MODEL)
            late = Agent(main_addr, "engine-late", MODEL)
            rejecting = Agent(main_addr, "engine-rejecting", MODEL)
            leaving = Agent(lease_addr, "engine-leaving", LEASE_MODEL)
            agents += [good, unseeded, late, rejecting, leaving]
            bg.submit(good.run([batch(1, [chain(tokens, good_hashes)])]))
            bg.submit(unseeded.run([batch(1, [chain(tokens, bad_hashes)])]))
            # a hundred late batches: the alert is on the 99th percentile of every batch's lag, and the
            # other agents send a batch per engine step, promptly
            bg.submit(late.run([batch(seq, [chain(tokens[:64], good_hashes[:4])], age=120.0)
                                for seq in range(1, 101)]))
            bg.submit(rejecting.run([batch(1, [chain(tokens[:16], good_hashes[:1])], dp_rank=7)]))
            bg.submit(leaving.run([batch(1, [chain(tokens[:32], good_hashes[:2])])], leave=True))
            router = Router(main_addr)
            bg.submit(router.run(tokens, good_hashes))
            chats = Chats(f"http://{route_inst}", main_addr)
            chatting = bg.submit(chats.pairs())
            wait_firing("traffic", since)
            # The Hello alone made the lease coordinator export its (unconfigured) model's counter, at 0.
            hello_made = prom.query(f'kvcoord_hash_mismatches_total{{instance="{lease_inst}"}}')
            assert [(r["metric"]["model"], r["value"][1]) for r in hello_made] == [(LEASE_MODEL, "0")]
            assert any(r.WhichOneof("msg") == "notice" and r.notice.state == "hash_mismatch"
                       for r in unseeded.replies), unseeded
            # KvcoordNodeDegraded: that node, and only it, is in trust state degraded
            trust = prom.query(f'kvcoord_nodes_by_trust{{instance="{main_inst}",trust="degraded"}}')
            assert [r["value"][1] for r in trust] == ["1"], trust

            # 3. Every dashboard panel has data from this Prometheus; the picker's row from a kvcoord epp
            #    on the same coordinator, sent one request as a gateway sends it.
            stack.enter_context(running(kvcoord_cmd(
                "epp", "--coordinator", main_addr, "--listen", f"127.0.0.1:{epp_port}",
                "--metrics-listen", f"127.0.0.1:{epp_m}", "--fallbacks", "0",
            ), log=logs["epp"]))  # fmt: skip
            wait_for_port(epp_port, timeout=60)
            gateway = Gateway(f"127.0.0.1:{epp_port}")
            bg.submit(gateway.run())
            wait_until(lambda: gateway.picked >= 1, "a pick served")
            bg.submit(chats.session_and_stranger(900)).result(timeout=DEADLINE)  # sessions and keys panels
            wait_until(lambda: router.answered >= 10, "lookups answered", lambda: router.answered)
            wait_until(lambda: not panel_problems(prom), "every dashboard panel to return data",
                       lambda: "\n".join(panel_problems(prom)))
            router.running = chats.running = gateway.running = False
            chatting.result(timeout=DEADLINE)
            # the dead backend's requests were retried; the one without the key was refused
            assert set(chats.statuses) == {200, 401} and chats.statuses[401] == 1, chats.statuses

            # 4. The index backend dies.
            since = time.time()
            redis.kill()
            wait_firing("redis_down", since)

            # 5. The coordinator stops.
            since = time.time()
            stop(main)
            degraded = Chats(f"http://{route_inst}", main_addr)
            bg.submit(degraded.steady(first=1000))
            wait_firing("coordinator_down", since)
            wait_until(lambda: degraded.statuses.get(200), "a degraded request answered",  # least-loaded
                       lambda: degraded.statuses)
            degraded.running = False

            # 6. The router dies (SIGKILL: no goodbye). Up to here it was scraped, so its down alert was
            #    never active since it started.
            assert not route_down_active(prom), prom.alerts()
            since = time.time()
            os.killpg(route.pid, signal.SIGKILL)
            stop(route)
            wait_firing("route_down", since)

            for r in prom.rules():  # no rule failed to evaluate
                assert r["health"] == "ok", r
            for name, a in fired.items():  # the annotations render (labels they name exist)
                for text in a["annotations"].values():
                    assert "<no value>" not in text and "error expanding" not in text, (name, text)
            assert set(fired) == set(expect)
        except BaseException:
            for name, path in logs.items():
                if path.exists():
                    print(f"--- {name}\n{path.read_text()[-4000:]}")
            raise


def test_panel_queries_resolve_every_variable() -> None:
    """Every panel target is plain PromQL once Grafana's variables are resolved (no unknown ``$``)."""
    queries = panel_queries()
    assert len(queries) >= 20
    for where, expr in queries:
        assert re.search(r"\bkvcoord_", expr), (where, expr)
