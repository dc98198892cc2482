"""Disaggregated prefill and decode through ``kvcoord route``, as real processes: two prefill sim-engines
(``--kv-role kv_producer``) and two decode ones (``kv_consumer``) speaking vLLM's ``kv_transfer_params``
protocol over HTTP, their agents, ``kvcoord serve`` and ``kvcoord route --prefill-node/--decode-node``.

The prefill lands where the prompt's prefix is; the decode engine stores the transferred blocks (its KV
events reach the index, so the next request sharing the prompt skips the prefill); streams come back
from the decode engine; achieved cached tokens match the prediction of the pick that prefilled."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.http_util import http_json
from tests.procs import kvcoord_cmd, stop, wait_for_port
from tests.procs import until_async as _until
from tests.route_fleet import BLOCK, MODEL, RouteFleet, post, read_sse, route_fleet, route_metrics
from tests.route_fleet import chat as _chat

pytestmark = pytest.mark.slow

PREFILL = ("pre-a", "pre-b")
DECODE = ("dec-a", "dec-b")
LOCAL = 40
"""--max-local-prefill-tokens: a short question after a cached system prompt stays on the decode node."""
SYSTEMS = [f"You are helper {i} and you explain the subject {i} carefully and in detail " * 10
           for i in range(3)]


REGISTERED = "42"
"""With roles: the second decode engine is registered over HTTP (``/register``), as instance 42."""


def decode_nodes(fleet: RouteFleet) -> tuple[str, ...]:
    """The decode pool: every engine but the prefill ones."""
    return tuple(n for n in fleet.engines if n not in PREFILL)


def _register(http: str, node: str, pub: int, url: str, role: str) -> tuple[int, Any]:
    """``POST /register`` of engine ``node`` in ``role``: the status and JSON answer."""
    return http_json("POST", f"{http}/register", {
        "instance_id": int(node), "model_name": MODEL, "block_size": BLOCK, "serving_url": url,
        "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{pub + 1}", "role": role})


@contextlib.contextmanager
def pd_fleet(tmp: Path, *, roles: bool) -> Iterator[RouteFleet]:
    """The route fleet of two prefill sim-engines (``--kv-role kv_producer``) and two decode ones
    (``kv_consumer``), tokenizing through the first decode one, and its router. ``roles`` False: the pools
    are ``route``'s flags. True: ``route`` has none, and the engines declare their roles (the agents'
    ``--role``; the second decode engine, node :data:`REGISTERED`, over the coordinator's ``/register``)."""
    decode = (DECODE[0], REGISTERED) if roles else DECODE
    kv_role = {**{n: ("--kv-role", "kv_producer") for n in PREFILL},
               **{n: ("--kv-role", "kv_consumer") for n in decode}}
    declared = {n: ("--role", "prefill" if n in PREFILL else "decode") for n in PREFILL + decode}
    with route_fleet(tmp, PREFILL + decode, tokenizer=decode[0], node_args=kv_role,
                     agent_args=declared if roles else None,
                     agentless=(REGISTERED,) if roles else (), http=roles) as fleet:
        if roles:
            wait_for_port(fleet.hport, timeout=30)
            status, answer = _register(fleet.coordinator_http, REGISTERED, fleet.pubs[REGISTERED],
                                       fleet.engines[REGISTERED], "decode")
            assert status == 201, answer
        pools = [] if roles else ([a for n in PREFILL for a in ("--prefill-node", n)] +
                                  [a for n in decode for a in ("--decode-node", n)])
        fleet.start_route("--seed", "7", "--max-local-prefill-tokens", str(LOCAL), *pools)
        yield fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    with pd_fleet(tmp_path_factory.mktemp("route-pd"), roles=False) as f:
        yield f


async def _post(s: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """A chat completion through the router at ``base``, which must answer 200: its headers and JSON."""
    status, headers, answer = await post(s, f"{base}/v1/chat/completions", body)
    assert status == 200, answer
    return headers, answer


def _long(j: int) -> str:
    """A question far longer than --max-local-prefill-tokens: always prefilled remotely."""
    return " ".join(f"detail{j}x{k}" for k in range(60))


def _judged(h: Any, b: Any) -> tuple[int, int]:
    """(predicted, achieved) cached tokens of the pick that prefilled."""
    if h["x-kvcoord-pd"].startswith("remote"):
        return int(h["x-kvcoord-prefill-predicted-cached-tokens"]), int(h["x-kvcoord-prefill-cached-tokens"])
    return int(h["x-kvcoord-predicted-cached-tokens"]), b["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_prefill_follows_the_prefix_decode_stores_the_transfer_and_then_skips_prefill(
        fleet: RouteFleet) -> None:
    await check_placement(fleet)


async def check_placement(fleet: RouteFleet) -> None:
    """Prefill lands where the prefix is, the decode engine stores the transfer and then skips prefill,
    and achieved cached tokens match the prediction on at least 95% of the requests."""
    async with aiohttp.ClientSession() as s:
        holders: dict[int, str] = {}
        for i, system in enumerate(SYSTEMS):
            h, b = await _post(s, fleet.route, _chat(system, "warm up"))
            assert h["x-kvcoord-pd"].startswith("remote prefill"), h["x-kvcoord-pd"]
            assert h["x-kvcoord-prefill-node"] in PREFILL and h["x-kvcoord-node"] in decode_nodes(fleet)
            # the decode engine took the transferred prompt: every token but the last one is cached
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == b["usage"]["prompt_tokens"] - 1
            holders[i] = h["x-kvcoord-prefill-node"]

            async def skipped(i: int = i) -> bool:
                # the decode engine's KV events (its stored transfer) reach the index: a short question
                # after the same system prompt is prefilled by the decode node alone
                h, _ = await _post(s, fleet.route, _chat(SYSTEMS[i], "and briefly?"))
                return (h["x-kvcoord-pd"].startswith("decode-only")
                        and int(h["x-kvcoord-matched-blocks"]) >= 10)

            await _until(skipped, f"the decode node to hold system prompt {i}")

            async def prefix_known(i: int = i) -> bool:
                h, _ = await _post(s, fleet.route, _chat(SYSTEMS[i], _long(-1 - i)))
                return int(h.get("x-kvcoord-prefill-matched-blocks", 0)) >= 10

            await _until(prefix_known, f"the index to hold system prompt {i} on a prefill node")

        before = await route_metrics(s, fleet.route)
        results = []
        for j in range(24):
            i = j % len(SYSTEMS)
            user = _long(j) if j % 2 else f"short question {j}?"
            results.append((i, *await _post(s, fleet.route, _chat(SYSTEMS[i], user))))
        after = await route_metrics(s, fleet.route)
    remote = [(i, h) for i, h, _ in results if h["x-kvcoord-pd"].startswith("remote")]
    local = [(i, h) for i, h, _ in results if h["x-kvcoord-pd"].startswith("decode-only")]
    assert len(remote) == 12 and len(local) == 12, [h["x-kvcoord-pd"] for _, h, _ in results]
    for i, h in remote:  # the prefill lands on a node holding the system prompt (the first one did)
        assert int(h["x-kvcoord-prefill-matched-blocks"]) >= 10, (i, dict(h))
        assert int(h["x-kvcoord-predicted-cached-tokens"]) >= 10 * BLOCK  # the decode pick's own hit
    for _, h in local:
        assert h["x-kvcoord-node"] in decode_nodes(fleet) and int(h["x-kvcoord-matched-blocks"]) >= 10
    pairs = [_judged(h, b) for _, h, b in results]
    assert sum(p == a for p, a in pairs) >= 0.95 * len(pairs), pairs
    path = 'kvcoord_route_pd_total{path="%s"}'
    assert after[path % "remote_prefill"] - before[path % "remote_prefill"] == 12
    assert after[path % "decode_only"] - before[path % "decode_only"] == 12
    match = 'kvcoord_route_hit_outcomes_total{outcome="match"}'
    assert after[match] - before[match] >= 0.95 * len(results)
    count = "kvcoord_route_predicted_hit_tokens_count"
    assert after[count] - before[count] == len(results)  # one judged pick per request


async def test_decode_streams_back_after_a_remote_prefill(fleet: RouteFleet) -> None:
    n = 20
    body = _chat(SYSTEMS[0], _long(999), max_tokens=n, stream=True,
                 stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s, s.post(f"{fleet.route}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-kvcoord-pd"].startswith("remote prefill")
        assert resp.headers["x-kvcoord-node"] in DECODE
        events, reads = await read_sse(resp)
    assert events[-1] is None
    texts = [ev for ev in events[:-1] if ev["choices"] and ev["choices"][0]["delta"].get("content")]
    assert len(texts) == n and reads > n // 2
    usage = next(ev["usage"] for ev in events[:-1] if ev.get("usage"))
    assert usage["completion_tokens"] == n
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


async def test_sim_engine_speaks_vllms_kv_transfer_params(fleet: RouteFleet) -> None:
    """A prefill engine names its blocks; a decode engine refuses to prefill for a remote decode and
    a malformed transfer is a 400."""
    pre, dec = fleet.engines[PREFILL[0]], fleet.engines[DECODE[0]]
    body = {"model": MODEL, "prompt": "one two three " * 20, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{pre}/v1/completions", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
        kv = out["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert len(kv["remote_block_ids"]) == -(-out["usage"]["prompt_tokens"] // BLOCK)
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == int(pre.rsplit(":", 1)[1])
        assert {"remote_engine_id", "remote_request_id", "tp_size"} <= set(kv)
        async with s.post(f"{dec}/v1/completions", json=body) as resp:
            assert resp.status == 400 and "kv_consumer" in (await resp.json())["error"]["message"]
        bad = {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": "x",
                                              "remote_engine_id": "e"}}
        async with s.post(f"{dec}/v1/completions", json=bad) as resp:
            assert resp.status == 400 and "remote_block_ids" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(("args", "message"), [
    (["--prefill-node", "a"], "--prefill-node needs --decode-node"),
    (["--decode-node", "a"], "--decode-node needs --prefill-node"),
    (["--prefill-node", "a", "--decode-node", "a"], "node a is in both"),
    (["--prefill-node", "a", "--decode-node", "b", "--max-local-prefill-tokens", "-1"], "must be"),
])
def test_pd_flag_mistakes_are_one_line(args: list[str], message: str) -> None:
    out = subprocess.run(kvcoord_cmd("route", "--coordinator", "127.0.0.1:1", *args), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_sim_engine_refuses_an_unknown_kv_role() -> None:
    out = subprocess.run(kvcoord_cmd("sim-engine", "--kv-role", "kv_sometimes"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "kv_sometimes" in out.stderr


async def test_without_prefill_nodes_the_decode_node_prefills(fleet: RouteFleet) -> None:
    """Last (it stops the prefill engines): a prefill node that cannot be reached is left out, and with
    none left the decode node prefills the request itself, judged on its own prediction."""
    for node in PREFILL:
        stop(fleet.procs[node])
    async with aiohttp.ClientSession() as s:
        before = await route_metrics(s, fleet.route)
        for j in range(3):
            h, b = await _post(s, fleet.route, _chat(SYSTEMS[j % len(SYSTEMS)], _long(500 + j)))
            assert h["x-kvcoord-pd"] == "decode-only: no prefill node answered"
            assert h["x-kvcoord-node"] in DECODE and "x-kvcoord-prefill-node" not in h
            cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == int(h["x-kvcoord-predicted-cached-tokens"]) < b["usage"]["prompt_tokens"] - 1
        after = await route_metrics(s, fleet.route)
    path = 'kvcoord_route_pd_total{path="prefill_failed"}'
    assert after[path] - before[path] == 3
    assert sum(after.get(f'kvcoord_route_backend_suspect{{node="{n}"}}', 0) for n in PREFILL) == 2
