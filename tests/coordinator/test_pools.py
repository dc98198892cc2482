"""Shared pools and peer-pull hints over real processes (issue 26, items 2 and 3): ``kvcoord serve`` (memory
and Redis index) with ``[pools.lmcache-remote]``; a pool publisher (the Reporter library, ``pool:`` node id,
``pool_publisher`` in its Hello) feeding the pool; engine nodes reaching it by configuration (node-a) or by
their Hello (node-c), and one that does not (node-b).

Lookups (gRPC and HTTP) credit the pool to the reaching nodes only, as their own ``pool`` tier, past their
own runs (and following the pool where a node's own run stops); the publisher never appears; the policy
prefers the node the pool serves; a node whose peer holds a longer prefix gets a pull hint naming it, and
the policy passes it on when the pull costs less than prefill. Bad configuration and flags stop the command
with one line (exit 2); an unknown pool in a Hello is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockStored, Tier
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.media import normalize_medium
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.router.placement import LatencyModel
from kvcoord.router.policy import ApproximatePolicy, PrefixAwarePolicy, place
from tests.http_util import http_json, http_request, metrics, sample
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import redis_server

MODEL = "pool-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="7")
PROMPT = list(range(100, 100 + 12 * BS))
OTHER = list(range(900, 900 + 8 * BS))
THIRD = list(range(5000, 5000 + 8 * BS))
POOL = "lmcache-remote"
CONFIG = f"""\
[pools.{POOL}]
tier = "CPU"
nodes = ["node-a"]
"""


class Coordinator:
    def __init__(self, grpc: str, http: int, metrics: int) -> None:
        self.grpc, self.http, self.metrics = grpc, http, metrics

    def query(self, hashes: list[int]) -> dict[str, Any]:
        status, out = http_json("POST", f"http://127.0.0.1:{self.http}/query_by_hash",
                                {"model_name": MODEL, "block_hashes": hashes})
        assert status == 200, out
        return dict(out)

    def metric(self, name: str) -> float:
        return sample(metrics(f"http://127.0.0.1:{self.metrics}/metrics"), name)


@pytest.fixture(params=["memory", "redis"])
def coordinator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    config = tmp_path / "kvcoord.toml"
    config.write_text(CONFIG)
    with contextlib.ExitStack() as stack:
        index = "memory"
        if request.param == "redis":
            index = f"{stack.enter_context(redis_server()).url}?timeout=2"
        grpc, http, metrics = free_port(), free_port(), free_port()
        stack.enter_context(running(kvcoord_cmd(
            "serve", "--config", str(config), "--listen", f"127.0.0.1:{grpc}", "--index", index,
            "--metrics-listen", f"127.0.0.1:{metrics}", "--http-listen", f"127.0.0.1:{http}",
            "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=7"), log=tmp_path / "serve.log"))
        wait_for_port(grpc)
        wait_for_port(http)
        wait_for_port(metrics)
        yield Coordinator(f"127.0.0.1:{grpc}", http, metrics)


def stored(hashes: list[int], parent: int | None = None, medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=BS,
                       medium=medium)


@contextlib.asynccontextmanager
async def reporter(addr: str, node_id: str, events: list[BlockStored], **kw: Any) -> AsyncIterator[Reporter]:
    held = {h: normalize_medium(e.medium) or Tier.GPU for e in events for h in e.block_hashes}
    rep = Reporter([addr], node_id=node_id, model=MODEL, epoch=int(time.time_ns()), hash_profile=PROFILE,
                   snapshot=lambda rank: sorted(held.items()), **kw)
    await rep.start()
    try:
        await rep.wait_connected(15)
        rep.submit(0, events)
        yield rep
    finally:
        await rep.close()


async def poll(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def view(res: Any) -> dict[str, tuple[int, tuple[int, ...], str]]:
    return {n.node_id: (n.matched_blocks, (*n.tier_counts(), n.pool_blocks()), n.pool) for n in res.nodes}


async def test_pool_credits_reaching_nodes_and_hints_peers(coordinator: Coordinator) -> None:
    addr = coordinator.grpc
    ph, oh, th = (block_hashes64(PROFILE, t) for t in (PROMPT, OTHER, THIRD))
    async with contextlib.AsyncExitStack() as stack:
        # The pool: PROMPT's first 10 blocks (from block 0) and THIRD's blocks 3..7 only (past node-a's run).
        await stack.enter_async_context(reporter(
            addr, f"pool:{POOL}", [stored(ph[:10], medium="cpu"), stored(th[3:], th[2])],
            pool_publisher=POOL))
        await stack.enter_async_context(reporter(
            addr, "node-a", [stored(ph[:3]), stored(oh[:2]), stored(th[:3])], serving_url="http://127.0.0.1:9001"))
        await stack.enter_async_context(reporter(
            addr, "node-b", [stored(ph[:6]), stored(oh[:6], medium="CPU")], serving_url="http://127.0.0.1:9002"))
        await stack.enter_async_context(reporter(addr, "node-c", [], pools=[POOL],
                                                 serving_url="http://127.0.0.1:9003"))
        await stack.enter_async_context(reporter(addr, "node-d", [], pools=["nowhere"]))
        client = AsyncCoordinatorClient(addr)
        stack.push_async_callback(client.close)

        want = {"node-a": (10, (3, 0, 0, 7), POOL), "node-c": (10, (0, 0, 0, 10), POOL),
                "node-b": (6, (6, 0, 0, 0), "")}

        async def settled() -> bool:
            return view(await client.lookup(MODEL, hashes=ph, include_unmatched=True)) == {
                **want, "node-d": (0, (0, 0, 0, 0), "")}

        await poll(settled, "the pool credited to node-a and node-c only")
        res = await client.lookup(MODEL, hashes=ph, include_unmatched=True)
        assert res.nodes[0].node_id == "node-a"  # 3 GPU + 7 pool blocks at CPU weight, over node-c's 10
        assert {n.pool_tier for n in res.nodes if n.pool} == {"CPU"}
        assert all(n.pull is None for n in res.nodes if n.node_id != "node-d")
        assert place(res).node_id == "node-a"  # the policy scores the pool's residency
        only_a = await client.lookup(MODEL, hashes=ph, candidates=[("node-a", 0)])
        assert view(only_a) == {"node-a": want["node-a"]}  # the pool expands within candidates too

        # Where node-a's own run stops, the pool continues it (blocks 3..7 of THIRD); node-c gets nothing.
        third = view(await client.lookup(MODEL, hashes=th))
        assert third == {"node-a": (8, (3, 0, 0, 5), POOL)}

        # OTHER: node-b holds 6 blocks (CPU), node-a 2: node-a's answer names node-b as the pull source.
        other = await client.lookup(MODEL, hashes=oh, include_unmatched=True)
        hints = {n.node_id: n.pull for n in other.nodes}
        assert hints["node-b"] is None
        for node in ("node-a", "node-c", "node-d"):
            hint = hints[node]
            assert hint is not None and (hint.node_id, hint.host_port, hint.tier, hint.blocks) == (
                "node-b", "127.0.0.1:9002", "CPU", 6), node
        a = next(n for n in other.nodes if n.node_id == "node-a")
        cheap = PrefixAwarePolicy(latency=LatencyModel(pull_s_per_block=1e-6))
        decision = place(type(other)(other.model, other.block_size, other.num_blocks, [a]), cheap)
        assert (decision.pull, decision.pull_blocks) == ("127.0.0.1:9002", 4)
        dear = PrefixAwarePolicy(latency=LatencyModel(pull_s_per_block=1.0))
        assert place(type(other)(other.model, other.block_size, other.num_blocks, [a]), dear).pull == ""
        # A router placing on its own memory names no pull, in its decision or its reason.
        guess = place(type(other)(other.model, other.block_size, other.num_blocks, [a]),
                      ApproximatePolicy(latency=LatencyModel(pull_s_per_block=1e-6)))
        assert (guess.pull, guess.pull_blocks) == ("", 0) and "pull" not in guess.why

        # The HTTP answer says the same (the general path answers while pools are known).
        http = {n["node_id"]: n for n in coordinator.query(ph)["nodes"]}
        assert set(http) == {"node-a", "node-b", "node-c"}
        assert http["node-a"]["tiers"] == {"GPU": 3, "CPU": 0, "STORAGE": 0, "POOL": 7}
        assert (http["node-a"]["pool"], http["node-a"]["pool_tier"]) == (POOL, "CPU")
        assert "pool" not in http["node-b"] and "POOL" not in http["node-b"]["tiers"]
        http_other = {n["node_id"]: n for n in coordinator.query(oh)["nodes"]}
        assert http_other["node-a"]["pull"] == {"node_id": "node-b", "host_port": "127.0.0.1:9002",
                                                "tier": "CPU", "blocks": 6}
        assert coordinator.metric("kvcoord_pool_unknown_announcements_total") >= 1.0  # node-d's "nowhere"


def _one_line_exit2(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, timeout=60)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(err.splitlines()) == 1 and what in err, err


@pytest.mark.parametrize(("config", "what"), [
    ('[pools.x]\ntier = "TAPE"\n', "pools.x.tier"),
    ('[pools.x]\nnodes = "node-a"\n', "pools.x.nodes"),
    ('[pools.x]\ncolour = 1\n', "unknown key 'colour'"),
    ('[pools."bad name"]\n', "not a valid pool name"),
])
def test_bad_pool_config_is_one_line(tmp_path: Path, config: str, what: str) -> None:
    path = tmp_path / "kvcoord.toml"
    path.write_text(config)
    _one_line_exit2(kvcoord_cmd("serve", "--config", str(path), "--listen", "127.0.0.1:0"), what)


@pytest.mark.parametrize(("flags", "what"), [
    (["--node-id", "pool:x"], "reserved for pool publishers"),
    (["--node-id", "n1", "--pool-publisher", "x"], "--node-id must be pool:x"),
    (["--node-id", "pool:x", "--pool-publisher", "x", "--pool", "y"], "reaches no pools"),
    (["--node-id", "n1", "--pool", "bad name"], "not a valid pool name"),
])
def test_bad_pool_flags_are_one_line(flags: list[str], what: str) -> None:
    _one_line_exit2(kvcoord_cmd("agent", "--coordinator", "127.0.0.1:1", "--model", MODEL,
                                "--no-kv-events", *flags), what)


@pytest.mark.slow
async def test_route_passes_a_worthwhile_pull_in_llm_ds_header(coordinator: Coordinator,
                                                               tmp_path: Path) -> None:
    """``kvcoord route --pull-us-per-block``: node-b holds the longer prefix but is busy, so node-a is
    chosen and told (llm-d's ``x-kv-cache-source-host-port``) to pull from node-b; an inbound value of the
    header never reaches the engine. Without the flag no header is set."""
    import aiohttp
    from aiohttp import web

    from kvcoord.load import NodeLoad
    from kvcoord.router.answer import KV_SOURCE_HEADER

    seen: dict[str, list[str | None]] = {"node-a": [], "node-b": []}
    oh = block_hashes64(PROFILE, OTHER)
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for node in seen:
            async def complete(request: web.Request, node: str = node) -> web.Response:
                seen[node].append(request.headers.get(KV_SOURCE_HEADER))
                return web.json_response({"id": "x", "object": "text_completion", "model": MODEL,
                                          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
            app = web.Application()
            app.router.add_post("/v1/completions", complete)
            runner = web.AppRunner(app)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            urls[node] = f"http://127.0.0.1:{port}"
        busy = NodeLoad(running_requests=60)
        await stack.enter_async_context(reporter(coordinator.grpc, "node-a", [stored(oh[:2])],
                                                 serving_url=urls["node-a"]))
        await stack.enter_async_context(reporter(coordinator.grpc, "node-b", [stored(oh[:6])],
                                                 serving_url=urls["node-b"], load=lambda: busy))
        client = AsyncCoordinatorClient(coordinator.grpc)
        stack.push_async_callback(client.close)

        async def indexed() -> bool:
            res = await client.lookup(MODEL, hashes=oh)
            return {n.node_id: (n.matched_blocks, n.load.running_requests) for n in res.nodes} == {
                "node-a": (2, 0), "node-b": (6, 60)}

        await poll(indexed, "both nodes indexed, node-b busy")
        body = {"model": MODEL, "prompt": OTHER, "max_tokens": 1}
        pulled = urls["node-b"].removeprefix("http://")
        for flags, want in (([], None), (["--pull-us-per-block", "1"], pulled)):
            port = free_port()
            cmd = kvcoord_cmd("route", "--coordinator", coordinator.grpc, "--listen", f"127.0.0.1:{port}",
                              "--model", MODEL, "--seed", "1", *flags)
            with running(cmd, log=tmp_path / f"route{port}.log"):
                await asyncio.to_thread(wait_for_port, port)
                async with aiohttp.ClientSession() as session, session.post(
                        f"http://127.0.0.1:{port}/v1/completions", json=body,
                        headers={KV_SOURCE_HEADER: "10.9.9.9:1"}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvcoord-node"] == "node-a", resp.headers["x-kvcoord-reason"]
                    assert resp.headers.get(KV_SOURCE_HEADER) == want
            assert seen["node-a"][-1] == want
        assert seen["node-b"] == []


def test_epp_sets_llm_ds_header_from_the_pick() -> None:
    from kvcoord.gateway.epp import _pick_headers
    from kvcoord.gateway.picker import Pick
    from kvcoord.router.answer import KV_SOURCE_HEADER

    assert _pick_headers(Pick(["10.0.0.1:8000"], "node-a", "why", True, 2, pull="10.0.0.2:8000"), False)[
        KV_SOURCE_HEADER] == "10.0.0.2:8000"
    assert KV_SOURCE_HEADER not in _pick_headers(Pick(["10.0.0.1:8000"], "node-a", "why", True, 2), False)


def test_register_takes_pools_and_refuses_bad_ones(coordinator: Coordinator) -> None:
    def register(instance: int = 7, **extra: Any) -> tuple[int, str]:
        body = {"instance_id": instance, "model_name": MODEL, "block_size": BS,
                "endpoint": f"tcp://127.0.0.1:{free_port()}", **extra}
        reply = http_request("POST", f"http://127.0.0.1:{coordinator.http}/register", body)
        return reply.status, reply.text

    assert register(pools=[POOL])[0] == 201
    status, text = register(pool_publisher=POOL, pools=[POOL])
    assert status == 400 and "reaches no pools" in text
    status, text = register(pools=["bad name"])
    assert status == 400 and "not a valid pool name" in text
    assert register(8, pool_publisher=POOL)[0] == 201


async def test_registered_sim_engines_feed_and_reach_a_pool(coordinator: Coordinator, tmp_path: Path) -> None:
    """Engines registered over HTTP (``kvcoord serve`` relays them): a sim-engine registered as the pool's
    publisher (``pool_publisher``) and one reaching the pool (``pools``). What the publisher caches counts
    for the other, as its ``pool`` tier; the publisher is in no answer."""
    import aiohttp

    engines = {}
    with contextlib.ExitStack() as procs:
        for name in ("publisher", "engine"):
            http, pub = free_port(), free_port_pair()
            procs.enter_context(running(kvcoord_cmd(
                "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, "--algo", "sha256_cbor",
                "--hash-seed", "7", "--block-size", str(BS), "--http-listen", f"127.0.0.1:{http}",
                "--rate", "0", "--requests", "0"), log=tmp_path / f"{name}.log"))
            await asyncio.to_thread(wait_for_port, http, "127.0.0.1", 30)
            engines[name] = (f"http://127.0.0.1:{http}", pub)
        async with aiohttp.ClientSession() as session:
            for instance, (name, extra) in enumerate((("publisher", {"pool_publisher": POOL}),
                                                      ("engine", {"pools": [POOL]})), start=11):
                url, pub = engines[name]
                body = {"instance_id": instance, "model_name": MODEL, "block_size": BS, "serving_url": url,
                        "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{pub + 1}",
                        **extra}
                async with session.post(f"http://127.0.0.1:{coordinator.http}/register", json=body) as resp:
                    assert resp.status == 201, await resp.text()
            async with session.post(f"{engines['publisher'][0]}/v1/completions",
                                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}) as resp:
                assert resp.status == 200, await resp.text()
            async with AsyncCoordinatorClient(coordinator.grpc) as client:
                async def pooled() -> bool:
                    res = await client.lookup(MODEL, tokens=PROMPT, include_unmatched=True)
                    got = {n.node_id: (n.matched_blocks, n.pool_blocks(), n.pool) for n in res.nodes}
                    return got == {"12": (12, 12, POOL)}

                await poll(pooled, "the publisher's blocks credited to the engine reaching the pool")


async def test_sim_engine_honours_a_pull_hint(tmp_path: Path) -> None:
    """``kvcoord sim-engine --pull-us-per-block``: a request naming a peer in llm-d's header is served with
    the blocks the peer holds copied first (its ``cached_tokens`` say so); a second identical request hits
    them locally; a peer that is not there costs nothing but the prefill."""
    import aiohttp

    from kvcoord.router.answer import KV_SOURCE_HEADER

    prompt = [*PROMPT, 1, 2, 3]  # 12 full blocks and a partial one
    engines = {}
    with contextlib.ExitStack() as procs:
        for name in ("peer", "puller"):
            http, pub = free_port(), free_port_pair()
            procs.enter_context(running(kvcoord_cmd(
                "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--model", MODEL, "--hash-seed", "7",
                "--block-size", str(BS), "--http-listen", f"127.0.0.1:{http}", "--rate", "0",
                "--requests", "0", "--pull-us-per-block", "10"), log=tmp_path / f"{name}.log"))
            await asyncio.to_thread(wait_for_port, http, "127.0.0.1", 30)
            engines[name] = f"127.0.0.1:{http}"

        async def cached(session: aiohttp.ClientSession, name: str, tokens: list[int], **headers: str) -> int:
            async with session.post(f"http://{engines[name]}/v1/completions", headers=headers,
                                    json={"model": MODEL, "prompt": tokens, "max_tokens": 1}) as resp:
                assert resp.status == 200, await resp.text()
                return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

        async with aiohttp.ClientSession() as session:
            assert await cached(session, "peer", prompt) == 0
            gone = f"127.0.0.1:{free_port()}"
            assert await cached(session, "puller", OTHER, **{KV_SOURCE_HEADER: gone}) == 0  # no peer there
            assert await cached(session, "puller", prompt, **{KV_SOURCE_HEADER: engines["peer"]}) == 12 * BS
            assert await cached(session, "puller", prompt) == 12 * BS
