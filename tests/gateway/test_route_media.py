"""Multimodal chats placed by prefix, as real processes: two sim-engines (HTTP, KV events, 16 placeholder
tokens per image), their agents, ``kvcoord serve`` (rendering chats through an engine's /tokenize, with
``image_tokens=16``), and two routers: one asking the coordinator to tokenize, one (``--tokenizer``)
tokenizing itself.

The router gives each image a uuid and forwards it on the part; the sim-engine keys an image by the uuid
it gets (else by an identifier of its own that no router reproduces, as vLLM's pixel digest), so a
prediction that matches the engine's cached tokens shows the uuid reached the engine. Chats sharing an
image land on the node holding it; a different image at the same place is a miss from its first block;
a malformed image part is a one-line 400 that changes nothing."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcoord.gateway.apis import chat_usage
from kvcoord.sim.http import _chat_prompt
from kvcoord.tokenize.media import MediaRule, assign_uuids
from tests.gateway.test_route_apis import _metrics, _until
from tests.http_util import parse_samples, sample
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port

pytestmark = pytest.mark.slow

MODEL = "sim-model"
BLOCK = 8
IMAGE_TOKENS = 16
PROFILE = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BLOCK))
NODES = ("node-a", "node-b")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``{"route": URL, "route-tok": URL, node: engine URL}``."""
    tmp: Path = tmp_path_factory.mktemp("route-media")
    gport, rport, tport = free_port(), free_port(), free_port()
    urls = {"route": f"http://127.0.0.1:{rport}", "route-tok": f"http://127.0.0.1:{tport}"}
    with contextlib.ExitStack() as stack:
        pubs = {}
        for node in NODES:
            http, pub = free_port(), free_port_pair()
            pubs[node] = pub
            urls[node] = f"http://127.0.0.1:{http}"
            cmd = kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                              "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
                              "--http-listen", f"127.0.0.1:{http}", "--rate", "0", "--requests", "0",
                              "--token-interval", "0.005", "--num-blocks", "8192",
                              "--image-tokens", str(IMAGE_TOKENS))
            stack.enter_context(running(cmd, log=tmp / f"{node}.log"))
        tok = urls[NODES[0]]
        serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "",
                            "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer={tok},"
                            f"image_tokens={IMAGE_TOKENS}")
        stack.enter_context(running(serve, log=tmp / "serve.log"))
        wait_for_port(gport, timeout=30)
        for node in NODES:
            wait_for_port(int(urls[node].rsplit(":", 1)[1]), timeout=30)
            cmd = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", node,
                              "--model", MODEL, "--zmq-endpoint", f"tcp://127.0.0.1:{pubs[node]}",
                              "--replay-endpoint", f"tcp://127.0.0.1:{pubs[node] + 1}",
                              "--serving-url", urls[node])
            stack.enter_context(running(cmd, log=tmp / f"agent-{node}.log"))
        common = ("--coordinator", f"127.0.0.1:{gport}", "--model", MODEL, "--deadline-ms", "2000",
                  "--refresh-interval", "0.5", "--seed", "7")
        stack.enter_context(running(kvcoord_cmd("route", "--listen", f"127.0.0.1:{rport}", *common),
                                    log=tmp / "route.log"))
        stack.enter_context(running(kvcoord_cmd("route", "--listen", f"127.0.0.1:{tport}", *common,
                                                "--tokenizer", tok, "--image-tokens", str(IMAGE_TOKENS),
                                                "--no-reserve"),
                                    log=tmp / "route-tok.log"))
        wait_for_port(rport, timeout=30)
        wait_for_port(tport, timeout=30)
        yield urls


async def _send(s: aiohttp.ClientSession, url: str, api: str,
                body: dict[str, Any]) -> tuple[int, Any, Any, int | None]:
    """``(status, headers, body, cached tokens the engine reported)``: chat (streamed or not) or Responses."""
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
    async with s.post(url, json=body) as resp:
        if not body.get("stream") or resp.status != 200:
            data = await resp.json(content_type=None)
            usage = data.get("usage") if isinstance(data, dict) else None
        else:
            data = [json.loads(line[6:]) for line in (await resp.read()).decode().splitlines()
                    if line.startswith("data: {")]
            usage = data[-1]["usage"]
    if not usage:
        return resp.status, resp.headers, data, None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return resp.status, resp.headers, data, int(details["cached_tokens"])


def _data_url() -> str:
    return "data:image/png;base64," + base64.b64encode(os.urandom(48)).decode()


def _chat(system: str, image: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": question},
                                     {"type": "image_url", "image_url": {"url": image}}]}], **extra}


def _image_end(body: dict[str, Any]) -> int:
    """Where the image's placeholder tokens end in the engine's prompt (its own rendering)."""
    msgs = assign_uuids(body["messages"])
    _, items = _chat_prompt({"messages": msgs}, MediaRule("<image>", IMAGE_TOKENS))
    return items[0].offset + items[0].length


async def _holder(s: aiohttp.ClientSession, url: str, make: Any, blocks: int) -> str:
    n = iter(range(1 << 20))

    async def known() -> str | None:
        st, h, b, _ = await _send(s, url, "completions", make(f"warm {next(n)}"))
        assert st == 200, b
        ok = h["x-kvcoord-prefix-aware"] == "true" and int(h["x-kvcoord-matched-blocks"]) >= blocks
        return h["x-kvcoord-node"] if ok else None

    return str(await _until(known, "the index to hold the image's prefix"))


@pytest.mark.parametrize("router", ["route", "route-tok"])
async def test_chats_sharing_an_image_land_on_its_holder_and_hit_as_predicted(
        fleet: dict[str, str], router: str) -> None:
    """The image is in the question's message, after the text: the question differs, so the cached
    prefix stops before it. The system turn and the image share a prefix only when the question does,
    so each chat repeats the question and varies what follows (``stream`` and not)."""
    system = f"You describe pictures for the {router} tests, carefully and briefly " * 3
    image = _data_url()
    url = f"{fleet[router]}/v1/chat/completions"

    def make(tail: str, **extra: Any) -> dict[str, Any]:
        body = _chat(system, image, "what is in this picture", **extra)
        body["messages"].append({"role": "assistant", "content": "a cat"})
        body["messages"].append({"role": "user", "content": tail})
        return body

    end = _image_end(make("x"))
    need = end // BLOCK  # every block up to the image's last full one
    async with aiohttp.ClientSession() as s:
        holder = await _holder(s, url, make, need)
        pairs = []
        for j, stream in enumerate((False, True, False, True)):
            extra = {"stream": True} if stream else {}
            st, h, got, cached = await _send(s, url, "completions", make(f"and then {j}", **extra))
            assert st == 200, got
            assert h["x-kvcoord-node"] == holder
            pairs.append((int(h["x-kvcoord-predicted-cached-tokens"]), cached))
        assert all(p == a and p >= need * BLOCK for p, a in pairs), (pairs, need)
        # the same text with another image: the holder's hit stops at the image's first block
        other = _chat(system, _data_url(), "what is in this picture")
        other["messages"] += make("and then 0")["messages"][2:]
        st, h, got, cached = await _send(s, url, "completions", other)
        assert st == 200, got
        predicted = int(h["x-kvcoord-predicted-cached-tokens"])
        start = end - IMAGE_TOKENS
        assert predicted == cached and predicted <= start - start % BLOCK, (predicted, start)


async def test_a_clients_uuid_is_kept(fleet: dict[str, str]) -> None:
    """Two different URLs with one client uuid are one image to the engine, and so to the router."""
    system = "You compare uploads by their ids and answer in one word " * 3
    url = f"{fleet['route']}/v1/chat/completions"

    def make(tail: str, image: str | None = None) -> dict[str, Any]:
        body = _chat(system, image or _data_url(), "same picture", )
        body["messages"][1]["content"][1]["uuid"] = "client-image-7"
        body["messages"].append({"role": "assistant", "content": "yes"})
        body["messages"].append({"role": "user", "content": tail})
        return body

    need = _image_end(make("x")) // BLOCK
    async with aiohttp.ClientSession() as s:
        holder = await _holder(s, url, make, need)
        st, h, got, cached = await _send(s, url, "completions", make("final"))
        assert st == 200 and h["x-kvcoord-node"] == holder, got
        assert int(h["x-kvcoord-predicted-cached-tokens"]) == cached >= need * BLOCK


async def test_responses_input_image_is_placed_by_prefix(fleet: dict[str, str]) -> None:
    image = _data_url()
    url = f"{fleet['route']}/v1/responses"

    def make(tail: str) -> dict[str, Any]:
        return {"model": MODEL, "max_output_tokens": 2,
                "instructions": "You read receipts and total them up for the user " * 3,
                "input": [{"type": "message", "role": "user", "content": [
                    {"type": "input_image", "image_url": image},
                    {"type": "input_text", "text": "the receipt"}]},
                    {"type": "message", "role": "user", "content": tail}]}

    async with aiohttp.ClientSession() as s:
        n = iter(range(1 << 20))

        async def known() -> str | None:
            st, h, b, _ = await _send(s, url, "responses", make(f"warm {next(n)}"))
            assert st == 200, b
            return h["x-kvcoord-node"] if int(h.get("x-kvcoord-matched-blocks", 0)) >= 6 else None

        holder = await _until(known, "the index to hold the receipt")
        st, h, got, cached = await _send(s, url, "responses", make("sum it"))
        assert st == 200 and h["x-kvcoord-node"] == holder, got
        assert int(h["x-kvcoord-predicted-cached-tokens"]) == cached >= 6 * BLOCK


async def _prompt_tokens(s: aiohttp.ClientSession, urls: dict[str, str]) -> float:
    total = 0.0
    for node in NODES:
        async with s.get(f"{urls[node]}/metrics") as resp:
            text = await resp.text()
        total += sample(parse_samples(text), "vllm:prompt_tokens_total")
    return total


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
    {"type": "image_url", "image_url": {"url": "data:text/html;base64,aGk="}},
    {"type": "image_url", "image_url": 42},
    {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
    {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}, "uuid": ["not", "a", "string"]},
])
async def test_malformed_image_parts_are_refused_and_change_nothing(fleet: dict[str, str],
                                                                    part: dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]}
    bad = 'kvcoord_route_requests_total{endpoint="chat",outcome="bad_request"}'
    async with aiohttp.ClientSession() as s:
        before, tokens = await _metrics(s, fleet["route"]), await _prompt_tokens(s, fleet)
        async with s.post(f"{fleet['route']}/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
            assert resp.status == 400, raw
            assert "x-kvcoord-node" not in resp.headers
        after, tokens_after = await _metrics(s, fleet["route"]), await _prompt_tokens(s, fleet)
    message = json.loads(raw)["error"]["message"]
    assert message.startswith("messages[0].content[1]") and "\n" not in message
    assert after[bad] - before.get(bad, 0) == 1
    placed = {k: v for k, v in after.items() if k.startswith("kvcoord_route_placements_total")}
    assert placed == {k: v for k, v in before.items() if k.startswith("kvcoord_route_placements_total")}
    assert tokens_after == tokens


async def test_anthropic_images_are_served_by_the_engine_and_refused_by_the_router(
        fleet: dict[str, str]) -> None:
    """An Anthropic conversation with an image block (``base64``) and a screenshot in a tool result
    (``url``): the sim-engine's /v1/messages serves it as vLLM does (each image an ``image_url`` part, keyed
    by the engine's own identifier, so the same conversation again hits past both images); the router
    refuses it with a one-line 400 in Anthropic's shape naming why (vLLM's conversion carries no uuid),
    counted, placing nothing."""
    body = {"model": MODEL, "max_tokens": 2,
            "system": "You describe the screenshots a coding agent takes, one line each " * 3,
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": _data_url().partition(",")[2]}},
                    {"type": "text", "text": "what is on the screen"}]},
                {"role": "assistant",
                 "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "taken"},
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/shot.png"}}]}]}]}
    engine = f"{fleet[NODES[0]]}/v1/messages"
    bad = 'kvcoord_route_requests_total{endpoint="messages",outcome="bad_request"}'
    async with aiohttp.ClientSession() as s:
        usages = []
        for _ in range(2):
            async with s.post(engine, json=body) as resp:
                got = await resp.json()
                assert resp.status == 200, got
                usages.append(chat_usage(got["usage"]))
        first, again = usages
        assert first is not None and again is not None
        prompt = first["prompt_tokens"]
        assert prompt > 2 * IMAGE_TOKENS  # both images' placeholders are in the engine's prompt
        assert again["prompt_tokens_details"]["cached_tokens"] >= prompt - 2 * BLOCK, usages
        before, tokens = await _metrics(s, fleet["route"]), await _prompt_tokens(s, fleet)
        async with s.post(f"{fleet['route']}/v1/messages", json=body) as resp:
            raw = await resp.read()
            assert resp.status == 400 and "x-kvcoord-node" not in resp.headers, raw
        after, tokens_after = await _metrics(s, fleet["route"]), await _prompt_tokens(s, fleet)
    err = json.loads(raw)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "no uuid" in err["error"]["message"] and b"\n" not in raw.strip()
    assert after[bad] - before.get(bad, 0) == 1 and tokens_after == tokens
