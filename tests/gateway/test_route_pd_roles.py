"""P/D pools declared by the engines instead of ``route``'s flags: the fleet of tests/gateway/test_route_pd.py
(two prefill sim-engines, two decode ones, ``serve``, ``route`` without ``--prefill-node``/``--decode-node``)
where the agents say ``--role prefill|decode`` and the second decode engine is registered over
``/register`` with ``"role": "decode"``. ListNodes and ``/workers`` show the roles, route places as with
flags, and follows the node list when the prefill nodes go."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from kvcoord.gateway.disagg import PdConfig, pools_of
from kvcoord.gateway.nodes import NodeTable
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.roles import check_role
from kvcoord.router.client import NodeStatus
from tests.gateway.test_route_pd import (
    PREFILL,
    REGISTERED,
    SYSTEMS,
    _long,
    _post,
    _register,
    check_placement,
    decode_nodes,
    pd_fleet,
)
from tests.http_util import http_json
from tests.procs import kvcoord_cmd, stop
from tests.procs import until_async as _until
from tests.route_fleet import MODEL, RouteFleet
from tests.route_fleet import chat as _chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    with pd_fleet(tmp_path_factory.mktemp("route-pd-roles"), roles=True) as f:
        yield f


def _nodes(fleet: RouteFleet) -> dict[str, str]:
    out = subprocess.run(kvcoord_cmd("nodes", "--coordinator", fleet.coordinator), capture_output=True,
                         text=True, timeout=60, check=True)
    return {n["node_id"]: n["role"] for n in json.loads(out.stdout)["nodes"]}


async def test_roles_are_listed_and_route_places_by_them(fleet: RouteFleet) -> None:
    async def listed() -> bool:
        return await asyncio.to_thread(_nodes, fleet) == {"pre-a": "prefill", "pre-b": "prefill",
                                                           "dec-a": "decode", REGISTERED: "decode"}

    await _until(listed, "ListNodes to show every node's role")
    status, workers = http_json("GET", f"{fleet.coordinator_http}/workers")
    assert status == 200, workers
    assert [(w["instance_id"], w.get("role")) for w in workers] == [(int(REGISTERED), "decode")]
    await check_placement(fleet)


async def test_bad_roles_are_refused_and_nothing_is_registered(fleet: RouteFleet) -> None:
    status, answer = _register(fleet.coordinator_http, "77", 1, fleet.engines[REGISTERED], "prefiller")
    assert status == 400, answer
    assert "'prefiller' is not a role (expected prefill, decode, both)" in answer["error"], answer
    status, workers = http_json("GET", f"{fleet.coordinator_http}/workers")
    assert status == 200 and [w["instance_id"] for w in workers] == [int(REGISTERED)], workers
    out = subprocess.run(kvcoord_cmd("agent", "--coordinator", fleet.coordinator, "--node-id", "x",
                                     "--model", MODEL, "--no-kv-events", "--role", "decoder"),
                         capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "'decoder' is not a role" in lines[0], out.stderr
    async with grpc.aio.insecure_channel(fleet.coordinator) as ch:  # an agent that skips the CLI's check
        call = pbg.CoordinatorStub(ch).Ingest()
        await call.write(pb.AgentMessage(hello=pb.Hello(node_id="rogue", model=MODEL, epoch=1, role="boss")))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Hello.role 'boss' is not a role" in (err.value.details() or "")
    assert "rogue" not in await asyncio.to_thread(_nodes, fleet)


def test_role_names_and_pools_follow_the_node_list() -> None:
    names = ("", "prefill", " Decode", "both", "prefill-decode", "prefill_and_decode")
    assert [check_role(r) for r in names] == ["", "prefill", "decode", "both", "both", "both"]
    with pytest.raises(ValueError, match="publisher is not routable"):
        check_role("decode", publisher="lmcache-remote")
    table = NodeTable({}, logging.getLogger("test"))

    def listing(**roles: str) -> list[NodeStatus]:
        return [NodeStatus(n, MODEL, (0,), "active", 1, 0, 0.0, NodeLoad(), False, "", None,
                           serving_url=f"http://{n}:8000", role=r) for n, r in roles.items()]

    flags = PdConfig(max_local_prefill_tokens=7)
    table.update(listing(a="decode", b="", c="both"))
    assert pools_of(flags, table.roles(MODEL)) is None  # no prefill node: one engine per request
    table.update(listing(a="decode", b="", c="both", p="prefill"))
    assert pools_of(flags, table.roles(MODEL)) == PdConfig(frozenset("p"), frozenset("abc"), 7)
    table.update(listing(p="prefill"))
    table.update(listing(p="prefill"))  # the others left out twice: unlisted
    assert pools_of(flags, table.roles(MODEL)) is None  # only prefill nodes: one engine per request
    declared = PdConfig(frozenset({"x"}), frozenset({"y"}))
    assert pools_of(declared, table.roles(MODEL)) is declared  # flags win


async def test_route_follows_the_prefill_nodes_going(fleet: RouteFleet) -> None:
    """Last: with the prefill nodes' agents gone (their leases run out), no node is prefill and the
    route serves each request on one engine."""
    for node in PREFILL:
        stop(fleet.procs[f"agent-{node}"])
    async with aiohttp.ClientSession() as s:
        async def plain() -> bool:
            h, _ = await _post(s, fleet.route, _chat(SYSTEMS[0], _long(4242)))
            return "x-kvcoord-pd" not in h and h["x-kvcoord-node"] in decode_nodes(fleet)

        await _until(plain, "route to stop using the prefill pool", timeout=60)
