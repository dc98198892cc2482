"""``kvcoord epp`` as a real process, with the test playing Envoy: over a real gRPC connection it sends the
ext_proc messages Envoy sends for one HTTP request (request headers, the buffered body, the trailers when
there are any; or FULL_DUPLEX_STREAMED chunks) and checks every field of every answer. Behind the picker:
a real ``kvcoord serve``, two sim-engines serving HTTP and publishing KV events, and their agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcoord.gateway.picker import EndpointTable, endpoint_of_url
from kvcoord.router.client import CoordinatorClient
from tests.http_util import flat, http_json, metrics
from tests.procs import free_port, free_port_pair, kvcoord_cmd, make_certs, running, stop, wait_for_port

MODEL = "sim-model"
BLOCK = 8
PROFILE = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BLOCK))
PROMPT_A = "You are a careful assistant that answers in short words " * 6
PROMPT_B = "Routers place each request on the node that already holds the prefix " * 6
DEADLINE = 45.0
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
ONE_FALLBACK = ("--fallbacks", "1")
"""The picks below list the other node after the pick (the default lists the pick alone)."""


def _until(cond: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Fleet:
    coordinator: str
    endpoints: dict[str, str]
    """node id -> 127.0.0.1:port of its engine's HTTP server."""
    tmp: Path
    pubs: dict[str, int]
    """node id -> its engine's ZMQ PUB port (replay on the next one)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """serve + two sim-engines (HTTP and KV events) + agents; node-a has served PROMPT_A, node-b PROMPT_B,
    and the coordinator's index shows it."""
    tmp = tmp_path_factory.mktemp("epp")
    gport = free_port()
    http = {"node-a": free_port(), "node-b": free_port()}
    pubs = {}
    with contextlib.ExitStack() as stack:
        tokenizer = f"http://127.0.0.1:{http['node-a']}"
        stack.enter_context(running(kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{free_port()}",
            "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer={tokenizer}"),
            log=tmp / "serve.log"))
        for node, port in http.items():
            pub = pubs[node] = free_port_pair()
            stack.enter_context(running(kvcoord_cmd(
                "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
                "--http-listen", f"127.0.0.1:{port}", "--rate", "0", "--requests", "0"),
                log=tmp / f"{node}-engine.log"))
            wait_for_port(port, timeout=30)
            wait_for_port(gport, timeout=30)
            stack.enter_context(running(kvcoord_cmd(
                "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", node, "--model", MODEL,
                "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{pub + 1}",
                "--serving-url", f"http://127.0.0.1:{port}"), log=tmp / f"{node}-agent.log"))
        for node, prompt in (("node-a", PROMPT_A), ("node-b", PROMPT_B)):
            base = f"http://127.0.0.1:{http[node]}/v1"
            assert http_json("POST", f"{base}/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": 1})[0] == 200
            assert http_json("POST", f"{base}/chat/completions", {
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]})[0] == 200
        with CoordinatorClient(f"127.0.0.1:{gport}") as client:
            for node, prompt in (("node-a", PROMPT_A), ("node-b", PROMPT_B)):
                for query in ({"prompt": prompt}, {"messages": [{"role": "user", "content": prompt}]}):
                    def holds(node: str = node, query: dict[str, Any] = query) -> bool:
                        res = client.lookup(MODEL, include_unmatched=True, **query)
                        return (len(res.nodes) == 2 and res.nodes[0].node_id == node
                                and res.nodes[0].matched_blocks > 0 and res.nodes[1].matched_blocks == 0)
                    _until(holds, f"the index to show {node} holding its prompt ({next(iter(query))})")
        yield Fleet(f"127.0.0.1:{gport}", {n: f"127.0.0.1:{p}" for n, p in http.items()}, tmp, pubs)


@contextlib.contextmanager
def epp(fleet: Fleet, *flags: str, coordinator: str | None = None, name: str = "epp") -> Iterator[str]:
    """``kvcoord epp`` as a process; yields its ext_proc address once it accepts connections (it loads
    the node list before it listens)."""
    port = free_port()
    cmd = kvcoord_cmd("epp", "--coordinator", coordinator or fleet.coordinator,
                      "--listen", f"127.0.0.1:{port}", *flags)
    with running(cmd, log=fleet.tmp / f"{name}.log"):
        wait_for_port(port, timeout=30)
        yield f"127.0.0.1:{port}"


# --- playing Envoy ---------------------------------------------------------------------------------
def request_headers(path: str = "/v1/chat/completions", *, end_of_stream: bool = False,
                    subset: Sequence[str] | None = None, mode: int | None = None,
                    response_mode: int | None = None, extra: dict[str, str] | None = None) -> Any:
    """Envoy's first message: the request headers (pseudo-headers too, as raw_value; ``extra`` the client's
    own), the filter metadata (a subset hint when given) and, from Envoy 1.33, the protocol configuration."""
    hdrs = {":method": "GET" if end_of_stream else "POST", ":path": path, ":authority": "gw.example",
            ":scheme": "http", "content-type": "application/json", "x-request-id": "req-1",
            "x-gateway-destination-endpoint": "6.6.6.6:666",  # a client trying to pick: overwritten
            **(extra or {})}
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in hdrs.items()]),
        end_of_stream=end_of_stream))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(list(subset))
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
    if response_mode is not None:
        msg.protocol_config.response_body_mode = response_mode
    return msg


def request_body(body: bytes, end_of_stream: bool = True) -> Any:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


def chat(prompt: str, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}).encode()


def completion(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()


class Envoy:
    """One ext_proc stream, as Envoy drives it: write a message, read the answer(s) it waits for."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = epg.ExternalProcessorStub(channel).Process()

    async def send(self, msg: Any, answers: int = 1) -> list[Any]:
        await self.call.write(msg)
        return [await asyncio.wait_for(self.call.read(), DEADLINE) for _ in range(answers)]

    async def close(self) -> None:
        """End the stream (the HTTP request is over) and wait for the picker to end it too."""
        await self.call.done_writing()
        assert await asyncio.wait_for(self.call.read(), DEADLINE) is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def channel(address: str) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(address)
    try:
        yield ch
    finally:
        await ch.close()


async def buffered(address: str, body: bytes, *, subset: Sequence[str] | None = None,
                   mode: int | None = None) -> tuple[Any, Any]:
    """Headers then the whole body (``BUFFERED``); returns the two answers."""
    async with channel(address) as ch:
        envoy = Envoy(ch)
        [first] = await envoy.send(request_headers(subset=subset, mode=mode))
        if first.WhichOneof("response") == "immediate_response":
            await envoy.close()
            return first, None
        [second] = await envoy.send(request_body(body))
        await envoy.close()
        return first, second


def set_headers(common: Any) -> dict[str, str]:
    out = {}
    for opt in common.header_mutation.set_headers:
        assert opt.append_action == OVERWRITE, opt  # a client's own destination header is replaced
        assert opt.header.value == "", "raw_value only"
        out[opt.header.key] = opt.header.raw_value.decode()
    return out


def assert_pick(resp: Any, phase: str, endpoints: Sequence[str], prefix_aware: bool = True) -> None:
    """The pick as the protocol wants it: the same comma separated list in the header and in envoy.lb."""
    assert resp.WhichOneof("response") == phase, resp
    common = getattr(resp, phase).response
    assert common.clear_route_cache is True and common.status == ep.CommonResponse.CONTINUE
    assert not common.HasField("body_mutation") and not common.header_mutation.remove_headers
    headers = set_headers(common)
    value = ",".join(endpoints)
    assert headers.pop("x-gateway-destination-endpoint") == value
    assert headers.pop("x-kvcoord-pick").startswith("prefix-aware: " if prefix_aware else "degraded; ")
    assert headers == {}
    md = resp.dynamic_metadata
    assert list(md.fields) == ["envoy.lb"]
    lb = md.fields["envoy.lb"].struct_value
    assert list(lb.fields) == ["x-gateway-destination-endpoint"]
    assert lb.fields["x-gateway-destination-endpoint"].string_value == value


def assert_passthrough(resp: Any, phase: str) -> None:
    assert resp.WhichOneof("response") == phase, resp
    assert getattr(resp, phase) == type(getattr(resp, phase))(response=ep.CommonResponse())
    assert not resp.HasField("dynamic_metadata")


DROPPED = {"kvcoord_epp_shed": "rejected-saturated", "kvcoord_epp_no_endpoint": "rejected-no-endpoints",
           "kvcoord_epp_ttl_expired": "rejected-ttl-expired",
           "kvcoord_epp_shutting_down": "rejected-shutting-down"}


def assert_immediate(resp: Any, status: int, details: str, words: str) -> dict[str, Any]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    imm = resp.immediate_response
    assert imm.status.code == status and imm.details == details
    headers = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    assert headers.pop("content-type") == "application/json"
    if status == 429:
        assert headers.pop("retry-after") == "1"
    dropped = DROPPED.get(details)  # llm-d's flow-control reasons (pkg/common/error/error.go)
    assert headers.pop("x-llm-d-request-dropped-reason", None) == dropped
    assert headers == {}
    err: dict[str, Any] = json.loads(imm.body)["error"]
    assert err["code"] == status and words in err["message"], err
    return err


def health_of(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=10).status)


def epp_metrics(port: int) -> dict[str, float]:
    return flat(metrics(f"http://127.0.0.1:{port}/metrics"), "kvcoord_epp_")


# --- the tests --------------------------------------------------------------------------------------
async def test_buffered_pick_goes_to_the_prefix_holder(fleet: Fleet) -> None:
    """Each prompt lands on the node holding its prefix, the other node as the fallback; headers and
    metadata agree; chat and completions bodies alike; health serves all four names; metrics count."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    mport = free_port()
    with epp(fleet, *ONE_FALLBACK, "--metrics-listen", f"127.0.0.1:{mport}") as address:
        for service in ("", "liveness", "readiness", "inference-extension",
                        "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert _until(lambda s=service: health_of(address, s) == health_pb2.HealthCheckResponse.SERVING,
                          f"health {service!r}")
        for body, order in ((chat(PROMPT_A), [a, b]), (completion(PROMPT_B), [b, a]),
                            (chat(PROMPT_B + " and more"), [b, a]), (completion(PROMPT_A), [a, b])):
            first, second = await buffered(address, body)
            assert_passthrough(first, "request_headers")
            assert_pick(second, "request_body", order)
        # With Envoy's protocol_config saying BUFFERED, and trailers after the body (end_of_stream false).
        async with channel(address) as ch:
            envoy = Envoy(ch)
            mode = processing_mode_pb2.ProcessingMode.BUFFERED
            [first] = await envoy.send(request_headers(mode=mode))
            assert_passthrough(first, "request_headers")
            [second] = await envoy.send(request_body(chat(PROMPT_B), end_of_stream=False))
            assert_pick(second, "request_body", [b, a])
            trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap()))
            [third] = await envoy.send(trailers)
            assert third == ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            # The response path, when the filter sends it: the served endpoint is counted.
            served = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap()))
            served.metadata_context.filter_metadata["envoy.lb"].fields[
                "x-gateway-destination-endpoint-served"].string_value = b
            [fourth] = await envoy.send(served)
            assert_passthrough(fourth, "response_headers")
            [fifth] = await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}",
                                                                                      end_of_stream=True)))
            assert_passthrough(fifth, "response_body")
            await envoy.close()
        m = epp_metrics(mport)
        assert m['kvcoord_epp_requests_total{outcome="picked"}'] == 5
        assert m[f'kvcoord_epp_served_total{{endpoint="{b}"}}'] == 1
        assert m["kvcoord_epp_open_streams"] == 0 and m["kvcoord_epp_pick_seconds_count"] == 5


async def test_full_duplex_streamed(fleet: Fleet) -> None:
    """FULL_DUPLEX_STREAMED (announced in protocol_config): nothing is answered until the body is whole,
    then the headers answer carries the pick and the body goes back unchanged as a streamed response."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    body = chat(PROMPT_A, padding="x" * 100_000)  # over one 62,000-byte streamed piece
    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    with epp(fleet, *ONE_FALLBACK) as address:
        async with channel(address) as ch:
            envoy = Envoy(ch)
            await envoy.call.write(request_headers(mode=mode, response_mode=mode))
            await envoy.call.write(request_body(body[:10], end_of_stream=False))
            # Had the picker answered the headers or the first chunk, that answer would come first here.
            headers, *streamed = await envoy.send(request_body(body[10:], end_of_stream=True), answers=3)
            assert_pick(headers, "request_headers", [a, b])
            assert_streamed(streamed, body, end_of_stream=True)
            # The response body streams back through, chunk by chunk.
            [echo] = await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: x\n\n")))
            assert echo.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
            await envoy.close()
        # With trailers: the body ends without end_of_stream, the trailers complete it.
        async with channel(address) as ch:
            envoy = Envoy(ch)
            await envoy.call.write(request_headers(mode=mode, response_mode=mode))
            await envoy.call.write(request_body(chat(PROMPT_B), end_of_stream=False))
            trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap()))
            headers, streamed_b, done = await envoy.send(trailers, answers=3)
            assert_pick(headers, "request_headers", [b, a])
            assert_streamed([streamed_b], chat(PROMPT_B), end_of_stream=False)
            assert done == ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            await envoy.close()
        # A bad body in full-duplex mode: the immediate response comes instead of the headers answer.
        async with channel(address) as ch:
            envoy = Envoy(ch)
            await envoy.call.write(request_headers(mode=mode, response_mode=mode))
            [resp] = await envoy.send(request_body(b"{oops", end_of_stream=True))
            assert_immediate(resp, 400, "kvcoord_epp_bad_request", "not JSON")
            await envoy.close()


async def test_headers_only_and_observability_modes(fleet: Fleet) -> None:
    """Body mode NONE: the pick rides on the headers answer (least-loaded: no body to look up).
    observability_mode: Envoy ignores answers, so none is sent."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    with epp(fleet, *ONE_FALLBACK) as address:
        async with channel(address) as ch:
            envoy = Envoy(ch)
            [resp] = await envoy.send(request_headers(mode=processing_mode_pb2.ProcessingMode.NONE))
            assert resp.WhichOneof("response") == "request_headers"
            picked = set_headers(resp.request_headers.response)["x-gateway-destination-endpoint"].split(",")
            assert sorted(picked) == sorted([a, b])
            assert_pick(resp, "request_headers", picked, prefix_aware=False)
            await envoy.close()
        async with channel(address) as ch:
            envoy = Envoy(ch)
            watch = request_headers()
            watch.observability_mode = True
            await envoy.call.write(watch)
            body = request_body(chat(PROMPT_A))
            body.observability_mode = True
            await envoy.call.write(body)
            await envoy.close()  # the first thing read is the end of the stream: nothing was answered


def assert_streamed(answers: Sequence[Any], body: bytes, *, end_of_stream: bool) -> None:
    """The request body sent back whole, in order, in pieces of at most 62,000 bytes."""
    got = b""
    for i, resp in enumerate(answers):
        assert resp.WhichOneof("response") == "request_body" and not resp.HasField("dynamic_metadata")
        common = resp.request_body.response
        assert not common.HasField("header_mutation") and not common.clear_route_cache
        piece = common.body_mutation.streamed_response
        assert len(piece.body) <= 62_000
        assert piece.end_of_stream == (end_of_stream and i == len(answers) - 1)
        got += piece.body
    assert got == body


async def test_subset_hint_and_static_backend(fleet: Fleet) -> None:
    """The data plane's subset hint restricts the pick (outside it: 503); a --backend address wins over
    the serving URL the agent announced; a --backend the coordinator does not know is an idle candidate."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    flags = ("--backend", "node-b=127.0.0.9:7000", "--backend", "ghost=127.0.0.3:1", "--fallbacks", "0")
    with epp(fleet, *flags) as address:
        _, second = await buffered(address, chat(PROMPT_A), subset=[a])
        assert_pick(second, "request_body", [a])
        _, second = await buffered(address, chat(PROMPT_A), subset=[b])  # node-b is 127.0.0.9:7000 now
        assert_immediate(second, 503, "kvcoord_epp_no_endpoint", "subset")
        _, second = await buffered(address, chat(PROMPT_A), subset=[])
        assert_immediate(second, 503, "kvcoord_epp_no_endpoint", "subset")
        _, second = await buffered(address, chat(PROMPT_B), subset=["127.0.0.9:7000"])
        assert_pick(second, "request_body", ["127.0.0.9:7000"])
        _, second = await buffered(address, chat(PROMPT_A), subset=["127.0.0.9"])  # a bare IP: any port
        assert_pick(second, "request_body", ["127.0.0.9:7000"])
        _, second = await buffered(address, chat(PROMPT_B))
        assert_pick(second, "request_body", ["127.0.0.9:7000"])  # --fallbacks 0: the pick alone
        _, second = await buffered(address, chat(PROMPT_B), subset=["127.0.0.3:1"])
        assert_pick(second, "request_body", ["127.0.0.3:1"])


async def test_bad_bodies_get_400_and_the_picker_goes_on(fleet: Fleet) -> None:
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    with epp(fleet, *ONE_FALLBACK) as address:
        cases = [(b"{not json", "not JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe\x00", "not JSON"),
                 (json.dumps({"prompt": "x"}).encode(), "no model"),
                 (json.dumps({"model": MODEL}).encode(), "neither prompt nor messages"),
                 (json.dumps({"model": MODEL, "messages": "hello"}).encode(), "messages must be"),
                 (json.dumps({"model": MODEL, "prompt": {"x": 1}}).encode(), "prompt must be"),
                 (json.dumps({"model": MODEL, "prompt": "x", "cache_salt": 5}).encode(), "cache_salt"),
                 (json.dumps({"model": MODEL, "prompt": "x", "add_special_tokens": 1}).encode(),
                  "add_special_tokens"),
                 # Well-formed JSON the engine's chat template refuses: the coordinator says so.
                 (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
                  "coordinator refused the prompt")]
        for body, words in cases:
            first, second = await buffered(address, body)
            assert_passthrough(first, "request_headers")
            assert_immediate(second, 400, "kvcoord_epp_bad_request", words)
        first, second = await buffered(address, chat(PROMPT_B))
        assert_pick(second, "request_body", [b, a])
        assert health_of(address, "") == health_pb2.HealthCheckResponse.SERVING
        # A chat the index cannot be asked about is placed least-loaded, and says why.
        _, second = await buffered(address, chat(PROMPT_A, continue_final_message=True,
                                                 add_generation_prompt=False))
        picked = set_headers(second.request_body.response)["x-gateway-destination-endpoint"].split(",")
        assert sorted(picked) == sorted([a, b])
        assert_pick(second, "request_body", picked, prefix_aware=False)
        assert "not prefix-aware: continue_final_message" in _why(second)
        # Envoy's STREAMED body mode cannot steer a pick: refused loudly, not misrouted.
        first, _ = await buffered(address, chat(PROMPT_B), mode=processing_mode_pb2.ProcessingMode.STREAMED)
        assert_immediate(first, 500, "kvcoord_epp_unsupported_mode", "BUFFERED")


async def test_shedding_429_when_every_node_is_full(fleet: Fleet) -> None:
    """--max-in-flight 1: a stream holding a pick fills its node; the next request goes to the other node,
    the third is shed with 429; when a stream ends its node takes requests again."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    with epp(fleet, *ONE_FALLBACK, "--max-in-flight", "1") as address:
        async with channel(address) as ch:
            held = []
            for expect in ([a, b], [b]):  # node-a (full from now on) is no fallback for the second
                envoy = Envoy(ch)
                await envoy.send(request_headers())
                [resp] = await envoy.send(request_body(chat(PROMPT_A)))
                assert_pick(resp, "request_body", expect)
                held.append(envoy)
            third = Envoy(ch)
            await third.send(request_headers())
            [resp] = await third.send(request_body(chat(PROMPT_A)))
            assert_immediate(resp, 429, "kvcoord_epp_shed", "saturated")
            await third.close()
            await held[0].close()  # node-a's request is over
            _, second = await buffered(address, chat(PROMPT_B))
            assert_pick(second, "request_body", [a])  # node-b still full: node-a alone, no fallback
            await held[1].close()


async def test_coordinator_down_degrades_or_503(fleet: Fleet) -> None:
    """No coordinator: with static backends picks are least-loaded and say so (readiness SERVING, requests
    without a body too); without any known endpoint every request gets 503 and readiness is NOT_SERVING."""
    nowhere = f"127.0.0.1:{free_port()}"
    with epp(fleet, *ONE_FALLBACK, "--backend", "n1=127.0.0.7:8000", "--backend", "n2=127.0.0.8:8000",
             coordinator=nowhere, name="epp-static") as address:
        assert health_of(address, "readiness") == health_pb2.HealthCheckResponse.SERVING
        first, second = await buffered(address, chat(PROMPT_A))
        assert_passthrough(first, "request_headers")
        picked = set_headers(second.request_body.response)["x-gateway-destination-endpoint"].split(",")
        assert sorted(picked) == ["127.0.0.7:8000", "127.0.0.8:8000"]  # both idle: a random tie-break
        assert_pick(second, "request_body", picked, prefix_aware=False)
        why = set_headers(second.request_body.response)["x-kvcoord-pick"]
        assert "least-loaded" in why and "not prefix-aware: coordinator UNAVAILABLE" in why, why
        async with channel(address) as ch:  # GET /v1/models: placed on its headers
            envoy = Envoy(ch)
            [resp] = await envoy.send(request_headers("/v1/models", end_of_stream=True))
            assert resp.WhichOneof("response") == "request_headers"
            assert set_headers(resp.request_headers.response)["x-gateway-destination-endpoint"] in (
                "127.0.0.7:8000,127.0.0.8:8000", "127.0.0.8:8000,127.0.0.7:8000")
            await envoy.close()
    with epp(fleet, coordinator=nowhere, name="epp-empty") as address:
        assert health_of(address, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_of(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
        first, second = await buffered(address, chat(PROMPT_A))
        assert_immediate(second, 503, "kvcoord_epp_no_endpoint", "no eligible endpoint")


def _serve(port: int, fleet: Fleet, log: str) -> contextlib.AbstractContextManager[Any]:
    tokenizer = f"http://{fleet.endpoints['node-a']}"
    return running(kvcoord_cmd(
        "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{free_port()}",
        "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer={tokenizer}"),
        log=fleet.tmp / log)


async def _poll_pick(address: str, body: bytes, want: Callable[[Any], bool], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        _, resp = await buffered(address, body)
        if resp is not None and resp.WhichOneof("response") == "request_body" and want(resp):
            return resp
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _why(resp: Any) -> str:
    return set_headers(resp.request_body.response)["x-kvcoord-pick"]


def _prefix_pick(order: Sequence[str]) -> Callable[[Any], bool]:
    """A prefix-aware pick of a node holding blocks, in ``order``."""
    def want(resp: Any) -> bool:
        headers = set_headers(resp.request_body.response)
        return (headers["x-kvcoord-pick"].startswith("prefix-aware:") and "(0 blocks)" not in _why(resp)
                and headers["x-gateway-destination-endpoint"] == ",".join(order))
    return want


async def test_coordinator_outage_degrades_visibly_and_recovers(fleet: Fleet) -> None:
    """A second coordinator fed by agents of the same engines: while it is stopped, picks are least-loaded
    over the last known nodes and say why; once it is back (agents resend their snapshots) they are
    prefix-aware again."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    gport = free_port()
    with contextlib.ExitStack() as stack:
        serve = stack.enter_context(_serve(gport, fleet, "serve2.log"))
        for node, pub in fleet.pubs.items():
            stack.enter_context(running(kvcoord_cmd(
                "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", node, "--model", MODEL,
                "--zmq-endpoint", f"tcp://127.0.0.1:{pub}",
                "--replay-endpoint", f"tcp://127.0.0.1:{pub + 1}", "--serving-url", f"http://{fleet.endpoints[node]}"),
                log=fleet.tmp / f"{node}-agent2.log"))
        address = stack.enter_context(epp(fleet, *ONE_FALLBACK, "--refresh-interval", "0.2",
                                          coordinator=f"127.0.0.1:{gport}", name="epp-outage"))
        # The engines' caches reach the new coordinator through the agents' snapshots.
        for prompt, order in ((PROMPT_A, [a, b]), (PROMPT_B, [b, a])):
            resp = await _poll_pick(address, chat(prompt), _prefix_pick(order), "prefix-aware picks")
            assert_pick(resp, "request_body", order)
        stop(serve)  # no waiting needed: the table keeps the nodes a last ListNodes may have left out
        _, resp = await buffered(address, chat(PROMPT_A))
        assert resp.WhichOneof("response") == "request_body", resp
        picked = set_headers(resp.request_body.response)["x-gateway-destination-endpoint"].split(",")
        assert sorted(picked) == sorted([a, b])
        assert_pick(resp, "request_body", picked, prefix_aware=False)
        assert "not prefix-aware: coordinator UNAVAILABLE" in _why(resp)
        with _serve(gport, fleet, "serve2-again.log"):
            resp = await _poll_pick(address, chat(PROMPT_A), _prefix_pick([a, b]), "prefix-aware picks again")
            assert_pick(resp, "request_body", [a, b])


async def test_tls_listener(fleet: Fleet, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = ("--listen-tls-cert", str(certs["server_crt"]), "--listen-tls-key", str(certs["server_key"]))
    hport = free_port()
    with epp(fleet, *ONE_FALLBACK, *tls, "--health-listen", f"127.0.0.1:{hport}", name="epp-tls") as address:
        for service in ("", "liveness", "inference-extension"):  # kubelet's plaintext probes
            assert _until(lambda s=service: health_of(f"127.0.0.1:{hport}", s)
                          == health_pb2.HealthCheckResponse.SERVING, f"health {service!r}")
        creds = grpc.ssl_channel_credentials(root_certificates=certs["ca_crt"].read_bytes())
        async with grpc.aio.secure_channel(address, creds) as ch:
            envoy = Envoy(ch)
            await envoy.send(request_headers())
            [resp] = await envoy.send(request_body(chat(PROMPT_A)))
            assert_pick(resp, "request_body", [fleet.endpoints["node-a"], fleet.endpoints["node-b"]])
            await envoy.close()


async def test_endpoints_of_serving_urls() -> None:
    assert endpoint_of_url("http://10.0.0.5:8000/v1") == "10.0.0.5:8000"
    assert endpoint_of_url("https://10.0.0.5") == "10.0.0.5:443"
    assert endpoint_of_url("http://10.0.0.5") == "10.0.0.5:80"
    assert endpoint_of_url("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert endpoint_of_url("10.0.0.5:9") == "10.0.0.5:9"
    assert endpoint_of_url("http://:80") is None and endpoint_of_url("http://x:99999") is None
    table = EndpointTable({"static": "10.1.1.1:1"})
    assert await table.endpoint("static", "http://10.0.0.5:8000") == "10.1.1.1:1"
    assert await table.endpoint("n", "http://localhost:8000/v1") in ("127.0.0.1:8000", "[::1]:8000")
    assert await table.endpoint("n", "http://no-such-host.invalid:8000") is None
    assert await table.endpoint("n", "") is None
    # --target-ports: rank r at the r-th port (rank = port); a rank past the list has no endpoint.
    ranks = EndpointTable({"static": "10.1.1.1:1"}, (3000, 3002))
    assert await ranks.endpoint("static", "", 1) == "10.1.1.1:3002"
    assert await ranks.endpoint("n", "http://[fd00::1]:8000", 0) == "[fd00::1]:3000"
    assert await ranks.endpoint("n", "http://10.0.0.5:8000", 2) is None


def test_table_keeps_nodes_through_an_empty_listing() -> None:
    """A coordinator restarting (or shutting down) may list nobody for a moment: picks without a lookup
    still have every node the table ever saw listed, instead of none (503)."""
    from kvcoord.load import NodeLoad
    from kvcoord.router.client import NodeStatus

    def node(node_id: str, state: str = "active") -> NodeStatus:
        return NodeStatus(node_id, MODEL, (0,), state, 1, 0, 0.0, NodeLoad(), False, "", None,
                          serving_url=f"http://10.0.0.{len(node_id)}:8000")

    def ids(model: str | None, ever: bool = True) -> list[str]:
        return [c.node_id for c in table.candidates(model, ever=ever)]

    table = EndpointTable({"static": "10.1.1.1:1"})
    table.update([node("a"), node("bb")])
    assert ids(MODEL) == ids(None) == ["a", "bb", "static"]
    table.update([])  # one list that misses them (a coordinator shutting down) leaves them listed
    assert ids(MODEL) == ["a", "bb", "static"] and ids(MODEL, ever=False) == ["a", "bb", "static"]
    table.update([])
    assert ids(MODEL) == ["a", "bb", "static"] and ids(MODEL, ever=False) == ["static"]
    table.update([node("a"), node("bb", "draining")])  # what is listed now wins over what ever was
    assert ids(MODEL) == ["a", "static"]
    assert ids("other-model") == ["static"]


@pytest.mark.parametrize(("flags", "words"), [
    ((), "--coordinator"),
    (("--coordinator", "127.0.0.1"), "HOST:PORT"),
    (("--coordinator", "127.0.0.1:1", "--backend", "node-a"), "NODE=ADDR:PORT"),
    (("--coordinator", "127.0.0.1:1", "--backend", "node-a=engine.local:8000"), "IP address"),
    (("--coordinator", "127.0.0.1:1", "--backend", "x=1.2.3.4:5", "--backend", "x=1.2.3.4:6"), "twice"),
    (("--coordinator", "127.0.0.1:1", "--listen-tls-cert", "c.pem"), "together"),
    (("--coordinator", "127.0.0.1:1", "--max-in-flight", "-1"), "must be >= 0"),
    (("--coordinator", "127.0.0.1:1", "--request-body-mode", "streamed"), "invalid choice"),
    (("--coordinator", "127.0.0.1:1", "--degraded", "sometimes"), "invalid choice: 'sometimes'"),
    (("--coordinator", "127.0.0.1:1", "--decode-ms-per-token", "-3"), "must be > 0"),
    (("--coordinator", "127.0.0.1:1", "--target-ports", "3000,x"), "comma-separated list of ports"),
    (("--coordinator", "127.0.0.1:1", "--target-ports", "3000,3000"), "distinct, 1 to 65535"),
    (("--coordinator", "127.0.0.1:1", "--target-ports", "0"), "distinct, 1 to 65535"),
])
def test_cli_mistakes_are_one_line(flags: tuple[str, ...], words: str) -> None:
    out = subprocess.run(kvcoord_cmd("epp", *flags), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and words in out.stderr, out.stderr


@pytest.mark.parametrize(("flags", "want"), [((), "discount"), (("--degraded", "ignore"), "ignore"),
                                           (("--degraded", "trust"), "trust")])
async def test_degraded_flag_reaches_the_policy(flags: tuple[str, ...], want: str) -> None:
    """``--degraded`` goes through the real parser, the command's config and ``make_policy`` into the
    policy the server picks with; with a non-index policy it is accepted and unused."""
    from kvcoord.cli import build_parser
    from kvcoord.cli.epp import epp_config
    from kvcoord.gateway.epp import EppServer
    from kvcoord.router.placement import LatencyModel
    from kvcoord.router.policy import PrefixAwarePolicy

    for policy, reads in (("prefix-aware", True), ("least-loaded", False)):
        args = build_parser().parse_args(["epp", "--coordinator", "127.0.0.1:1", "--policy", policy, *flags])
        server = EppServer(epp_config(args))
        try:
            got = server.picker.policy
            assert got.name == policy
            if reads:
                assert isinstance(got, PrefixAwarePolicy) and got.degraded == want
                assert got.latency == LatencyModel()
        finally:
            await server.client.close()


async def test_cost_model_flags_reach_the_policy() -> None:
    """The latency model's flags (named as ``kvcoord simulate``'s) reach the picker's prefix-aware policy."""
    from kvcoord.cli import build_parser
    from kvcoord.cli.epp import epp_config
    from kvcoord.gateway.epp import EppServer
    from kvcoord.router.placement import LatencyModel
    from kvcoord.router.policy import PrefixAwarePolicy

    args = build_parser().parse_args(["epp", "--coordinator", "127.0.0.1:1", "--prefill-us-per-token", "2.5",
                                      "--decode-ms-per-token", "10", "--max-running", "4",
                                      "--mean-output-tokens", "64"])
    server = EppServer(epp_config(args))
    try:
        got = server.picker.policy
        assert isinstance(got, PrefixAwarePolicy)
        assert got.latency == LatencyModel(prefill_s_per_token=2.5e-6, decode_s_per_token=10e-3,
                                           max_running=4, mean_output_tokens=64.0)
    finally:
        await server.client.close()


def test_docs_commands_parse() -> None:
    """Every ``kvcoord epp`` command line in docs/epp.md is accepted by the real parser (the Kubernetes
    example's args live in deploy/k8s/epp, checked by tests/repo/test_deploy.py)."""
    import re
    import shlex

    from kvcoord.cli import build_parser
    from tests.procs import REPO

    text = (REPO / "docs" / "epp.md").read_text().replace("\\\n", " ")
    lines = [m.group(1) for m in re.finditer(r"^kvcoord (epp .*)$", text, re.M)]
    assert len(lines) == 1
    for line in lines:
        parsed = build_parser().parse_args(shlex.split(line))
        assert parsed.command == "epp" and parsed.coordinator, line


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = kvcoord_cmd("epp", "--coordinator", "127.0.0.1:1", "--listen", f"127.0.0.1:{port}")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot listen" in out.stderr
