"""``kvcoord route`` end to end, as real processes: three sim-engines (HTTP and KV events), their agents,
``kvcoord serve`` (tokenizing chats through an engine's /tokenize) and ``kvcoord route``.

Chats sharing system prompts land on the node holding their prefix and the engine serves exactly the
predicted tokens from its cache; streams pass through chunk by chunk; killing an engine costs only its
streams; stopping the coordinator degrades placement visibly and it recovers. Every wait is a poll."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcoord.router.placement import DEFAULT_CACHE_THRESHOLD, DEFAULT_WORK_WEIGHT
from tests.procs import free_port, kvcoord_cmd, running, until_async, wait_for_port
from tests.route_fleet import (
    BLOCK,
    MODEL,
    RouteFleet,
    chat,
    outage,
    post,
    read_sse,
    route_fleet,
    route_metrics,
)
from tests.route_fleet import PROFILE as PROFILE  # re-exported: route tests import it from here

pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b", "node-c")
TOKENIZER_NODE = "node-a"
"""The coordinator tokenizes through this engine's /tokenize: the engine-death test kills another one."""
SYSTEMS = [f"You are assistant number {i} and you answer every question about topic {i} " * 12
           for i in range(3)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    """The fleet, and two routers: ``routes[0]`` looks prompts up as text (the coordinator tokenizes),
    ``routes[1]`` tokenizes itself (``--tokenizer``, the tokenizer node's /tokenize)."""
    with route_fleet(tmp_path_factory.mktemp("route"), NODES, tokenizer=TOKENIZER_NODE) as f:
        f.start_route("--seed", "7")
        f.start_route("--tokenizer", f.engines[TOKENIZER_NODE], "--seed", "7", log="route-tok")
        yield f


_until = until_async
"""The fleet tests' poll (other route tests import these names from here)."""
_chat, _post, _metrics, _read_sse = chat, post, route_metrics, read_sse


async def _true(value: bool) -> bool:
    return value


async def _routed_to_holder(s: aiohttp.ClientSession, base: str) -> dict[int, set[str]]:
    """Wait until every system prompt is held by a node per the index; returns prompt index -> the nodes
    that served it so far (only they can hold it)."""
    holders: dict[int, set[str]] = {}
    for i, system in enumerate(SYSTEMS):
        status, headers, body = await _post(s, f"{base}/v1/chat/completions", _chat(system, "warm up"))
        assert status == 200, body
        holders[i] = {headers["x-kvcoord-node"]}

        async def known(i: int = i) -> bool:
            st, h, b = await _post(s, f"{base}/v1/chat/completions", _chat(SYSTEMS[i], "probe"))
            assert st == 200, b
            holders[i].add(h["x-kvcoord-node"])
            return h["x-kvcoord-prefix-aware"] == "true" and int(h["x-kvcoord-matched-blocks"]) >= 10

        await _until(known, f"the index to hold system prompt {i}")
    return holders


@pytest.mark.parametrize("own_tokenizer", [False, True])
async def test_placement_follows_the_cached_prefix_and_achieved_matches_predicted(
        fleet: RouteFleet, own_tokenizer: bool) -> None:
    """Through the coordinator's tokenizer (lookups by messages) and the router's own (by token ids)."""
    base = fleet.routes[1] if own_tokenizer else fleet.route
    async with aiohttp.ClientSession() as s:
        holders = await _routed_to_holder(s, base)
        before = await _metrics(s, base)
        results = []
        sem = asyncio.Semaphore(3)

        async def one(j: int) -> None:
            i = j % len(SYSTEMS)
            async with sem:
                st, h, b = await _post(s, f"{base}/v1/chat/completions",
                                       _chat(SYSTEMS[i], f"question {j} {own_tokenizer} please answer"))
            assert st == 200, b
            results.append((i, h, b))

        await asyncio.gather(*(one(j) for j in range(30)))
        after = await _metrics(s, base)
    for i, h, _ in results:
        assert h["x-kvcoord-node"] in holders[i], (h["x-kvcoord-reason"], holders)
        assert h["x-kvcoord-prefix-aware"] == "true"
        assert h["x-kvcoord-matched-blocks"] == h["x-kvcoord-best-blocks"]
        assert h["x-kvcoord-reason"].startswith("prefix-aware: ")
    pairs = [(int(h["x-kvcoord-predicted-cached-tokens"]),
              b["usage"]["prompt_tokens_details"]["cached_tokens"]) for _, h, b in results]
    assert sum(p == a for p, a in pairs) >= 0.95 * len(results), pairs
    assert all(int(h["x-kvcoord-predicted-cached-tokens"]) >= 10 * BLOCK for _, h, _ in results)
    match = 'kvcoord_route_hit_outcomes_total{outcome="match"}'
    assert after[match] - before[match] >= 0.95 * len(results)
    count = "kvcoord_route_predicted_hit_tokens_count"
    assert after[count] - before[count] == len(results)
    assert after["kvcoord_route_achieved_tokens_total"] > before["kvcoord_route_achieved_tokens_total"]
    assert after["kvcoord_route_degraded_mode"] == 0 and after["kvcoord_route_coordinator_up"] == 1


@pytest.mark.parametrize("client_usage", [False, True])
async def test_streams_arrive_chunk_by_chunk(fleet: RouteFleet, client_usage: bool) -> None:
    """Each token's chunk is its own read; the usage event reaches the client only if it asked, and the
    router measures the hit either way."""
    n = 25
    body = _chat(SYSTEMS[0], f"stream please {client_usage}", max_tokens=n, stream=True)
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as s:
        before = await _metrics(s, fleet.route)
        async with s.post(f"{fleet.route}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["x-kvcoord-prefix-aware"] == "true"
            events, reads = await _read_sse(resp)
        after = await _metrics(s, fleet.route)
    assert events[-1] is None
    texts = [ev for ev in events[:-1] if ev["choices"] and ev["choices"][0]["delta"].get("content")]
    assert len(texts) == n
    assert reads > n // 2, f"{reads} reads for {n} tokens: the stream was buffered"
    usage = [ev for ev in events[:-1] if ev.get("usage")]
    assert len(usage) == (1 if client_usage else 0)
    names = [f'kvcoord_route_hit_outcomes_total{{outcome="{o}"}}' for o in ("match", "above", "below")]
    known, known_before = sum(after[n] for n in names), sum(before[n] for n in names)
    assert known == known_before + 1


async def test_killing_an_engine_costs_only_its_streams(fleet: RouteFleet) -> None:
    """SIGKILL one engine while six streams run: its streams end with an SSE error event, the others keep
    streaming, and later requests avoid it."""
    async with aiohttp.ClientSession() as s:
        streams: list[tuple[str, list[Any], asyncio.Task[None]]] = []

        async def stream(resp: aiohttp.ClientResponse, events: list[Any]) -> None:
            async with resp:
                buf = b""
                async for piece in resp.content.iter_any():
                    buf += piece
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event[len(b"data: "):]
                        events.append(None if data == b"[DONE]" else json.loads(data))

        for i in range(6):
            body = {"model": MODEL, "prompt": f"long story number {i} " * 20, "max_tokens": 2000,
                    "stream": True}
            resp = await s.post(f"{fleet.route}/v1/completions", json=body)
            assert resp.status == 200
            events: list[Any] = []
            task = asyncio.create_task(stream(resp, events))
            streams.append((resp.headers["x-kvcoord-node"], events, task))
        victims = [n for n, _, _ in streams if n != TOKENIZER_NODE]
        assert victims, streams
        victim = victims[0]
        await _until(lambda: _true(all(events for _, events, _ in streams)), "every stream to generate")
        os.killpg(fleet.procs[victim].pid, signal.SIGKILL)
        for node, events, task in streams:
            if node == victim:
                await asyncio.wait_for(task, 30)
                assert events[-1] is None and "error" in events[-2], events[-3:]
                assert victim in events[-2]["error"]["message"]
        # The others are unharmed: still generating, no error.
        counts = [len(events) for node, events, _ in streams if node != victim]
        await _until(lambda: _true(all(len(events) > n + 2 for (_, events, _), n in
                                       zip([x for x in streams if x[0] != victim], counts, strict=True))),
                     "the other streams to keep generating")
        for node, events, task in streams:
            if node != victim:
                assert not task.done() and all(ev is not None and "error" not in ev for ev in events)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Later requests go elsewhere, and all succeed.
        for j in range(6):
            st, h, b = await _post(s, f"{fleet.route}/v1/completions",
                                   {"model": MODEL, "prompt": f"long story number {j} " * 20,
                                    "max_tokens": 2})
            assert st == 200, b
            assert h["x-kvcoord-node"] != victim
        m = await _metrics(s, fleet.route)
        assert m[f'kvcoord_route_backend_failures_total{{kind="midstream",node="{victim}"}}'] >= 1
        assert m[f'kvcoord_route_backend_suspect{{node="{victim}"}}'] == 1
        assert m['kvcoord_route_requests_total{endpoint="completions",outcome="midstream_failure"}'] >= 1


async def test_coordinator_outage_degrades_visibly_and_recovers(fleet: RouteFleet) -> None:
    async with aiohttp.ClientSession() as s:
        headers, down = await outage(s, fleet, SYSTEMS[1])
    for h in headers:
        reason = h["x-kvcoord-reason"]
        assert reason.startswith(("coordinator_unavailable; least-loaded: ", "deadline; ")), reason
    assert down['kvcoord_route_degraded_total{reason="coordinator_unavailable"}'] >= 3
    text = fleet.log("route")
    assert text.count("coordinator lookups failing") == 1 and text.count("answering again") == 1


# --- the command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--coordinator", "127.0.0.1:1", "--backend", "node-a"], "is not NODE=URL"),
    (["--coordinator", "127.0.0.1:1", "--backend", "node-a=ftp://x:1"], "is not an http(s)://HOST:PORT URL"),
    (["--coordinator", "127.0.0.1:1", "--listen", "nowhere"], "is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--backend", "a=http://h:1", "--backend", "a=http://h:2"],
     "given twice"),
    (["--backend", "a=http://h:1"], "--coordinator is required"),
    (["--coordinator", "127.0.0.1:1", "--deadline-ms", "0"], "must be > 0"),
    (["--coordinator", "127.0.0.1:1", "--tokenizer", "/nonexistent"], "not a directory"),
    (["--coordinator", "127.0.0.1:1", "--degraded", "sometimes"], "invalid choice: 'sometimes'"),
    (["--coordinator", "127.0.0.1:1", "--prefill-us-per-token", "0"], "must be > 0"),
    (["--coordinator", "127.0.0.1:1", "--max-running", "x"], "--max-running"),
    (["--coordinator", "127.0.0.1:1", "--work-weight", "0.5"], "must be >= 1"),
    (["--coordinator", "127.0.0.1:1", "--cache-threshold", "1.5"], "must be <= 1"),
    (["--coordinator", "127.0.0.1:1", "--cache-threshold", "half"], "is not a number"),
])
def test_cli_mistakes_are_one_line(args: list[str], message: str) -> None:
    out = subprocess.run(kvcoord_cmd("route", *args), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


async def test_degraded_flag_reaches_the_policy(fleet: RouteFleet, tmp_path: Path) -> None:
    """``--degraded`` and the cost model's flags reach the policy a running router places with (its /health
    reads the policy object); without them it has the policy's defaults."""
    port = free_port()
    cmd = kvcoord_cmd("route", "--coordinator", f"127.0.0.1:{fleet.gport}", "--listen", f"127.0.0.1:{port}",
                      "--model", MODEL, "--degraded", "ignore", "--prefill-us-per-token", "1",
                      "--decode-ms-per-token", "20", "--max-running", "8", "--mean-output-tokens", "100",
                      "--work-weight", "7.5", "--cache-threshold", "0.25")
    given = {"max_running": 8, "prefill_us_per_token": 1.0, "decode_ms_per_token": 20.0,
             "mean_output_tokens": 100.0, "work_weight": 7.5, "cache_threshold": 0.25}
    defaults = {"max_running": 32, "prefill_us_per_token": 50.0, "decode_ms_per_token": 15.0,
                "mean_output_tokens": 350.0, "work_weight": DEFAULT_WORK_WEIGHT,
                "cache_threshold": DEFAULT_CACHE_THRESHOLD}
    with running(cmd, log=tmp_path / "route-ignore.log"):
        await asyncio.to_thread(wait_for_port, port, "127.0.0.1", 30)
        async with aiohttp.ClientSession() as s:
            for base, want, latency in ((f"http://127.0.0.1:{port}", "ignore", given),
                                        (fleet.route, "discount", defaults)):
                async with s.get(f"{base}/health") as resp:
                    health = await resp.json()
                assert (health["policy"], health["degraded"]) == ("prefix-aware", want), health
                assert health["latency"] == pytest.approx(latency), health


def test_listen_port_in_use_is_one_line() -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    try:
        out = subprocess.run(kvcoord_cmd("route", "--coordinator", "127.0.0.1:1", "--listen",
                                         f"127.0.0.1:{held.getsockname()[1]}"),
                             capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on" in lines[0], out.stderr


# --- units ----------------------------------------------------------------------------------------------
def test_one_outage_rule_for_route_and_epp() -> None:
    """Every gRPC code is either an outage (the coordinator failed to answer) or a refusal of the request;
    route and epp both ask :func:`kvcoord.gateway.outage.is_outage`."""
    import grpc

    from kvcoord.gateway import picker, route_place
    from kvcoord.gateway.outage import REFUSAL_CODES, is_outage

    outages = {c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK and is_outage(c)}
    assert outages == {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL", "DATA_LOSS"}
    assert {c.name for c in grpc.StatusCode} - outages - {"OK"} == REFUSAL_CODES
    assert is_outage("UNAVAILABLE") and not is_outage("UNAUTHENTICATED") and is_outage("SOMETHING_NEW")
    assert route_place.is_outage is picker.is_outage is is_outage


async def test_route_keys_its_memories_on_the_coordinators_hashes_and_follows_an_approximate_node() -> None:
    """Route's plan carries the prompt's block hashes as the coordinator computed them (asked with
    ``want_block_hashes``, so no router-side tokenizer is needed), and with them the prefix-aware policy
    sends a conversation back to the node without KV events it sent it to before."""
    import grpc

    from kvcoord.coordinator.config import load_config
    from kvcoord.coordinator.server import CoordinatorServer
    from kvcoord.gateway.route_backends import Backends
    from kvcoord.gateway.route_metrics import RouteMetrics
    from kvcoord.gateway.route_place import Placer
    from kvcoord.hashing import HashProfile, block_hashes64
    from kvcoord.proto.v2 import kvcoord_pb2 as pb
    from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
    from kvcoord.router.client import AsyncCoordinatorClient
    from kvcoord.router.placement import LatencyModel
    from kvcoord.router.policy import PrefixAwarePolicy
    from tests.coordinator.test_coordinator_ingest import Agent, Coord

    ov = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "",
          "models": [f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0"]}
    server = CoordinatorServer(load_config(None, env={}, overrides=ov))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    coord = Coord(server, channel, pbg.CoordinatorStub(channel), None)  # type: ignore[arg-type]
    agents: dict[str, Agent] = {}
    try:
        for node, blind in (("events", False), ("blind", True)):
            a = agents[node] = Agent(coord, node, model=MODEL)
            await a.send(hello=pb.Hello(node_id=node, model=MODEL, dp_ranks=[0], epoch=1, next_seq=1,
                                        serving_url=f"http://{node}.invalid:8000", no_kv_events=blind))
            assert (await a.recv()).WhichOneof("msg") == "welcome"
            await a.snapshot(0)

        async def load(node: str, running: int) -> None:
            await agents[node].send(heartbeat=pb.AgentHeartbeat(load=pb.Load(running_requests=running)))

        async with AsyncCoordinatorClient(server.address) as client:
            now = [0.0]
            # One slot a node, one output token: each running request costs 15 ms of queue, less than
            # the 51 ms of prefill the prompt's 64 blocks save, so only a believed hit outweighs load.
            latency = LatencyModel(max_running=1, mean_output_tokens=1.0)
            placer = Placer(client, Backends(), PrefixAwarePolicy(seed=3, latency=latency), RouteMetrics(),
                            clock=lambda: now[0])
            prompt = list(range(1, 64 * BLOCK + 1))

            async def place_once() -> str:
                plan = await placer.plan(MODEL, {"model": MODEL, "prompt": prompt}, chat=False)
                assert plan.prefix_aware, plan.reason
                profile = HashProfile("sha256_cbor", BLOCK, seed="0")
                assert list(plan.request.block_hashes) == list(block_hashes64(profile, prompt))
                picked = placer.choose(plan)
                assert picked is not None
                return picked[0].node_id

            await load("events", 4)

            async def both_loaded() -> bool:
                nodes = {n.node_id: n.load.running_requests for n in (await client.stats()).nodes}
                return nodes == {"events": 4, "blind": 0}

            await until_async(both_loaded)
            assert await place_once() == "blind"
            # Later: the node with events is idle, blind busier; blind is believed to hold the prompt.
            await load("events", 0)
            await load("blind", 2)

            async def swapped() -> bool:
                nodes = {n.node_id: n.load.running_requests for n in (await client.stats()).nodes}
                return nodes == {"events": 0, "blind": 2}

            await until_async(swapped)
            now[0] = 5.0
            assert await place_once() == "blind"
            # Past the memory's 120 s the belief is gone: load decides.
            now[0] = 200.0
            assert await place_once() == "events"
    finally:
        for a in agents.values():
            await a.close()
        await channel.close()
        await server.stop()


async def until_async(cond: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_sse_relay_passes_whole_events_and_strips_only_the_usage_event() -> None:
    from kvcoord.gateway.route_sse import SseRelay

    r = SseRelay(strip_usage=True)
    assert r.feed(b'data: {"choices":[{"text":"a"}],"usage":null}\n\ndata: {"cho') == \
        b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
    usage = b'ices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
    assert r.feed(usage) == b""
    assert r.usage == {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}
    assert r.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and r.rest() == b""
    keep = SseRelay(strip_usage=False)
    ev = b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n'
    assert keep.feed(ev) == ev and keep.usage == {"prompt_tokens": 1}


async def test_connect_failures_and_5xx_retry_on_the_next_node(fleet: RouteFleet, tmp_path: Path) -> None:
    """Static backends only (no coordinator, round-robin): one refuses connections, one answers 500. Every
    request still succeeds on the healthy engine; both bad nodes are left out; /v1/models and /health say
    what is known; an engine's own 4xx passes through untouched."""
    from aiohttp import web

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    bad_port, ghost_port, rport = free_port(), free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", bad_port).start()
    good = fleet.engines[TOKENIZER_NODE]
    cmd = kvcoord_cmd("route", "--listen", f"127.0.0.1:{rport}", "--policy", "round-robin", "--model", MODEL,
                      "--backend", f"bad=http://127.0.0.1:{bad_port}",
                      "--backend", f"ghost=http://127.0.0.1:{ghost_port}", "--backend", f"good={good}")
    base = f"http://127.0.0.1:{rport}"
    try:
        with running(cmd, log=tmp_path / "route.log"):
            await asyncio.to_thread(wait_for_port, rport, "127.0.0.1", 30)
            async with aiohttp.ClientSession() as s:
                for j in range(4):
                    st, h, b = await _post(s, f"{base}/v1/chat/completions", _chat(SYSTEMS[2], f"retry {j}"))
                    assert st == 200, b
                    assert h["x-kvcoord-node"] == "good" and h["x-kvcoord-prefix-aware"] == "false"
                    assert h["x-kvcoord-reason"].startswith("round-robin: ")
                st, h, b = await _post(s, f"{base}/v1/completions", {"model": "other", "prompt": "x"})
                assert st == 404 and b["error"]["type"] == "NotFoundError" and h["x-kvcoord-node"] == "good"
                async with s.get(f"{base}/v1/models") as resp:
                    models = await resp.json()
                assert [m["id"] for m in models["data"]] == [MODEL]
                async with s.get(f"{base}/health") as resp:
                    health = await resp.json()
                assert set(health["suspect"]) == {"bad", "ghost"} and health["backends"]["good"] == good
                m = await _metrics(s, base)
        assert m['kvcoord_route_retries_total{reason="connect"}'] == 1
        assert m['kvcoord_route_retries_total{reason="status_5xx"}'] == 1
        assert m['kvcoord_route_backend_suspect{node="bad"}'] == 1
        assert m['kvcoord_route_backend_suspect{node="ghost"}'] == 1
        assert m['kvcoord_route_requests_total{endpoint="chat",outcome="ok"}'] == 4
        assert m['kvcoord_route_requests_total{endpoint="completions",outcome="upstream_error"}'] == 1
    finally:
        await runner.cleanup()


async def test_router_token_reaches_the_coordinator(fleet: RouteFleet, tmp_path: Path) -> None:
    """With a router token (``$KVCOORD_TOKEN``) lookups are answered: a static backend the coordinator
    does not know is placed prefix-aware; with a wrong token they are refused, visibly."""
    gport, good, bad = free_port(), free_port(), free_port()
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "",
                        "--router-token", "rtok",
                        "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0")
    engine = fleet.engines[TOKENIZER_NODE]

    def route(port: int) -> list[str]:
        return kvcoord_cmd("route", "--coordinator", f"127.0.0.1:{gport}", "--listen", f"127.0.0.1:{port}",
                           "--backend", f"static={engine}", "--deadline-ms", "2000")

    with contextlib.ExitStack() as stack:
        stack.enter_context(running(serve, log=tmp_path / "serve.log"))
        await asyncio.to_thread(wait_for_port, gport, "127.0.0.1", 30)
        stack.enter_context(running(route(good), env={"KVCOORD_TOKEN": "rtok"}, log=tmp_path / "good.log"))
        stack.enter_context(running(route(bad), env={"KVCOORD_TOKEN": "wrong"}, log=tmp_path / "bad.log"))
        for port in (good, bad):
            await asyncio.to_thread(wait_for_port, port, "127.0.0.1", 30)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}  # ids: this serve has no tokenizer
        async with aiohttp.ClientSession() as s:
            async def answered() -> bool:
                st, h, b = await _post(s, f"http://127.0.0.1:{good}/v1/completions", body)
                assert st == 200 and h["x-kvcoord-node"] == "static", b
                return h["x-kvcoord-prefix-aware"] == "true"

            await _until(answered, "a prefix-aware placement with the router token")
            st, h, b = await _post(s, f"http://127.0.0.1:{bad}/v1/completions", body)
            assert st == 200 and h["x-kvcoord-prefix-aware"] == "false", b
            assert h["x-kvcoord-reason"].startswith("lookup_error; least-loaded: "), h["x-kvcoord-reason"]
            m = await _metrics(s, f"http://127.0.0.1:{bad}")
    assert m['kvcoord_route_degraded_total{reason="lookup_error"}'] == 1
    assert m["kvcoord_route_degraded_mode"] == 0  # a refusal is not an outage
    assert "lookup refused (UNAUTHENTICATED" in (tmp_path / "bad.log").read_text()


async def test_a_coordinator_slower_than_the_deadline_degrades(fleet: RouteFleet, tmp_path: Path) -> None:
    """The coordinator's tokenizer (an engine /tokenize that never answers) makes every lookup by text
    outlast --deadline-ms: placement is least-loaded, with the header, the metric and one log line."""
    from aiohttp import web

    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/tokenize", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    tok_port, gport, rport = free_port(), free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", tok_port).start()
    spec = f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer=http://127.0.0.1:{tok_port}"
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "", "--model", spec)
    route = kvcoord_cmd("route", "--coordinator", f"127.0.0.1:{gport}", "--listen", f"127.0.0.1:{rport}",
                        "--backend", f"static={fleet.engines[TOKENIZER_NODE]}", "--deadline-ms", "300")
    base = f"http://127.0.0.1:{rport}"
    try:
        with running(serve, log=tmp_path / "serve.log"):
            await asyncio.to_thread(wait_for_port, gport, "127.0.0.1", 30)
            with running(route, log=tmp_path / "route.log"):
                await asyncio.to_thread(wait_for_port, rport, "127.0.0.1", 30)
                async with aiohttp.ClientSession() as s:
                    for j in range(2):
                        st, h, b = await _post(s, f"{base}/v1/chat/completions",
                                               _chat(SYSTEMS[0], f"slow {j}"))
                        assert st == 200 and h["x-kvcoord-node"] == "static", b
                        assert h["x-kvcoord-prefix-aware"] == "false"
                        reason = h["x-kvcoord-reason"]
                        assert reason.startswith("deadline; least-loaded: "), reason
                    m = await _metrics(s, base)
                assert m['kvcoord_route_degraded_total{reason="deadline"}'] == 2
                assert m["kvcoord_route_degraded_mode"] == 1
                assert (tmp_path / "route.log").read_text().count("coordinator lookups failing") == 1
    finally:
        never.set()
        await runner.cleanup()


async def test_a_placed_prompt_counts_as_queued_prefill_until_its_first_byte_or_the_model_says_done() -> None:
    """A non-streaming answer's first byte comes after decoding: the prompt is counted as queued prefill
    only as long as the cost model says the node needs for it (plus what was queued ahead), and a handle
    released twice (first byte, then the attempt's end) subtracts once."""
    from kvcoord.gateway.route_backends import Backends
    from kvcoord.load import NodeLoad

    b = Backends()
    key = ("n1", 0)
    first = b.begin(key, 1000)  # no model: until the first byte
    timed = b.begin(key, 500, 1e-4)  # 1000 ahead + 500 at 100 us/token: done after 0.15 s at the latest
    assert b.merged_load(key, NodeLoad()).prefill_tokens == 1500
    deadline = time.monotonic() + 30
    while b.merged_load(key, NodeLoad()).prefill_tokens != 1000:
        assert time.monotonic() < deadline, "the cost model's bound never released the prompt"
        await asyncio.sleep(0.05)
    timed.done()
    first.done()
    first.done()
    assert b.merged_load(key, NodeLoad()).prefill_tokens == 0
    b.begin(key, 10).done()
    assert b.work.pending(key) == 0


async def test_backends_merge_own_work_into_reported_load_and_keep_nodes_through_a_restart() -> None:
    from kvcoord.gateway.route_backends import Backends
    from kvcoord.load import NodeLoad
    from kvcoord.router.answer import Candidate

    b = Backends({"static": "http://10.0.0.9:8000/"})
    b.listed([("n1", "http://10.0.0.1:8000", MODEL, (0,), NodeLoad(1, 1)),
              ("n2", "http://10.0.0.2:8000", MODEL, (0,), NodeLoad())])
    queued = [b.begin(("n1", 0), 100) for _ in range(3)]
    load = b.merged_load(("n1", 0), NodeLoad(1, 1))
    assert (load.in_flight, load.waiting_requests, load.prefill_tokens) == (3, 1, 300)
    queued[0].done()
    b.end(("n1", 0))
    assert b.merged_load(("n1", 0), NodeLoad(4, 0)).in_flight == 4  # reported wins when higher
    assert b.merged_load(("n1", 0), NodeLoad()).prefill_tokens == 200
    # An answer naming a node without a URL drops it; a static backend it does not name is added.
    got = b.routable([Candidate("n1", 0, 5, (), NodeLoad(), "http://10.0.0.1:8000"), Candidate("x", 0, 9)])
    assert [(c.node_id, c.matched_blocks) for c in got] == [("n1", 5), ("static", 0)]
    assert got[1].serving_url == "http://10.0.0.9:8000"
    # A restarted coordinator lists nobody yet: fall back to every healthy node it ever listed.
    b.mark_failed("n2", "connect: refused")
    b.listed([])
    assert [c.node_id for c in b.fallback(MODEL)] == ["n1", "static"]
    assert b.mark_healthy("n2") and [c.node_id for c in b.fallback(MODEL)] == ["n1", "n2", "static"]
    assert [c.node_id for c in b.fallback("other-model")] == ["static"]
