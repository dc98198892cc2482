"""Issue 15 item 3: every role against every RPC and HTTP endpoint, as the README's table says.

One real ``kvcoord serve`` with an agent token bound to ``n1``, a router token and an admin token. Each
call is made with no token, a bad token, each role's token (and the agent's for a node it is not bound
to), and its outcome compared with the table: allowed calls get past auth (their own answer, such as
NOT_FOUND for an unknown node, is fine), refused ones get PERMISSION_DENIED / 403, and unauthenticated
ones UNAUTHENTICATED / 401.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcoord.agent.stream import INGEST_METHOD
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from tests.http_util import http_request
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "roles-model"
TOKENS = {"none": None, "bad": "not-a-token", "router": "r-token", "agent": "a-token", "admin": "x-token"}
ALLOWED, DENIED, UNAUTH = "allowed", "denied", "unauthenticated"


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp: Path = tmp_path_factory.mktemp("roles")
    grpc_port, http_port = free_port(), free_port()
    with running(kvcoord_cmd(
        "serve", "--listen", f"127.0.0.1:{grpc_port}", "--http-listen", f"127.0.0.1:{http_port}",
        "--metrics-listen", "", "--model", f"{MODEL},algo=sha256_cbor,block_size=4,seed=1",
        "--agent-token", f"{TOKENS['agent']}=n1", "--router-token", str(TOKENS["router"]),
        "--admin-token", str(TOKENS["admin"]),
    ), log=tmp / "serve.log"):
        wait_for_port(grpc_port)
        wait_for_port(http_port)
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


def _md(who: str) -> tuple[tuple[str, str], ...]:
    token = TOKENS[who]
    return () if token is None else (("authorization", f"Bearer {token}"),)


def _outcome(code: grpc.StatusCode | None) -> str:
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return DENIED
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return UNAUTH
    return ALLOWED


def _ingest(stub: Any, node: str) -> Callable[..., Any]:
    """Hello on an Ingest stream: the first answer (Welcome) or the stream's error."""
    def call(request: Any, *, metadata: Any, timeout: float) -> Any:
        hello = pb.AgentMessage(hello=pb.Hello(node_id=node, model=MODEL, dp_ranks=[0], epoch=1, next_seq=1))
        responses = stub(iter([hello.SerializeToString()]), metadata=metadata, timeout=timeout)
        return next(iter(responses))
    return call


def _grpc_calls(channel: grpc.Channel) -> dict[str, tuple[Callable[..., Any], Any]]:
    s = pbg.CoordinatorStub(channel)
    ingest = channel.stream_stream(INGEST_METHOD, request_serializer=lambda b: b,
                                   response_deserializer=pb.CoordinatorMessage.FromString)
    lookup = pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=(1).to_bytes(8, "little")))
    return {
        "Lookup": (s.Lookup, lookup),
        "ListNodes": (s.ListNodes, pb.ListNodesRequest()),
        "Stats": (s.Stats, pb.StatsRequest()),
        "Ping": (s.Ping, pb.PingRequest()),
        "Heartbeat n1": (s.Heartbeat, pb.HeartbeatRequest(node_id="n1", epoch=1)),
        "Heartbeat n2": (s.Heartbeat, pb.HeartbeatRequest(node_id="n2", epoch=1)),
        "Ingest n1": (_ingest(ingest, "n1"), None),
        "Ingest n2": (_ingest(ingest, "n2"), None),
        "DrainNode n1": (s.DrainNode, pb.DrainNodeRequest(node_id="n1")),
        "RemoveNode n1": (s.RemoveNode, pb.RemoveNodeRequest(node_id="n1")),
    }


GRPC_TABLE = {  # call -> roles allowed (none and bad are always unauthenticated)
    "Lookup": {"router", "agent", "admin"},
    "ListNodes": {"router", "agent", "admin"},
    "Stats": {"router", "agent", "admin"},
    "Ping": {"router", "agent", "admin"},
    "Heartbeat n1": {"agent", "admin"},
    "Heartbeat n2": {"admin"},
    "Ingest n1": {"agent", "admin"},
    "Ingest n2": {"admin"},
    "DrainNode n1": {"admin"},
    "RemoveNode n1": {"admin"},
}


def _expected(allowed: set[str], who: str) -> str:
    if who in ("none", "bad"):
        return UNAUTH
    return ALLOWED if who in allowed else DENIED


def test_every_role_against_every_rpc(coordinator: tuple[str, str]) -> None:
    address, _ = coordinator
    got: dict[tuple[str, str], str] = {}
    with grpc.insecure_channel(address) as channel:
        calls = _grpc_calls(channel)
        assert set(calls) == set(GRPC_TABLE)
        # RemoveNode last: an admin removing n1 would change the later cells' answers (still allowed)
        for name, (method, request) in calls.items():
            for who in TOKENS:
                try:
                    method(request, metadata=_md(who), timeout=10)
                    code = None
                except grpc.RpcError as exc:
                    code = exc.code()
                got[(name, who)] = _outcome(code)
        health = health_pb2_grpc.HealthStub(channel)  # probes carry no token
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    want = {(name, who): _expected(allowed, who) for name, allowed in GRPC_TABLE.items() for who in TOKENS}
    assert got == want


HTTP_TABLE: list[tuple[str, str, object, set[str]]] = [  # method, path, body, roles allowed
    ("POST", "/query", {"model_name": MODEL, "token_ids": [1, 2, 3, 4]}, {"router", "agent", "admin"}),
    ("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": [1]}, {"router", "agent", "admin"}),
    ("GET", "/workers", None, {"router", "agent", "admin"}),
    ("GET", "/dump", None, {"router", "agent", "admin"}),
    ("POST", "/unregister", {"instance_id": 7, "model_name": MODEL}, {"admin"}),
    ("POST", "/register", {"instance_id": 7, "model_name": MODEL, "block_size": 4,
                           "endpoint": "tcp://127.0.0.1:9"}, {"admin"}),
]


def _http(base: str, method: str, path: str, body: object, who: str) -> int:
    token = TOKENS[who]
    return http_request(method, base + path, body,
                        headers={} if token is None else {"authorization": f"Bearer {token}"}).status


def test_every_role_against_every_http_endpoint(coordinator: tuple[str, str]) -> None:
    _, base = coordinator
    got, want = {}, {}
    for method, path, body, allowed in HTTP_TABLE:
        for who in TOKENS:
            status = _http(base, method, path, body, who)
            got[(path, who)] = DENIED if status == 403 else UNAUTH if status == 401 else ALLOWED
            want[(path, who)] = _expected(allowed, who)
    assert got == want
    assert _http(base, "GET", "/health", None, "none") == 200  # probes carry no token
