"""The Gateway API Inference Extension's conformance scenarios (``conformance/tests/*.go`` in
kubernetes-sigs/gateway-api-inference-extension), replayed against real ``kvcoord epp --conformance``
processes as the ext_proc message sequences a gateway sends for them, over real gRPC.

The suite needs Kubernetes and a gateway; what it checks of the picker is what reaches the gateway: the
``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata of the pick (the pod, and for data
parallelism the port, the request must reach), and the ``x-conformance-test-served-endpoint`` response
header. Each test names the Go file and the assertion it mirrors. The pools are as the suite's
``conformance/resources/base.yaml`` makes them: three pods per pool, echo port 3000, and a data-parallel
pool with ``targetPorts`` 3000, 3002 and 3004. Each pool is a real ``kvcoord serve`` with one agent per
pod (no KV events: the pods are addresses on the loopback, 127.0.0.x, announced as serving URLs) and a
sim-engine as the model's tokenizer, so picks are real lookups.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvcoord.router.client import CoordinatorClient
from tests.gateway.test_epp import (
    DEADLINE,
    PROFILE,
    Envoy,
    _until,
    assert_immediate,
    assert_passthrough,
    channel,
    epp_metrics,
    request_body,
    request_headers,
    set_headers,
)
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port

MODEL = "conformance-fake-model"
BODY = json.dumps({"model": MODEL, "prompt": "Write as if you were a critic: San Francisco"}).encode()
"""The suite's request body (``requestBody`` in every scenario)."""
SELECTION = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"
ECHO_PORT = "3000"
DP_PORTS = ("3000", "3002", "3004")
"""``dpPorts`` of ``gateway_following_epp_routing_dp.go``, the DP pool's ``targetPorts``."""
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class Pool:
    coordinator: str
    ips: list[str]
    """Pod i's IP (its agent's node id is ``{name}-{i}``)."""


@dataclass
class Pools:
    primary: Pool
    secondary: Pool
    dp: Pool
    tmp: Path


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    """Three pools, each a coordinator and three pods' agents; one sim-engine tokenizes for all."""
    tmp = tmp_path_factory.mktemp("epp-conformance")
    tok, pub = free_port(), free_port_pair()
    layout = {"primary": (11, "0"), "secondary": (21, "0"), "dp": (31, "0,1,2")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(kvcoord_cmd(
            "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
            "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
            "--http-listen", f"127.0.0.1:{tok}", "--rate", "0", "--requests", "0"),
            log=tmp / "tokenizer.log"))
        gports = {name: free_port() for name in layout}
        for name, gport in gports.items():
            stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{free_port()}",
                "--model", f"{MODEL},algo=sha256_cbor,block_size=8,seed=0,tokenizer=http://127.0.0.1:{tok}"),
                log=tmp / f"serve-{name}.log"))
        for port in (tok, *gports.values()):
            wait_for_port(port, timeout=30)
        built = {}
        for name, (base, ranks) in layout.items():
            ips = [f"127.0.0.{base + i}" for i in range(3)]
            for i, ip in enumerate(ips):
                stack.enter_context(running(kvcoord_cmd(
                    "agent", "--coordinator", f"127.0.0.1:{gports[name]}", "--node-id", f"{name}-{i}",
                    "--model", MODEL, "--no-kv-events", "--dp-ranks", ranks,
                    "--serving-url", f"http://{ip}:{ECHO_PORT}"), log=tmp / f"agent-{name}-{i}.log"))
            built[name] = Pool(f"127.0.0.1:{gports[name]}", ips)
        for name, pool in built.items():
            want = len(layout[name][1].split(","))
            with CoordinatorClient(pool.coordinator) as client:
                _until(lambda c=client, w=want: sum(len(n.dp_ranks) == w and n.state == "active"
                                                    for n in c.list_nodes()) == 3, f"{name}'s three pods")
        yield Pools(built["primary"], built["secondary"], built["dp"], tmp)


@contextlib.contextmanager
def picker(pools: Pools, pool: Pool, *flags: str, name: str, port: int = 0) -> Iterator[str]:
    """``kvcoord epp`` for ``pool`` with ``flags``; yields its ext_proc address."""
    port = port or free_port()
    cmd = kvcoord_cmd("epp", "--coordinator", pool.coordinator, "--listen", f"127.0.0.1:{port}",
                      "--timeout", "10", *flags)  # a slow lookup on a busy machine is no outage here
    with running(cmd, log=pools.tmp / f"{name}.log"):
        wait_for_port(port, timeout=30)
        yield f"127.0.0.1:{port}"


# --- playing the gateway ---------------------------------------------------------------------------
PICKED = "picked"


async def gateway_request(address: str, selection: str | None, *, served: str | None = PICKED,
                          subset: Sequence[str] | None = None, lb_namespace: bool = True,
                          body: bytes = BODY) -> tuple[Any, Any]:
    """One request of the suite through the picker, as an Inference Extension gateway runs ext_proc
    (``FULL_DUPLEX_STREAMED`` request body, response headers sent): the request headers with the suite's
    selection header, the body; then, unless the picker answered with an ImmediateResponse, the response
    headers with ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` (the picked endpoint unless
    ``served`` says otherwise; None: no such key; ``lb_namespace`` False: no ``envoy.lb`` at all).
    Returns the pick answer and the response-headers answer (None after an ImmediateResponse)."""
    extra = {SELECTION: selection} if selection is not None else None
    async with channel(address) as ch:
        envoy = Envoy(ch)
        await envoy.call.write(request_headers("/primary-gateway-test", mode=FULL_DUPLEX, subset=subset,
                                               extra=extra))
        await envoy.call.write(request_body(body, end_of_stream=True))
        pick = await asyncio.wait_for(envoy.call.read(), DEADLINE)
        if pick.WhichOneof("response") == "immediate_response":
            await envoy.close()
            return pick, None
        streamed = await asyncio.wait_for(envoy.call.read(), DEADLINE)
        assert streamed.request_body.response.body_mutation.streamed_response.body == body
        msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
        if lb_namespace:
            lb = msg.metadata_context.filter_metadata["envoy.lb"]
            value = picked(pick) if served == PICKED else served
            if value is not None:
                lb.fields["x-gateway-destination-endpoint-served"].string_value = value
            else:
                lb.fields["some-other-key"].string_value = "x"
        [answer] = await envoy.send(msg)
        await envoy.close()
        return pick, answer


def picked(resp: Any) -> str:
    """The one endpoint of a pick (the default sends no fallbacks), the same in the header and in
    ``envoy.lb``, with the reference's ``X-Echo-Set-Header`` asking the echo server to answer it."""
    assert resp.WhichOneof("response") == "request_headers", resp
    common = resp.request_headers.response
    assert common.clear_route_cache is True
    headers = set_headers(common)
    endpoint = headers.pop("x-gateway-destination-endpoint")
    assert "," not in endpoint
    assert headers.pop("x-echo-set-header") == f"{SERVED}:{endpoint}"
    assert headers.pop("x-kvcoord-pick").startswith("prefix-aware: ")
    assert headers == {}
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value
    assert dict(lb.fields) == {"x-gateway-destination-endpoint": lb.fields["x-gateway-destination-endpoint"]}
    assert lb.fields["x-gateway-destination-endpoint"].string_value == endpoint
    return endpoint


def echoed(resp: Any) -> str:
    """The ``x-conformance-test-served-endpoint`` the response-headers answer sets (and nothing else)."""
    assert resp.WhichOneof("response") == "response_headers", resp
    headers = set_headers(resp.response_headers.response)
    value = headers.pop(SERVED)
    assert headers == {}
    return value


async def traffic(address: str, selection: str, total: int = 100, concurrency: int = 10) -> list[str]:
    """``assertTrafficOnlyReachesToExpectedPods``: ``total`` requests, ``concurrency`` at a time; the
    endpoint each was picked to (and served by)."""
    limit = asyncio.Semaphore(concurrency)

    async def one() -> str:
        async with limit:
            pick, answer = await gateway_request(address, selection)
            endpoint = picked(pick)
            assert echoed(answer) == endpoint
            return endpoint

    return list(await asyncio.gather(*(one() for _ in range(total))))


def ip_of(endpoint: str) -> str:
    return endpoint.rpartition(":")[0]


# --- the scenarios -----------------------------------------------------------------------------------
async def test_gateway_following_epp_routing(pools: Pools) -> None:
    """``gateway_following_epp_routing.go``: the warm-up pins each pod by its IP (``Backend: podNames[i]``),
    then each test case's 100 requests (10 at a time) reach only the pods named in the header
    (``slices.Contains(expectedPodNames, cReq.Pod)``)."""
    ips = pools.primary.ips
    with picker(pools, pools.primary, "--conformance", name="epp-routing") as address:
        for ip in ips:
            pick, _ = await gateway_request(address, ip)
            assert picked(pick) == f"{ip}:{ECHO_PORT}"
        for chosen in ([ips[2]], [ips[0], ips[1]], [ips[0], ips[1], ips[2]]):
            got = await traffic(address, ",".join(chosen))
            assert {ip_of(e) for e in got} <= set(chosen), got
            assert {e.rpartition(":")[2] for e in got} == {ECHO_PORT}


def build_epp_header(ip_to_ports: dict[str, set[str]]) -> str:
    """``buildEPPHeader``: IPs sorted; a bare IP for any port, else ``ip:port`` per port, sorted."""
    tokens: list[str] = []
    for ip in sorted(ip_to_ports):
        ports = ip_to_ports[ip]
        tokens.extend([ip] if not ports else [f"{ip}:{p}" for p in sorted(ports)])
    return ",".join(tokens)


async def test_gateway_following_epp_routing_dp(pools: Pools) -> None:
    """``gateway_following_epp_routing_dp.go``: each pod has three DP ranks on ports 3000, 3002 and 3004
    (rank = port); the header names pods by IP (any rank) or ``ip:port`` (that rank). Each request reaches
    a named pod (``slices.Contains(expectedPodNames, cReq.Pod)``) on an allowed port
    (``allowed[cReq.HTTPPort]``, or one of ``dpPorts`` for a bare IP)."""
    b = pools.dp.ips
    flags = ("--conformance", "--target-ports", ",".join(DP_PORTS))
    with picker(pools, pools.dp, *flags, name="epp-dp") as address:
        for ip in b:  # "Single-pod pin to ensure header filter works before main test cases."
            pick, _ = await gateway_request(address, ip)
            endpoint = picked(pick)
            assert ip_of(endpoint) == ip and endpoint.rpartition(":")[2] in DP_PORTS
        cases: list[dict[str, set[str]]] = [
            {b[1]: set()},                                   # one designated pod (any rank)
            {b[0]: set(), b[2]: {"3002"}},                    # two pods; one has a fixed rank
            {b[0]: set(), b[1]: {"3000", "3004"}, b[2]: set()},  # all pods; one restricted to 3000,3004
        ]
        for case in cases:
            got = await traffic(address, build_epp_header(case))
            for endpoint in got:
                ip, _, port = endpoint.rpartition(":")
                assert ip in case, (case, endpoint)
                assert port in (case[ip] or set(DP_PORTS)), (case, endpoint)
        # Picks are per rank on the lookup's per-rank matches: a new prompt sent to rank 1 (3002) is
        # held there only, so the same prompt for the pod at any rank goes back to that rank.
        fresh = json.dumps({"model": MODEL, "prompt": "Only rank one has seen this prompt " * 4}).encode()
        pick, _ = await gateway_request(address, f"{b[1]}:3002", body=fresh)
        assert picked(pick) == f"{b[1]}:3002"
        for _ in range(3):
            pick, _ = await gateway_request(address, b[1], body=fresh)
            assert picked(pick) == f"{b[1]}:3002"
            assert "(0 blocks)" not in set_headers(pick.request_headers.response)["x-kvcoord-pick"]


async def test_gateway_destination_endpoint_served(pools: Pools) -> None:
    """``gateway_destination_endpoint_served.go``: a request pinned to pod i answers
    ``x-conformance-test-served-endpoint: podIPs[i]:3000`` (``Response.Headers``), the value the data plane
    reported in ``envoy.lb`` / ``x-gateway-destination-endpoint-served``; without that metadata, the
    reference picker's failure strings. Without ``--conformance`` neither hook is there."""
    with picker(pools, pools.primary, "--conformance", name="epp-served") as address:
        for ip in pools.primary.ips:
            pick, answer = await gateway_request(address, ip)
            assert picked(pick) == f"{ip}:{ECHO_PORT}"
            assert echoed(answer) == f"{ip}:{ECHO_PORT}"
        ip = pools.primary.ips[0]
        _, answer = await gateway_request(address, ip, served=f"{pools.primary.ips[1]}:{ECHO_PORT}")
        assert echoed(answer) == f"{pools.primary.ips[1]}:{ECHO_PORT}"  # what served it, not what was picked
        _, answer = await gateway_request(address, ip, served=None)
        assert echoed(answer) == "fail: missing destination endpoint served metadata"
        _, answer = await gateway_request(address, ip, lb_namespace=False)
        assert echoed(answer) == "fail: missing envoy lb metadata"
    with picker(pools, pools.primary, name="epp-plain") as address:
        subset = [f"{pools.primary.ips[1]}:{ECHO_PORT}"]
        for _ in range(3):  # the header is ignored: the subset hint alone restricts the pick
            pick, answer = await gateway_request(address, pools.primary.ips[0], subset=subset,
                                                 served=subset[0])
            headers = set_headers(pick.request_headers.response)
            assert headers["x-gateway-destination-endpoint"] == subset[0]
            assert "x-echo-set-header" not in headers
            assert_passthrough(answer, "response_headers")


async def test_epp_unavailable_fail_open(pools: Pools) -> None:
    """``epp_unavailable_fail_open.go``: phase 1 pins ``pods[0]`` through the picker (``Backend:
    pods[0].Name``); phase 2 makes the picker's Service unavailable, and the gateway must send the request
    on (``failureMode: FailOpen``). What the picker owes phase 2 is to be unreachable, not to answer: the
    gateway's ext_proc call fails UNAVAILABLE, the error on which Envoy's ``failure_mode_allow`` goes on. The
    cleanup restores the Service: a picker on the same port picks again."""
    port = free_port()
    target = pools.secondary.ips[0]
    with picker(pools, pools.secondary, "--conformance", name="epp-failopen", port=port) as address:
        pick, _ = await gateway_request(address, target)
        assert picked(pick) == f"{target}:{ECHO_PORT}"
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await gateway_request(address, target)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    with picker(pools, pools.secondary, "--conformance", name="epp-failopen-restored", port=port) as again:
        # MakeRequestAndExpectEventuallyConsistentResponse: gRPC's reconnect backoff may refuse at first.
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                pick, _ = await gateway_request(again, target)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                await asyncio.sleep(0.2)
        assert picked(pick) == f"{target}:{ECHO_PORT}"


async def test_gateway_weighted_two_pools(pools: Pools) -> None:
    """``gateway_weighted_two_pools.go``: two pools, each with its picker; the header lists all six pods'
    IPs and each picker keeps to its own pool (``request was handled by unexpected pod``); the gateway
    splits 70/30 by weight (its part: played here with a seeded draw), and every request is counted
    (``sum of hits must equal number of attempts``). The warm-up pins each pod as ``ip:3000``: through its
    own pool's picker it reaches that pod; through the other pool's, there is no such endpoint (503), and
    the suite retries until the gateway picks the right pool."""
    primary_ips, secondary_ips = pools.primary.ips, pools.secondary.ips
    with picker(pools, pools.primary, "--conformance", name="epp-weighted-primary") as p_addr, \
            picker(pools, pools.secondary, "--conformance", name="epp-weighted-secondary") as s_addr:
        for own, other, ips in ((p_addr, s_addr, primary_ips), (s_addr, p_addr, secondary_ips)):
            for ip in ips:
                pick, _ = await gateway_request(own, f"{ip}:{ECHO_PORT}")
                assert picked(pick) == f"{ip}:{ECHO_PORT}"
                pick, _ = await gateway_request(other, f"{ip}:{ECHO_PORT}")
                assert_immediate(pick, 503, "kvcoord_epp_no_endpoint", SELECTION)
        header = ",".join(primary_ips + secondary_ips)
        draw = random.Random(7)
        to_primary = sum(draw.random() < 0.7 for _ in range(200))
        hits_p = await traffic(p_addr, header, total=to_primary, concurrency=5)
        hits_s = await traffic(s_addr, header, total=200 - to_primary, concurrency=5)
        assert {ip_of(e) for e in hits_p} <= set(primary_ips)
        assert {ip_of(e) for e in hits_s} <= set(secondary_ips)
        assert len(hits_p) + len(hits_s) == 200


async def test_selection_header_bad_input(pools: Pools) -> None:
    """A selection no pod matches (malformed, an IP outside the pool, a port the pod does not serve, only
    empty entries) is strict, as in the reference (``pkg/lwepp/handlers/request.go``: no fallback to the
    whole pool): 503, one log line, counted; the picker goes on. The header wins over the subset hint; an
    empty header is no header."""
    ips = pools.primary.ips
    mport = free_port()
    with picker(pools, pools.primary, "--conformance", "--metrics-listen", f"127.0.0.1:{mport}",
                name="epp-bad") as address:
        for bad in ("not-an-ip", ",", "10.9.9.9", f"{ips[0]}:9999", f"{ips[0]}:abc"):
            pick, answer = await gateway_request(address, bad)
            assert answer is None
            assert_immediate(pick, 503, "kvcoord_epp_no_endpoint", f"in the {SELECTION} header")
        pick, _ = await gateway_request(address, f"{ips[1]}", subset=[f"{ips[0]}:{ECHO_PORT}"])
        assert picked(pick) == f"{ips[1]}:{ECHO_PORT}"
        pick, _ = await gateway_request(address, "", subset=[f"{ips[2]}:{ECHO_PORT}"])
        assert picked(pick) == f"{ips[2]}:{ECHO_PORT}"
        pick, _ = await gateway_request(address, f" {ips[0]} ,")  # entries are trimmed; an empty one is inert
        assert picked(pick) == f"{ips[0]}:{ECHO_PORT}"
        m = epp_metrics(mport)
        assert m['kvcoord_epp_requests_total{outcome="no_endpoint"}'] == 5
        assert m['kvcoord_epp_requests_total{outcome="picked"}'] == 3
    log = (pools.tmp / "epp-bad.log").read_text()
    assert log.count("answering 503 (no_endpoint)") == 5
