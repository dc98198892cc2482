"""``kvcoord route --coordinator-http``: lookups over the coordinator's HTTP API, as real processes (three
sim-engines with their agents, ``kvcoord serve`` with its HTTP API and /metrics, and routers).

The HTTP answer says what the gRPC one does (matches, tiers, load, trust, the query's block hashes, the
routers' reservations) for the same query; placement follows the cached prefix and the engine serves the
predicted tokens, by text (the coordinator tokenizes) and by token ids (the router does); a stopped
coordinator degrades placement visibly and it recovers. Every wait is a poll."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvcoord.load import NodeLoad
from kvcoord.router.answer import LookupResult
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from kvcoord.router.http_lookup import HttpLookupClient, http_query
from tests.procs import until_async
from tests.route_fleet import (
    BLOCK,
    MODEL,
    RouteFleet,
    chat,
    outage,
    played_reservation,
    played_tokens,
    post,
    route_fleet,
    route_metrics,
    shows_played,
)

pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b", "node-c")
SYSTEMS = [f"You are helper number {i} over HTTP and you answer every question about subject {i} " * 12
           for i in range(3)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    """``routes[0]`` looks up by text over HTTP, ``routes[1]`` by token ids over HTTP (``--tokenizer``)."""
    with route_fleet(tmp_path_factory.mktemp("http-lookup"), NODES, metrics=True, http=True) as f:
        f.start_route("--coordinator-http", f.coordinator_http, "--seed", "7")
        f.start_route("--coordinator-http", f.coordinator_http, "--tokenizer", f.engines[NODES[0]],
                      "--seed", "7", log="route-tok")
        yield f


async def _coordinator_metric(s: aiohttp.ClientSession, fleet: RouteFleet, name: str) -> float:
    return (await fleet.coordinator_metrics(s, name)).get(name, 0.0)


_HANDLER = 'kvcoord_lookup_answers_total{path="handler"}'
"""HTTP lookups the general handler answered (gRPC lookups are not counted there)."""


async def _routed_to_holder(s: aiohttp.ClientSession, base: str) -> dict[int, set[str]]:
    """Wait until every system prompt is held per the index; prompt index -> the nodes that served it."""
    holders: dict[int, set[str]] = {}
    for i, system in enumerate(SYSTEMS):
        holders[i] = set()

        async def known(i: int = i, system: str = system) -> bool:
            st, h, b = await post(s, f"{base}/v1/chat/completions", chat(system, "probe"))
            assert st == 200, b
            holders[i].add(h["x-kvcoord-node"])
            return h["x-kvcoord-prefix-aware"] == "true" and int(h["x-kvcoord-matched-blocks"]) >= 10

        await until_async(known, f"the index to hold system prompt {i}", timeout=60)
    return holders


@pytest.mark.parametrize("own_tokenizer", [False, True], ids=["text", "token-ids"])
async def test_placement_over_http_follows_the_prefix_and_achieved_matches_predicted(
        fleet: RouteFleet, own_tokenizer: bool) -> None:
    base = fleet.routes[1] if own_tokenizer else fleet.route
    async with aiohttp.ClientSession() as s:
        holders = await _routed_to_holder(s, base)
        answered = await _coordinator_metric(s, fleet, _HANDLER)
        results = []
        for j in range(24):
            i = j % len(SYSTEMS)
            st, h, b = await post(s, f"{base}/v1/chat/completions", chat(SYSTEMS[i], f"question {j} please"))
            assert st == 200, b
            results.append((i, h, b))
        assert await _coordinator_metric(s, fleet, _HANDLER) - answered >= len(results)  # over HTTP
        m = await route_metrics(s, base)
    for i, h, _ in results:
        assert h["x-kvcoord-prefix-aware"] == "true", h["x-kvcoord-reason"]
        assert h["x-kvcoord-node"] in holders[i], (h["x-kvcoord-reason"], holders)
        assert h["x-kvcoord-matched-blocks"] == h["x-kvcoord-best-blocks"]
    pairs = [(int(h["x-kvcoord-predicted-cached-tokens"]),
              b["usage"]["prompt_tokens_details"]["cached_tokens"]) for _, h, b in results]
    assert sum(p == a for p, a in pairs) >= 0.95 * len(pairs), pairs
    assert all(p >= 10 * BLOCK for p, _ in pairs), pairs
    assert m["kvcoord_route_coordinator_up"] == 1 and m["kvcoord_route_degraded_mode"] == 0


def _same(a: LookupResult) -> LookupResult:
    """The answer without loads (a heartbeat may land between two lookups)."""
    return dataclasses.replace(a, nodes=[dataclasses.replace(n, load=NodeLoad()) for n in a.nodes])


async def test_http_and_grpc_answer_the_same_with_reservations_and_block_hashes(fleet: RouteFleet) -> None:
    """Another router's reservation (a played ``Reserve`` stream) on node-b: the HTTP and gRPC answers to
    the same queries (tokens, chat, hashes) are equal, reserved blocks, requests and prefill included;
    a lookup naming its reservation id holds its new prefix over HTTP as over gRPC."""
    async with AsyncCoordinatorClient(fleet.coordinator) as c:
        h = HttpLookupClient(fleet.coordinator_http, c, timeout=5.0)
        try:
            tokens = played_tokens(2000)
            async with played_reservation(c, tokens, router_id="played-router", node="node-b",
                                          ttl=60.0) as hashes:
                async def reserved() -> bool:
                    a = await h.lookup(MODEL, tokens=tokens, include_unmatched=True, router_id="other")
                    return shows_played(a, "node-b", tokens)

                await until_async(reserved, "node-b's reservation in the HTTP answer")
                chat_query: dict[str, Any] = {"messages": chat(SYSTEMS[0], "same?")["messages"]}
                for query in ({"tokens": tokens}, chat_query, {"hashes": list(hashes)}):
                    for extra in ({}, {"include_unmatched": True, "want_block_hashes": True,
                                       "router_id": "other"}):
                        if "hashes" in query and extra:
                            extra = {"include_unmatched": True}
                        got_grpc = await c.lookup(MODEL, **query, **extra)
                        got_http = await h.lookup(MODEL, **query, **extra)
                        assert _same(got_http) == _same(got_grpc), (query.keys(), extra)
                        if extra.get("want_block_hashes"):
                            assert len(got_http.block_hashes) == got_http.num_blocks > 0
                        if "tokens" in query and extra:  # node-b holds none of it: listed as unmatched
                            assert any(n.reserved_blocks == 8 for n in got_http.nodes)
                before = await _held(fleet)
                await h.lookup(MODEL, tokens=[5, *tokens[1:]], include_unmatched=True, router_id="other",
                               reserve_id="q1")
                assert await _held(fleet) == before + 1
            with pytest.raises(CoordinatorError) as refused:
                await h.lookup("no-such-model", prompt="hello")
            assert refused.value.code.name == "NOT_FOUND", refused.value
        finally:
            await h.close()


async def _held(fleet: RouteFleet) -> float:
    async with aiohttp.ClientSession() as s:
        return await _coordinator_metric(s, fleet, 'kvcoord_reservation_ops_total{op="held"}')


def test_queries_http_cannot_say_go_over_grpc() -> None:
    assert http_query(MODEL, {"tokens": [1, 2], "mm_items": [("img", 0, 1)]}, 0.0) is None
    assert http_query(MODEL, {"tokens": [1, 2], "lora_path": "/x"}, 0.0) is None
    asked = http_query("m@group", {"prompt": "hi", "router_id": "r", "reserve_id": "7"}, 40.0)
    path, body = asked or ("", b"")
    assert path == "/query" and b'"routing_group":"group"' in body and b'"wait_ms":40.0' in body
    with pytest.raises(ValueError, match="exactly one"):
        http_query(MODEL, {"tokens": [1], "prompt": "x"}, 0.0)


async def test_a_stopped_coordinator_degrades_visibly_and_http_lookups_recover(fleet: RouteFleet) -> None:
    async with aiohttp.ClientSession() as s:
        headers, _ = await outage(s, fleet, SYSTEMS[1])
    for h in headers:
        assert h["x-kvcoord-reason"].startswith(("coordinator_unavailable; ", "deadline; ")), h
