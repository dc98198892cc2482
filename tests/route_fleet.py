"""A fleet for ``kvcoord route`` tests, as real processes: sim-engines (HTTP and KV events), their agents,
``kvcoord serve`` (tokenizing chats through one engine's /tokenize), and the routers a test starts.

    with route_fleet(tmp, ("node-a", "node-b")) as fleet:
        url = fleet.start_route("--seed", "7")
        ...

Every process is stopped when the ``with`` ends. The coordinator can be stopped and started again
(``stop(fleet.procs["serve"])``, :meth:`RouteFleet.start_serve`); its log is appended to, not replaced.
:func:`played_reservation` plays another router's ``Reserve`` stream against the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.router.answer import LookupResult
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.validate import pack_u64
from tests.http_util import flat, parse_samples
from tests.procs import (
    free_port,
    free_port_pair,
    kvcoord_cmd,
    running,
    spawn,
    stop,
    until_async,
    wait_for_port,
)

MODEL = "sim-model"
BLOCK = 8
PROFILE = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BLOCK))
"""The sim-engines' hash profile; the coordinator's ``--model`` spec says the same."""
ENGINE_DEFAULTS = ("--token-interval", "0.02", "--num-blocks", "4096")
ROUTE_DEFAULTS = ("--deadline-ms", "2000", "--refresh-interval", "0.5")


@dataclass
class RouteFleet:
    tmp: Path
    """Logs: ``<node>.log``, ``agent-<node>.log``, ``serve.log`` and each router's."""
    gport: int
    """The coordinator's gRPC port."""
    tokenizer: str
    """The node whose /tokenize the coordinator tokenizes with."""
    mport: int = 0
    """The coordinator's /metrics port (0: none)."""
    hport: int = 0
    """The coordinator's HTTP API port (0: its default listener)."""
    engines: dict[str, str] = field(default_factory=dict)
    """node -> the engine's URL."""
    pubs: dict[str, int] = field(default_factory=dict)
    """node -> the engine's ZMQ PUB port (its replay socket on the next one)."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """node -> its engine, ``agent-<node>`` -> its agent, and ``serve``."""
    routes: list[str] = field(default_factory=list)
    """The routers' URLs, in the order :meth:`start_route` started them."""
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def route(self) -> str:
        """The first router's URL."""
        return self.routes[0]

    @property
    def coordinator(self) -> str:
        return f"127.0.0.1:{self.gport}"

    @property
    def coordinator_http(self) -> str:
        """The coordinator's HTTP API URL (a fleet started with ``http=True``)."""
        assert self.hport, "route_fleet(..., http=True)"
        return f"http://127.0.0.1:{self.hport}"

    def serve_cmd(self) -> list[str]:
        spec = f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer={self.engines[self.tokenizer]}"
        metrics = f"127.0.0.1:{self.mport}" if self.mport else ""
        http = ("--http-listen", f"127.0.0.1:{self.hport}") if self.hport else ()
        return kvcoord_cmd("serve", "--listen", self.coordinator, "--metrics-listen", metrics,
                           "--model", spec, *http)

    def start_serve(self) -> None:
        """Start the coordinator (again), appending to serve.log; returns once it accepts."""
        with open(self.tmp / "serve.log", "ab") as log:  # the child keeps its own descriptor
            self.procs["serve"] = spawn(self.serve_cmd(), stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.gport, timeout=60)

    def route_cmd(self, port: int, *extra: str) -> list[str]:
        """``kvcoord route`` on ``port`` for MODEL, with ROUTE_DEFAULTS; ``extra`` comes last (a flag
        repeated there wins)."""
        return kvcoord_cmd("route", "--coordinator", self.coordinator, "--listen", f"127.0.0.1:{port}",
                           "--model", MODEL, *ROUTE_DEFAULTS, *extra)

    def start_route(self, *extra: str, log: str = "route") -> str:
        """A router (stopped with the fleet), logging to ``<log>.log``; its URL once it accepts."""
        port = free_port()
        self.stack.enter_context(running(self.route_cmd(port, *extra), log=self.tmp / f"{log}.log"))
        wait_for_port(port, timeout=60)
        self.routes.append(f"http://127.0.0.1:{port}")
        return self.routes[-1]

    def log(self, name: str) -> str:
        """The text of ``<name>.log``."""
        return (self.tmp / f"{name}.log").read_text()

    async def coordinator_metrics(self, s: aiohttp.ClientSession, *prefixes: str) -> dict[str, float]:
        """The coordinator's samples starting with one of ``prefixes`` (a fleet with ``metrics=True``)."""
        assert self.mport, "route_fleet(..., metrics=True)"
        return await scrape(s, f"http://127.0.0.1:{self.mport}/metrics", *prefixes)


def _engine_cmd(http: int, pub: int, extra: Sequence[str]) -> list[str]:
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                       "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
                       "--http-listen", f"127.0.0.1:{http}", "--rate", "0", "--requests", "0",
                       *ENGINE_DEFAULTS, *extra)


@contextlib.contextmanager
def route_fleet(tmp: Path, nodes: Sequence[str], *, tokenizer: str | None = None,
                engine_args: Sequence[str] = (), node_args: Mapping[str, Sequence[str]] | None = None,
                agent_args: Mapping[str, Sequence[str]] | None = None, agentless: Collection[str] = (),
                metrics: bool = False, http: bool = False) -> Iterator[RouteFleet]:
    """Engines for ``nodes`` (``engine_args`` after ENGINE_DEFAULTS, then ``node_args[node]``), the
    coordinator (tokenizing through ``tokenizer``, default the first node; /metrics with ``metrics``; its
    HTTP API on a port of its own with ``http``) and an agent per engine announcing its URL (with
    ``agent_args[node]``; none for the ``agentless`` nodes, which a test registers itself). No router:
    :meth:`RouteFleet.start_route`."""
    f = RouteFleet(tmp, free_port(), tokenizer or nodes[0], mport=free_port() if metrics else 0,
                   hport=free_port() if http else 0)
    with f.stack:
        for node in nodes:
            http, f.pubs[node] = free_port(), free_port_pair()
            f.engines[node] = f"http://127.0.0.1:{http}"
            cmd = _engine_cmd(http, f.pubs[node], [*engine_args, *(node_args or {}).get(node, ())])
            f.procs[node] = f.stack.enter_context(running(cmd, log=tmp / f"{node}.log"))
        for node in nodes:
            wait_for_port(int(f.engines[node].rsplit(":", 1)[1]), timeout=60)
        f.start_serve()
        f.stack.callback(lambda: stop(f.procs["serve"]))
        for node in (n for n in nodes if n not in agentless):
            pub = f.pubs[node]
            cmd = kvcoord_cmd("agent", "--coordinator", f.coordinator, "--node-id", node, "--model", MODEL,
                              "--zmq-endpoint", f"tcp://127.0.0.1:{pub}",
                              "--replay-endpoint", f"tcp://127.0.0.1:{pub + 1}",
                              "--serving-url", f.engines[node], *(agent_args or {}).get(node, ()))
            f.procs[f"agent-{node}"] = f.stack.enter_context(running(cmd, log=tmp / f"agent-{node}.log"))
        yield f


# --- playing another router ------------------------------------------------------------------------------
def played_tokens(first: int, blocks: int = 8) -> list[int]:
    """A prompt of ``blocks`` full blocks no engine has seen, by token ids (``first`` tells prompts apart)."""
    return [first + (i * 7919) % 30000 for i in range(BLOCK * blocks)]


@contextlib.asynccontextmanager
async def played_reservation(c: AsyncCoordinatorClient, tokens: list[int], *, router_id: str, node: str,
                             ttl: float) -> AsyncIterator[Sequence[int]]:
    """Another router's reservation of ``tokens``' blocks on ``node`` for ``ttl`` seconds (one request, its
    prefill ``len(tokens)``), played as a ``Reserve`` stream that stays open until the ``with`` ends (its
    end is not a release); yields the blocks' hashes."""
    hashes = (await c.lookup(MODEL, tokens=tokens, want_block_hashes=True)).block_hashes
    msg = pb.ReserveBatch(router_id=router_id)
    r = msg.ops.add(request_id="r1").reserve
    r.model, r.node_id, r.first_block = MODEL, node, 0
    r.block_hashes, r.prefill_tokens, r.ttl_seconds = pack_u64(hashes), len(tokens), ttl
    forever = asyncio.Event()

    async def batches() -> AsyncIterator[pb.ReserveBatch]:
        yield msg
        await forever.wait()

    call = c.reserve_stream(batches())
    try:
        yield hashes
    finally:
        forever.set()
        call.cancel()


def shows_played(answer: LookupResult, node: str, tokens: list[int]) -> bool:
    """``answer`` shows :func:`played_reservation`'s hold on ``node``: its blocks, a request, its prefill."""
    n = next(n for n in answer.nodes if n.node_id == node)
    return (n.reserved_blocks == len(tokens) // BLOCK and n.reserved.in_flight == 1
            and n.reserved.prefill_tokens == len(tokens))


# --- talking to a router ----------------------------------------------------------------------------------
def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    """A chat completion body for MODEL: a system prompt and one user turn, 2 tokens out."""
    return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": user}], "max_tokens": 2, **extra}


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
    """POST ``body``: the status, the headers and the JSON answer."""
    async with s.post(url, json=body) as resp:
        return resp.status, resp.headers, await resp.json(content_type=None)


async def scrape(s: aiohttp.ClientSession, url: str, *prefixes: str) -> dict[str, float]:
    """The Prometheus samples at ``url`` starting with one of ``prefixes``, by their exposition line's name
    and labels."""
    async with s.get(url) as resp:
        assert resp.status == 200, f"GET {url}: HTTP {resp.status}"
        return flat(parse_samples(await resp.text()), *prefixes)


async def route_metrics(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The router's ``kvcoord_route_*`` samples."""
    return await scrape(s, f"{base}/metrics", "kvcoord_route_")


async def outage(s: aiohttp.ClientSession, fleet: RouteFleet,
                 system: str) -> tuple[list[Any], dict[str, float]]:
    """Stop the coordinator: three chats (``system``) through the first router are placed without the
    index, the router says it is degraded and logs the failing lookups once; start it again: placement
    turns prefix-aware and the router says it is back. The chats' headers and the router's metrics while
    the coordinator was down."""
    url = f"{fleet.route}/v1/chat/completions"
    stop(fleet.procs["serve"])
    try:
        headers = []
        for j in range(3):
            st, h, b = await post(s, url, chat(system, f"while it is down {j}"))
            assert st == 200, b
            assert h["x-kvcoord-prefix-aware"] == "false", h
            headers.append(h)
        down = await route_metrics(s, fleet.route)
        assert down["kvcoord_route_degraded_mode"] == 1 and down["kvcoord_route_coordinator_up"] == 0
        assert fleet.log("route").count("coordinator lookups failing") == 1
    finally:
        fleet.start_serve()

    async def aware() -> bool:
        st, h, b = await post(s, url, chat(system, "after the restart"))
        assert st == 200, b
        return h["x-kvcoord-prefix-aware"] == "true"

    await until_async(aware, "prefix-aware placement after the coordinator restart", timeout=60)
    back = await route_metrics(s, fleet.route)
    assert back["kvcoord_route_degraded_mode"] == 0 and back["kvcoord_route_coordinator_up"] == 1
    return headers, down


async def sse_events(resp: aiohttp.ClientResponse, on_event: Callable[[Any], Awaitable[Any]]) -> int:
    """Feed each SSE ``data:`` payload (None for [DONE]) to ``on_event`` as it arrives; returns how many
    reads it took."""
    buf, reads = b"", 0
    async for piece in resp.content.iter_any():
        reads += 1
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            data = event[len(b"data: "):]
            await on_event(None if data == b"[DONE]" else json.loads(data))
    return reads


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[list[Any], int]:
    """Events (None for [DONE]) and how many reads they took."""
    events: list[Any] = []

    async def collect(event: Any) -> None:
        events.append(event)

    reads = await sse_events(resp, collect)
    return events, reads
