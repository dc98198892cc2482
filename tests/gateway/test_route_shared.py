"""Routers that share one view, as real processes: three sim-engines (HTTP and KV events) with their
agents, one ``kvcoord serve`` and two ``kvcoord route`` replicas reserving their picks on it.

A burst sharing a new prefix, split across both routers at once, lands on one node; reservations show in
lookup answers and the coordinator's metrics and go at completion, after their ttl, and when their router
is killed; with the coordinator down both routers still route, saying so. Every wait is a poll."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvcoord.router.client import AsyncCoordinatorClient
from tests.procs import free_port, kvcoord_cmd, running, spawn, stop, wait_for_port
from tests.procs import until_async as _until
from tests.route_fleet import MODEL, RouteFleet, played_reservation, played_tokens, route_fleet, shows_played
from tests.route_fleet import chat as _chat
from tests.route_fleet import post as _post

pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b", "node-c")
ROUTE = ("--deadline-ms", "3000")
"""Every router's flags here, over the fleet's."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    """The fleet (the coordinator's /metrics on) and two routers, route0 and route1."""
    with route_fleet(tmp_path_factory.mktemp("shared"), NODES, metrics=True) as f:
        for i in range(2):
            f.start_route(*ROUTE, "--seed", str(i), log=f"route{i}")
        yield f


async def _health(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with s.get(f"{base}/health") as resp:
        body: dict[str, Any] = await resp.json(content_type=None)
        return body


async def _shared(s: aiohttp.ClientSession, base: str, up: bool) -> bool:
    return bool((await _health(s, base))["shared_view"]["up"] is up)


async def _coordinator_metrics(s: aiohttp.ClientSession, fleet: RouteFleet) -> dict[str, float]:
    return await fleet.coordinator_metrics(s, "kvcoord_reservation", "kvcoord_reserved")


async def _reserved_requests(s: aiohttp.ClientSession, fleet: RouteFleet) -> float:
    return (await _coordinator_metrics(s, fleet)).get('kvcoord_reservations{kind="requests"}', -1.0)


async def _ready(s: aiohttp.ClientSession, fleet: RouteFleet) -> None:
    """Both routers share the view and place prefix-aware (their lookups are warm)."""
    for base in fleet.routes:
        await _until(lambda b=base: _shared(s, b, True), f"{base}'s reservation stream", timeout=60)

        async def aware(b: str = base) -> bool:
            st, h, body = await _post(s, f"{b}/v1/chat/completions", _chat("warm up", "hello"))
            assert st == 200, body
            return h["x-kvcoord-prefix-aware"] == "true"

        await _until(aware, f"{base} prefix-aware", timeout=60)


async def test_a_burst_split_across_two_routers_lands_on_one_node(fleet: RouteFleet) -> None:
    async with aiohttp.ClientSession() as s:
        await _ready(s, fleet)
        for round_ in range(3):
            system = f"A brand new system prompt {uuid.uuid4().hex} that no engine has seen yet. " * 24
            bodies = [_chat(system, f"question {j}") for j in range(8)]
            urls = [f"{fleet.routes[j % 2]}/v1/chat/completions" for j in range(8)]
            answers = await asyncio.gather(*(_post(s, u, b) for u, b in zip(urls, bodies, strict=True)))
            assert all(st == 200 for st, _, _ in answers), answers
            nodes = {h["x-kvcoord-node"] for _, h, _ in answers}
            assert len(nodes) == 1, (round_, [(u[-30:-20], h["x-kvcoord-node"], h["x-kvcoord-reason"])
                                              for u, (_, h, _) in zip(urls, answers, strict=True)])
        m = await _coordinator_metrics(s, fleet)
        assert m['kvcoord_reservation_ops_total{op="reserved"}'] >= 24
        assert m['kvcoord_reservation_ops_total{op="waited"}'] >= 1  # a hold made a lookup wait


async def _stream_through(s: aiohttp.ClientSession, base: str, started: asyncio.Event) -> int:
    """A long stream (200 tokens at 20 ms each); ``started`` is set at its first chunk."""
    body = _chat(f"A long answer please {uuid.uuid4().hex}. " * 4, "tell me", max_tokens=200, stream=True)
    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
        async for _ in resp.content.iter_any():
            started.set()
        return resp.status


async def test_reservations_show_in_answers_and_metrics_and_go_at_completion(fleet: RouteFleet) -> None:
    async with aiohttp.ClientSession() as s, AsyncCoordinatorClient(f"127.0.0.1:{fleet.gport}") as c:
        await _ready(s, fleet)
        await _until(lambda: _zero(s, fleet), "no reservation left from earlier tests")
        started = asyncio.Event()
        task = asyncio.create_task(_stream_through(s, fleet.routes[0], started))
        await asyncio.wait_for(started.wait(), 60)

        async def seen() -> bool:
            answer = await c.lookup(MODEL, tokens=list(range(64)), include_unmatched=True, router_id="probe")
            return any(n.reserved.in_flight for n in answer.nodes)

        await _until(seen, "the stream's reservation in another router's lookup answer")
        assert await _reserved_requests(s, fleet) >= 1
        assert await task == 200
        await _until(lambda: _zero(s, fleet), "the reservation released at completion")
        m = await _coordinator_metrics(s, fleet)
        assert m['kvcoord_reservation_ops_total{op="released"}'] >= 1


async def _zero(s: aiohttp.ClientSession, fleet: RouteFleet) -> bool:
    return await _reserved_requests(s, fleet) == 0


async def test_reserved_blocks_count_for_other_routers_and_expire_after_their_ttl(fleet: RouteFleet) -> None:
    """A router's stream (played here) reserves a new prompt on node-b with a 2 s ttl and stays open:
    another router's lookup sees node-b holding it and its load; the router itself only the blocks; then
    the ttl ends it."""
    async with aiohttp.ClientSession() as s, AsyncCoordinatorClient(f"127.0.0.1:{fleet.gport}") as c:
        tokens = played_tokens(1000)
        async with played_reservation(c, tokens, router_id="frozen-router", node="node-b", ttl=2.0) as hashes:
            assert len(hashes) == 8

            async def reserved() -> bool:
                answer = await c.lookup(MODEL, tokens=tokens, include_unmatched=True, router_id="other")
                return shows_played(answer, "node-b", tokens)

            await _until(reserved, "node-b's reservation in the answer")
            own = await c.lookup(MODEL, tokens=tokens, include_unmatched=True, router_id="frozen-router")
            # Its own blocks count for it too (its memory may keep fewer), not its own load (counted there).
            assert all(n.reserved.in_flight == 0 and n.reserved_blocks == (8 if n.node_id == "node-b" else 0)
                       for n in own.nodes)

            async def expired() -> bool:
                answer = await c.lookup(MODEL, tokens=tokens, include_unmatched=True, router_id="other")
                return all(n.reserved_blocks == 0 and n.reserved.in_flight == 0 for n in answer.nodes)

            await _until(expired, "the reservation's ttl to pass (its stream still open)")
            m = await _coordinator_metrics(s, fleet)
            assert m['kvcoord_reservation_ops_total{op="expired"}'] >= 1


async def test_a_killed_routers_reservations_vanish(fleet: RouteFleet) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = fleet.tmp / "route-killed.log"
    with open(log, "ab") as out:
        cmd = fleet.route_cmd(port, *ROUTE, "--reserve-ttl", "5")
        proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for_port(port, timeout=30)
            async with aiohttp.ClientSession() as s:
                await _until(lambda: _shared(s, base, True), "the new router's reservation stream", 60)
                await _until(lambda: _zero(s, fleet), "no reservation left from earlier tests")
                started = asyncio.Event()
                task = asyncio.create_task(_stream_through(s, base, started))
                await asyncio.wait_for(started.wait(), 60)
                await _until(lambda: _nonzero(s, fleet), "the stream's reservation")
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                with contextlib.suppress(aiohttp.ClientError):
                    await task
                await _until(lambda: _zero(s, fleet), "the killed router's reservation gone")
        finally:
            stop(proc)


async def _nonzero(s: aiohttp.ClientSession, fleet: RouteFleet) -> bool:
    return await _reserved_requests(s, fleet) > 0


async def test_with_the_coordinator_down_both_routers_route_on_their_own_memory(fleet: RouteFleet) -> None:
    async with aiohttp.ClientSession() as s:
        await _ready(s, fleet)
        stop(fleet.procs["serve"])
        for base in fleet.routes:
            await _until(lambda b=base: _shared(s, b, False), f"{base} noticing the stream is down")
            st, h, body = await _post(s, f"{base}/v1/chat/completions", _chat("while down", "hi"))
            assert st == 200, body
            assert h["x-kvcoord-prefix-aware"] == "false"
            async with s.get(f"{base}/metrics") as resp:
                assert "kvcoord_route_shared_view 0.0" in await resp.text()
        for i in range(2):
            assert "placing on this router's own memory" in (fleet.tmp / f"route{i}.log").read_text()
        fleet.start_serve()
        for base in fleet.routes:
            await _until(lambda b=base: _shared(s, b, True), f"{base}'s stream back", timeout=60)


async def test_route_follows_a_pick_epp_holds(fleet: RouteFleet) -> None:
    """An ``epp`` pick of a new prefix (its ext_proc stream still open: the request runs) is reserved, so
    a ``route`` request sharing that prefix goes to the same node; the stream's end releases it."""
    import json

    from tests.gateway.test_epp import Envoy, channel, request_body, request_headers, set_headers

    port = free_port()
    cmd = kvcoord_cmd("epp", "--coordinator", f"127.0.0.1:{fleet.gport}", "--listen", f"127.0.0.1:{port}")
    with running(cmd, log=fleet.tmp / "epp.log"):
        wait_for_port(port, timeout=30)
        async with aiohttp.ClientSession() as s:
            await _ready(s, fleet)
            await _until(lambda: _zero(s, fleet), "no reservation left from earlier tests")
            by_endpoint = {url.removeprefix("http://"): node for node, url in fleet.engines.items()}
            system = f"Shared between the gateway and the router {uuid.uuid4().hex}. " * 8
            async with channel(f"127.0.0.1:{port}") as ch:
                envoy = Envoy(ch)
                await envoy.send(request_headers())
                [picked] = await envoy.send(request_body(json.dumps(_chat(system, "from envoy")).encode()))
                endpoint = set_headers(picked.request_body.response)["x-gateway-destination-endpoint"]
                await _until(lambda: _nonzero(s, fleet), "the epp pick's reservation")
                st, h, body = await _post(s, f"{fleet.routes[0]}/v1/chat/completions",
                                          _chat(system, "from the router"))
                assert st == 200, body
                assert h["x-kvcoord-node"] == by_endpoint[endpoint], h["x-kvcoord-reason"]
                await envoy.close()
            await _until(lambda: _zero(s, fleet), "the epp pick released at the stream's end")
