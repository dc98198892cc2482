"""``kvcoord route`` serving Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses`` and token-id
requests, as real processes: two sim-engines (HTTP and KV events), their agents, ``kvcoord serve``
(tokenizing chats through an engine's /tokenize) and ``kvcoord route`` (no tokenizer of its own).

Each API's prompt is rendered as the engine renders it, so a repeated prefix lands on its holder and the
engine serves the predicted tokens from cache (read from each API's own usage fields, streaming or not);
a long agentic conversation stays on one node; token ids need no tokenizer; ``Prefer: if-available``
refuses an uncached prompt with 412; bad bodies get one-line errors in the API's own shape."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from tests.procs import until_async as _until
from tests.route_fleet import BLOCK, MODEL, RouteFleet, route_fleet
from tests.route_fleet import route_metrics as _metrics

pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    engines = ("--token-interval", "0.005", "--num-blocks", "8192")
    with route_fleet(tmp_path_factory.mktemp("route-apis"), NODES, engine_args=engines) as f:
        f.start_route("--seed", "7")
        yield f


def _system(tag: str) -> str:
    return f"You are the careful assistant {tag} and you answer each question about {tag} fully " * 10


def _messages_body(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, "system": [{"type": "text", "text": system}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}], **extra}


def _responses_body(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 3, "instructions": system,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}],
            **extra}


_PATHS = {"messages": "/v1/messages", "responses": "/v1/responses"}
_BODIES = {"messages": _messages_body, "responses": _responses_body}


def _cached(api: str, usage: dict[str, Any]) -> int:
    if api == "messages":
        return int(usage["cache_read_input_tokens"])
    if api == "completions":
        return int(usage["prompt_tokens_details"]["cached_tokens"])
    return int(usage["input_tokens_details"]["cached_tokens"])


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw.split(b"\n\n"):
        if not event.strip():
            continue
        lines = dict(line.split(b": ", 1) for line in event.split(b"\n"))
        data = json.loads(lines[b"data"])
        assert lines[b"event"].decode() == data["type"], event
        out.append((data["type"], data))
    return out


async def _send(s: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, Any, Any, int | None]:
    """``(status, headers, body or events, cached tokens the engine reported)``."""
    async with s.post(url, json=body, headers=headers or {}) as resp:
        if not body.get("stream") or resp.status != 200:
            data = await resp.json(content_type=None)
            usage = data.get("usage") if isinstance(data, dict) else None
            return resp.status, resp.headers, data, _cached(api, usage) if usage else None
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = _events(await resp.read())
    # Anthropic's message_delta (before message_stop); Responses' response.completed (or .incomplete)
    usage = events[-2][1]["usage"] if api == "messages" else events[-1][1]["response"]["usage"]
    return 200, resp.headers, events, _cached(api, usage)


async def _holder(s: aiohttp.ClientSession, url: str, api: str, make: Callable[[int], dict[str, Any]],
                  blocks: int = 10) -> str:
    """Send ``make(j)`` until the index knows a node holding ``blocks`` of its prefix; that node."""
    n = iter(range(1 << 20))

    async def known() -> str | None:
        st, h, b, _ = await _send(s, url, api, make(next(n)))
        assert st == 200, b
        ok = h["x-kvcoord-prefix-aware"] == "true" and int(h["x-kvcoord-matched-blocks"]) >= blocks
        return h["x-kvcoord-node"] if ok else None

    return str(await _until(known, f"the index to hold a prefix sent to {url}"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_new_apis_are_placed_by_prefix_and_served_from_cache(fleet: RouteFleet, api: str,
                                                                   stream: bool) -> None:
    system = _system(f"{api}-{stream}")
    url = fleet.route + _PATHS[api]
    make = _BODIES[api]
    async with aiohttp.ClientSession() as s:
        holder = await _holder(s, url, api, lambda j: make(system, f"warm {j}"))
        before = await _metrics(s, fleet.route)
        pairs = []
        for j in range(6):
            st, h, got, cached = await _send(s, url, api, make(system, f"question {j}", stream=stream))
            assert st == 200, got
            assert h["x-kvcoord-node"] == holder
            pairs.append((int(h["x-kvcoord-predicted-cached-tokens"]), cached))
            if stream:
                kinds = [k for k, _ in got]
                assert kinds[0] == ("message_start" if api == "messages" else "response.created")
                assert kinds[-1] in ("message_stop", "response.incomplete", "response.completed")
        after = await _metrics(s, fleet.route)
    assert all(p == a and p >= 10 * BLOCK for p, a in pairs), pairs
    endpoint = f'kvcoord_route_requests_total{{endpoint="{api}",outcome="ok"}}'
    assert after[endpoint] - before.get(endpoint, 0) == 6
    match = 'kvcoord_route_hit_outcomes_total{outcome="match"}'
    assert after[match] - before[match] == 6


async def test_agentic_conversation_stays_on_its_node(fleet: RouteFleet) -> None:
    """Thirty turns of tool use sharing one long prefix: each turn goes where the conversation is cached
    and is served from cache up to the turn before."""
    system = _system("agent")
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Please fix the failing test in the repo."}]
    nodes, pairs = [], []
    url = f"{fleet.route}/v1/messages"
    async with aiohttp.ClientSession() as s:
        for turn in range(30):
            body = {"model": MODEL, "max_tokens": 2, "system": system, "tools": tools, "messages": convo}
            st, h, got, cached = await _send(s, url, "messages", body)
            assert st == 200, got
            nodes.append(h["x-kvcoord-node"])
            if turn:
                pairs.append((int(h["x-kvcoord-predicted-cached-tokens"]), cached))
            call = f"toolu_{turn}"
            use = {"type": "tool_use", "id": call, "name": "read_file", "input": {"path": f"f{turn}.py"}}
            result = {"type": "tool_result", "tool_use_id": call, "content": f"contents of file {turn} " * 4}
            said = {"type": "text", "text": got["content"][0]["text"]}
            convo = [*convo, {"role": "assistant", "content": [said, use]},
                     {"role": "user", "content": [result]}]
            # the next turn's prefix is this one's prompt: wait until the index has it
            await _until(lambda b=body: _indexed(s, url, b), f"turn {turn} in the index")
    assert len(set(nodes[1:])) == 1, nodes
    assert sum(p == a for p, a in pairs) >= len(pairs) - 1, pairs
    assert all(a is not None and a >= 10 * BLOCK for _, a in pairs), pairs


async def _indexed(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bool:
    """The index holds (almost) all of ``body``'s prompt: asked with ``Prefer: if-available``."""
    st, _, got, _ = await _send(s, url, "messages", {**body, "max_tokens": 1},
                                headers={"Prefer": "if-available"})
    assert st in (200, 412), got
    return st == 200


async def test_token_ids_are_placed_without_a_tokenizer(fleet: RouteFleet) -> None:
    ids = [(7 * i + 3) % 900 + 50 for i in range(120)]
    async with aiohttp.ClientSession() as s:
        gen = f"{fleet.route}/inference/v1/generate"

        def make(j: int) -> dict[str, Any]:
            return {"model": MODEL, "token_ids": [*ids, 1000 + j], "sampling_params": {"max_tokens": 2}}

        holder = await _holder(s, gen, "generate", make)
        st, h, got, _ = await _send(s, gen, "generate", make(99999))
        assert st == 200 and len(got["choices"][0]["token_ids"]) == 2
        assert h["x-kvcoord-node"] == holder and int(h["x-kvcoord-matched-blocks"]) >= 14
        body = {"model": MODEL, "prompt": [*ids, 7], "max_tokens": 2}
        st, h, got, _ = await _send(s, f"{fleet.route}/v1/completions", "completions", body)
        assert st == 200, got
        assert h["x-kvcoord-node"] == holder and h["x-kvcoord-prefix-aware"] == "true"
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(h["x-kvcoord-predicted-cached-tokens"]) == cached


async def test_prefer_if_available(fleet: RouteFleet) -> None:
    system = _system("prefer")
    url = f"{fleet.route}/v1/responses"
    prefer = {"Prefer": "if-available"}
    async with aiohttp.ClientSession() as s:
        before = await _metrics(s, fleet.route)
        st, h, got, _ = await _send(s, url, "responses", _responses_body(system, "first"), headers=prefer)
        assert st == 412 and "x-kvcoord-node" not in h
        assert set(got) == {"error"} and got["error"]["code"] == 412
        holder = await _holder(s, url, "responses", lambda j: _responses_body(system, f"warm {j}"))
        body = _responses_body(system, "second")
        st, h, got, cached = await _send(s, url, "responses", body, headers=prefer)
        assert st == 200 and h["x-kvcoord-node"] == holder and cached
        after = await _metrics(s, fleet.route)
    key = 'kvcoord_route_requests_total{endpoint="responses",outcome="not_cached"}'
    assert after[key] - before.get(key, 0) == 1


@pytest.mark.parametrize(("path", "body", "shape"), [
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": "hi"}, "anthropic"),
    ("/v1/messages", b"{not json", "anthropic"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is in this image?"}]}]}, "anthropic"),
    ("/v1/responses", {"model": MODEL, "input": 5}, "openai"),
    ("/inference/v1/generate", {"model": MODEL, "token_ids": ["a"]}, "openai"),
])
async def test_bad_bodies_get_the_apis_own_errors(fleet: RouteFleet, path: str, body: Any,
                                                  shape: str) -> None:
    endpoint = {"/v1/messages": "messages", "/v1/responses": "responses"}.get(path, "generate")
    key = f'kvcoord_route_requests_total{{endpoint="{endpoint}",outcome="bad_request"}}'
    async with aiohttp.ClientSession() as s:
        before = await _metrics(s, fleet.route)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        json_type = {"Content-Type": "application/json"}
        async with s.post(fleet.route + path, data=data, headers=json_type) as resp:
            raw = await resp.read()
            assert resp.status == 400
        after = await _metrics(s, fleet.route)
    assert b"\n" not in raw.strip()
    got = json.loads(raw)
    if shape == "anthropic":
        assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
        assert got["error"]["message"]
    else:
        assert set(got) == {"error"} and got["error"]["code"] == 400 and got["error"]["message"]
    assert after[key] - before.get(key, 0) == 1
