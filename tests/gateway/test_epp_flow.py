"""``kvcoord epp``'s flow control, objective and SLO headers and endpoint scores, as llm-d's picker has them,
played over real gRPC against a real picker, coordinator, sim-engines and agents
(``tests/gateway/test_epp.py``'s
fleet). The overload tests count which request is dispatched after each release, never durations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2

from kvcoord.gateway.flow import RequestMeta, parse_duration, request_meta
from tests.gateway.test_epp import (
    DEADLINE,
    MODEL,
    PROMPT_A,
    PROMPT_B,
    Envoy,
    Fleet,
    assert_immediate,
    assert_pick,
    channel,
    chat,
    epp,
    epp_metrics,
    fleet,
    health_of,
    request_body,
    request_headers,
    set_headers,
)
from tests.http_util import http_request
from tests.procs import free_port

__all__ = ["fleet"]  # the module-scoped fixture, shared with tests/gateway/test_epp.py's helpers


async def _eventually(cond: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _queued(port: int) -> Callable[[], Awaitable[float]]:
    async def get() -> float:
        return (await asyncio.to_thread(epp_metrics, port)).get("kvcoord_epp_flow_queued", -1.0)
    return get


async def _hold(ch: grpc.aio.Channel, endpoint: str, headers: dict[str, str] | None = None) -> Envoy:
    """A request picked to ``endpoint`` whose stream stays open (it fills that endpoint)."""
    envoy = Envoy(ch)
    await envoy.send(request_headers(subset=[endpoint], extra=headers))
    [resp] = await envoy.send(request_body(chat(PROMPT_A)))
    assert_pick(resp, "request_body", [endpoint])
    return envoy


async def _queue(ch: grpc.aio.Channel, endpoint: str, headers: dict[str, str], port: int,
                 tasks: dict[asyncio.Task[Any], str], tag: str) -> None:
    """Start a request that must wait, and wait until the picker queued it (so arrival order is known)."""
    before = await _queued(port)()
    envoy = Envoy(ch)

    async def run() -> Envoy:
        await envoy.send(request_headers(subset=[endpoint], extra=headers))
        [resp] = await envoy.send(request_body(chat(PROMPT_A)))
        assert_pick(resp, "request_body", [endpoint])
        return envoy

    tasks[asyncio.create_task(run())] = tag

    async def one_more() -> bool:
        return await _queued(port)() == before + 1
    await _eventually(one_more, f"{tag} to be queued")


async def _drain(holder: Envoy, tasks: dict[asyncio.Task[Any], str]) -> list[str]:
    """Release the endpoint one request at a time; the tags in the order their requests were dispatched."""
    order = []
    current = holder
    while tasks:
        await current.close()
        done, _ = await asyncio.wait(tasks, timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, f"one release dispatches one request, got {len(done)}"
        task = done.pop()
        order.append(tasks.pop(task))
        current = task.result()
    await current.close()
    return order


FLOW = ("--max-in-flight", "1", "--max-queued", "8", "--refresh-interval", "600",
        "--objective", "critical=100", "--objective", "batch=-10")


async def test_higher_band_is_served_first(fleet: Fleet) -> None:
    """One endpoint, full: two batch (priority -10) requests queue, then two critical (100) ones and one
    with an unknown objective (0) under the old header name; each release serves the highest band."""
    a = fleet.endpoints["node-a"]
    mport = free_port()
    with epp(fleet, *FLOW, "--metrics-listen", f"127.0.0.1:{mport}", name="epp-bands") as address:
        async with channel(address) as ch:
            holder = await _hold(ch, a)
            tasks: dict[asyncio.Task[Any], str] = {}
            for tag, hdrs in (("batch1", {"x-llm-d-inference-objective": "batch"}),
                              ("batch2", {"x-llm-d-inference-objective": "batch"}),
                              ("default", {"x-gateway-inference-objective": "no-such-objective"}),
                              ("critical1", {"x-llm-d-inference-objective": "critical"}),
                              ("critical2", {"x-gateway-inference-objective": "critical"})):
                await _queue(ch, a, hdrs, mport, tasks, tag)
            order = await _drain(holder, tasks)
    assert order == ["critical1", "critical2", "default", "batch1", "batch2"]


async def test_two_fairness_ids_share_the_capacity(fleet: Fleet) -> None:
    """Four requests of tenant-a queue before four of tenant-b (same band): they are served in turn."""
    a = fleet.endpoints["node-a"]
    mport = free_port()
    with epp(fleet, *FLOW, "--metrics-listen", f"127.0.0.1:{mport}", name="epp-fair") as address:
        async with channel(address) as ch:
            holder = await _hold(ch, a)
            tasks: dict[asyncio.Task[Any], str] = {}
            for tenant, header in (("a", "x-llm-d-inference-fairness-id"),
                                   ("b", "x-gateway-inference-fairness-id")):
                for i in range(4):
                    await _queue(ch, a, {header: f"tenant-{tenant}"}, mport, tasks, f"{tenant}{i}")
            order = await _drain(holder, tasks)
    tenants = [tag[0] for tag in order]
    assert tenants[:4].count("a") == 2 and tenants[:4].count("b") == 2, order
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]  # each tenant in its own arrival order


async def test_queue_ttl_full_queue_and_bad_headers(fleet: Fleet) -> None:
    """A request whose x-llm-d-inference-ttl runs out is 429 rejected-ttl-expired; past --max-queued, 429
    rejected-saturated at once; bad header values are counted and ignored, never fatal."""
    a = fleet.endpoints["node-a"]
    mport = free_port()
    flags = ("--max-in-flight", "1", "--max-queued", "1", "--refresh-interval", "600",
             "--metrics-listen", f"127.0.0.1:{mport}")
    with epp(fleet, *flags, name="epp-ttl") as address:
        async with channel(address) as ch:
            holder = await _hold(ch, a, {"x-llm-d-inference-ttl": "soon", "x-llm-d-slo-ttft-ms": "-5",
                                         "x-llm-d-inference-objective": "\u00e9t\u00e9"})
            short = Envoy(ch)
            await short.send(request_headers(subset=[a], extra={"x-llm-d-inference-ttl": "50ms"}))
            [resp] = await short.send(request_body(chat(PROMPT_A)))
            assert_immediate(resp, 429, "kvcoord_epp_ttl_expired", "in the queue")
            tasks: dict[asyncio.Task[Any], str] = {}
            await _queue(ch, a, {}, mport, tasks, "waiting")
            full = Envoy(ch)
            await full.send(request_headers(subset=[a]))
            [resp] = await full.send(request_body(chat(PROMPT_A)))
            assert_immediate(resp, 429, "kvcoord_epp_shed", "--max-queued")
            assert await _drain(holder, tasks) == ["waiting"]
            got = await asyncio.to_thread(epp_metrics, mport)
    assert got['kvcoord_epp_bad_headers_total{header="x-llm-d-inference-ttl"}'] == 1
    assert got['kvcoord_epp_bad_headers_total{header="x-llm-d-slo-ttft-ms"}'] == 1
    assert got['kvcoord_epp_requests_total{outcome="ttl_expired"}'] == 1
    assert got['kvcoord_epp_requests_total{outcome="shed"}'] == 1


def _scores(resp: Any, phase: str) -> dict[str, float]:
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == set_headers(
        getattr(resp, phase).response)["x-gateway-destination-endpoint"]
    if "x-gateway-destination-endpoint-scores" not in lb.fields:
        return {}
    fields = lb.fields["x-gateway-destination-endpoint-scores"].struct_value.fields
    return {k: v.number_value for k, v in fields.items()}


async def test_endpoint_scores_metadata(fleet: Fleet) -> None:
    """--emit-endpoint-scores: envoy.lb carries every scored endpoint's score, the pick's the highest (1);
    without the flag the key is absent (llm-d's TestEndpointScoresMetadata contract)."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    with epp(fleet, "--emit-endpoint-scores", name="epp-scores") as address:
        async with channel(address) as ch:
            for prompt, best, other in ((PROMPT_A, a, b), (PROMPT_B, b, a)):
                envoy = Envoy(ch)
                await envoy.send(request_headers())
                [resp] = await envoy.send(request_body(chat(prompt)))
                scores = _scores(resp, "request_body")
                assert set(scores) == {a, b}
                assert scores[best] == 1.0 and 0 <= scores[other] < 1.0, scores
                await envoy.close()
            get = Envoy(ch)  # a request without a body: least-loaded, scored too
            [resp] = await get.send(request_headers("/v1/models", end_of_stream=True))
            assert set(_scores(resp, "request_headers")) == {a, b}
            await get.close()
    with epp(fleet, name="epp-noscores") as address:
        async with channel(address) as ch:
            envoy = Envoy(ch)
            await envoy.send(request_headers())
            [resp] = await envoy.send(request_body(chat(PROMPT_A)))
            assert _scores(resp, "request_body") == {}
            await envoy.close()


async def test_ttft_slo_leaves_out_slow_endpoints(fleet: Fleet) -> None:
    """At 10 ms of prefill per token, node-b (no cache) is predicted far above a 300 ms TTFT SLO and node-a
    (the prompt cached) below it: with the SLO node-b is no fallback; with an SLO nobody meets, both stay
    (best effort), and the reason says so."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    flags = ("--fallbacks", "1", "--prefill-us-per-token", "10000")
    with epp(fleet, *flags, name="epp-slo") as address:
        async with channel(address) as ch:
            for headers, want, words in (({}, [a, b], ""),
                                         ({"x-llm-d-slo-ttft-ms": "300"}, [a], "TTFT SLO 300 ms left out 1"),
                                         ({"x-slo-ttft-ms": "0.001"}, [a, b], "no endpoint meets")):
                envoy = Envoy(ch)
                await envoy.send(request_headers(extra=headers))
                [resp] = await envoy.send(request_body(chat(PROMPT_A)))
                assert_pick(resp, "request_body", want)
                assert words in set_headers(resp.request_body.response)["x-kvcoord-pick"]
                await envoy.close()


def _ready(address: str) -> bool:
    return health_of(address, "readiness") == health_pb2.HealthCheckResponse.SERVING


async def test_leader_lock_one_ready_replica(fleet: Fleet, tmp_path: Path) -> None:
    """Two replicas on one --leader-lock: exactly one reports ready; when it stops, the other takes the
    lock and reports ready (as a standby takes a lapsed Lease)."""
    lock = str(tmp_path / "epp.leader")
    flags = ("--leader-lock", lock, "--refresh-interval", "0.2")
    with contextlib.ExitStack() as first_stack, contextlib.ExitStack() as second_stack:
        first = first_stack.enter_context(epp(fleet, *flags, name="epp-leader-1"))
        await _eventually(lambda: asyncio.to_thread(_ready, first), "the first replica to lead")
        second = second_stack.enter_context(epp(fleet, *flags, name="epp-leader-2"))
        for _ in range(3):  # a standby while the first holds the lock, answering ext_proc all the same
            await _buffered_pick(second)
            assert not await asyncio.to_thread(_ready, second)
        assert await asyncio.to_thread(_ready, first)
        first_stack.close()
        await _eventually(lambda: asyncio.to_thread(_ready, second), "the standby to take over")


async def _buffered_pick(address: str) -> None:
    """A standby still answers ext_proc (only its readiness keeps the gateway away)."""
    async with channel(address) as ch:
        envoy = Envoy(ch)
        await envoy.send(request_headers())
        [resp] = await envoy.send(request_body(chat(PROMPT_A)))
        assert resp.WhichOneof("response") == "request_body"
        await envoy.close()


def _engine(endpoint: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[bytes, str]:
    """The picked engine's real answer to the request (what the data plane would stream back)."""
    reply = http_request("POST", f"http://{endpoint}{path}", body)
    assert reply.status == 200, reply.body[:500]
    return reply.body, reply.headers.get("content-type", "")


async def respond(envoy: Envoy, raw: bytes, ctype: str) -> None:
    """The response path as Envoy sends it with ``response_body_mode: STREAMED``: the headers, then the
    engine's answer ``raw`` in three pieces cut anywhere, the last ending the stream."""
    await envoy.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="content-type",
                                                                 raw_value=ctype.encode())]))))
    cuts = [0, len(raw) // 3, len(raw) // 2 + 1, len(raw)]
    for i in range(3):
        await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(
            body=raw[cuts[i]:cuts[i + 1]], end_of_stream=i == 2)))


async def test_decision_metrics_from_the_response(fleet: Fleet) -> None:
    """With the response body sent to the picker (response_body_mode STREAMED, in pieces), epp reads the
    served engine's usage, JSON and SSE, and counts predicted against achieved cached tokens, as route does
    (kvcoord_epp_hit_outcomes, kvcoord_epp_{predicted,achieved}_tokens)."""
    mport = free_port()
    with epp(fleet, "--metrics-listen", f"127.0.0.1:{mport}", name="epp-quality") as address:
        async with channel(address) as ch:
            for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
                body = {"model": MODEL, "max_tokens": 2, **extra,
                        "messages": [{"role": "user", "content": PROMPT_A}]}
                envoy = Envoy(ch)
                await envoy.send(request_headers())
                [resp] = await envoy.send(request_body(json.dumps(body).encode()))
                picked = set_headers(resp.request_body.response)["x-gateway-destination-endpoint"]
                raw, ctype = await asyncio.to_thread(_engine, picked, body)
                await respond(envoy, raw, ctype)
                await envoy.close()
        got = await asyncio.to_thread(epp_metrics, mport)
    assert got['kvcoord_epp_hit_outcomes_total{outcome="match"}'] == 2, got
    assert got["kvcoord_epp_achieved_tokens_total"] == got["kvcoord_epp_predicted_tokens_total"] > 0


async def test_a_waiter_that_leaves_leaves_the_queue(fleet: Fleet) -> None:
    """Envoy ends the stream of a queued request (its client went away): the request leaves the queue."""
    a = fleet.endpoints["node-a"]
    mport = free_port()
    flags = (*FLOW, "--queue-ttl", "600", "--metrics-listen", f"127.0.0.1:{mport}")  # no TTL does it
    with epp(fleet, *flags, name="epp-leave") as address:
        async with channel(address) as ch:
            holder = await _hold(ch, a)
            tasks: dict[asyncio.Task[Any], str] = {}
            await _queue(ch, a, {}, mport, tasks, "leaving")
            [task] = tasks
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

            async def empty() -> bool:
                return await _queued(mport)() == 0
            await _eventually(empty, "the queue to empty")
            await holder.close()


@pytest.mark.parametrize(("text", "seconds"), [
    ("2s", 2.0), (" 150ms ", 0.15), ("1h2m3.5s", 3723.5), ("1.5m", 90.0), ("300us", 0.0003), ("0", 0.0),
    ("-1s", -1.0), ("soon", None), ("", None), ("5", None), ("1s2", None), ("999999999999999999999h", None)])
def test_go_durations(text: str, seconds: float | None) -> None:
    got = parse_duration(text)
    assert got == pytest.approx(seconds) if seconds is not None else got is None


def test_request_meta_reads_current_names_before_aliases() -> None:
    meta = request_meta({"x-gateway-inference-objective": "batch", "x-llm-d-inference-objective": "critical",
                         "x-gateway-inference-fairness-id": "t1", "x-slo-ttft-ms": "250",
                         "x-llm-d-inference-ttl": "0s"}, {"critical": 100, "batch": -1})
    assert (meta.objective, meta.priority, meta.fairness_id, meta.ttft_slo, meta.ttl, meta.bad) == (
        "critical", 100, "t1", 0.25, None, ("x-llm-d-inference-ttl",))
    assert request_meta({}, {}) == RequestMeta("", 0, "default-flow", None, None, ())
