"""kvcoord's HTTP API against the real thing: NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime``
1.6.1, ``python -m dynamo.indexer``, run as a subprocess). Both subscribe, through ``POST /register``, to the
same vLLM-exact ZMQ publishers (PUB + ROUTER replay, one of them with two DP ranks), get the same events
and the same HTTP requests, and must give the same answers: ``scores``, ``frequencies`` and ``instances``
field by field, ``/workers`` as an unordered set of Dynamo's fields, and for bad requests the same status
(and, for Dynamo's handler errors, the same ``error`` text).

The deliberate differences (``kvcoord/coordinator/httpapi.py``) are asserted where they show:

- ``/query_by_hash`` takes the engine's block hashes in kvcoord, Dynamo's block-local xxh3 hashes in Dynamo:
  each side is asked in its own hash language and must give the same answer; the other side's hashes
  match nothing (Dynamo) or are refused alike where invalid for both.
- kvcoord's errors are JSON (``{"error": ...}``); Dynamo's body-extractor errors are ``text/plain``.
- ``/register`` takes ``tcp://`` addresses to connect to only (``ipc``, ``inproc``, ``tcp://*:5``: 400).
- kvcoord adds answer fields (``model``, ``block_size``, ``num_blocks``, ``num_tokens``, ``nodes``;
  ``serving_url`` in ``/workers``).
- kvcoord answers ``/query`` by tokens only for a model with a hash profile.

Differences found here and kept (marked ``KNOWN``; each names where a fix belongs):

- a configured model is a partition in kvcoord (200) even while no engine of it is registered, where
  Dynamo has no indexer (404) (``tests/coordinator/test_http_api.py`` relies on kvcoord's answer);
- endpoint texts and a few endpoints Dynamo takes (``kvcoord/engine/zmq_wire.py``);
- event media (``kvcoord/events.py``, ``kvcoord/engine/relay.py``);
- after a middle block is removed and stored again, Dynamo no longer counts that worker's blocks below it
  (its tree dropped them); kvcoord counts what the engine holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xxhash

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import HashProfile, block_hashes64
from tests.procs import free_port, running, wait_for_port

pytest.importorskip("dynamo._core")  # a guard only: CI installs ai-dynamo-runtime (the ``test`` extra)

pytestmark = pytest.mark.timeout(120)

MODEL = "m"
GROUP = "g"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")
"""vLLM with PYTHONHASHSEED=42, ``--prefix-caching-hash-algo sha256_cbor``, block size 4."""
DEADLINE = 30.0
IO_TIMEOUT = 15.0
MIB = 1024 * 1024
RUN_INDEXER = "import sys; from dynamo._core import run_kv_indexer; run_kv_indexer(sys.argv[1:])"
"""``python -m dynamo.indexer``, without its wrapper's imports."""
U64_MAX = (1 << 64) - 1
DYNAMO_FIELDS = ("scores", "frequencies", "instances")
KVCOORD_EXTRAS = ("model", "block_size", "num_blocks", "num_tokens", "nodes")
WORKER_FIELDS = ("instance_id", "source", "status", "model_name", "routing_group", "block_size", "endpoints",
                 "listeners")
EMPTY: dict[str, Any] = {"scores": {}, "frequencies": [], "instances": {}}


# --- Dynamo's block-local hash (spec §5), for its /query_by_hash ---------------------------------------
def dynamo_hashes(tokens: Sequence[int], lora_name: str | None = None) -> list[int]:
    """Dynamo's ``LocalBlockHash`` of each full block (xxh3-64 of the little-endian u32 tokens, seed 1337
    plus xxh3(lora_name, 0)), as the i64 its ``/query_by_hash`` takes."""
    seed = 1337
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode(), 0)) & U64_MAX
    out = []
    for i in range(0, len(tokens) - BS + 1, BS):
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{BS}I", *tokens[i:i + BS]), seed)
        out.append(h - (1 << 64) if h >= 1 << 63 else h)
    return out


def signed(hashes: Iterable[int]) -> list[int]:
    return [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]


# --- a minimal HTTP/1.1 client: exact control of headers, bodies and Expect -------------------------------
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def __str__(self) -> str:
        ctype = self.headers.get("content-type", "-")
        return f"{self.status} [{ctype}] {self.body[:300]!r}"


async def _read_reply(reader: asyncio.StreamReader, method: str) -> Reply:
    line = await asyncio.wait_for(reader.readline(), IO_TIMEOUT)
    if not line:
        raise ConnectionError("connection closed without an answer")
    status = int(line.split()[1])
    headers: dict[str, str] = {}
    while True:
        raw = await asyncio.wait_for(reader.readline(), IO_TIMEOUT)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if status != 100:
        length = headers.get("content-length")
        # After HEAD, whatever comes before the close (nothing, if the server frames it right).
        read = reader.readexactly(int(length)) if length is not None and method != "HEAD" else reader.read()
        body = await asyncio.wait_for(read, IO_TIMEOUT)
    return Reply(status, headers, body)


async def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                  content_type: str | None = "application/json", expect_continue: bool = False) -> Reply:
    """One request on a fresh connection. With ``expect_continue`` the body is sent only after
    ``100 Continue`` (a server may answer 413 at once instead, as curl allows)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT)
    try:
        head = [f"{method} {path} HTTP/1.1", f"host: 127.0.0.1:{port}", "connection: close"]
        if data is not None:
            if content_type is not None:
                head.append(f"content-type: {content_type}")
            head.append(f"content-length: {len(data)}")
        if expect_continue:
            head.append("expect: 100-continue")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if data and not expect_continue:
            writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        reply = await _read_reply(reader, method)
        if reply.status == 100:
            assert data is not None
            writer.write(data)
            with contextlib.suppress(ConnectionError):  # an early answer and close is fine
                await writer.drain()
            reply = await _read_reply(reader, method)
        return reply
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


# --- the two services ----------------------------------------------------------------------------------
@dataclass
class Pair:
    dynamo: int
    kvcoord: int
    server: CoordinatorServer

    async def both(self, method: str, path: str, body: Any = None, *, kvcoord_body: Any = None,
                   **kw: Any) -> tuple[Reply, Reply]:
        """The same request to both (``kvcoord_body``: kvcoord's own version of the body)."""
        kb = body if kvcoord_body is None else kvcoord_body
        d, k = await asyncio.gather(request(self.dynamo, method, path, body, **kw),
                                    request(self.kvcoord, method, path, kb, **kw))
        return d, k

    async def register(self, **body: Any) -> None:
        d, k = await self.both("POST", "/register", body)
        assert (d.status, d.json()) == (201, {"status": "ok"}), f"Dynamo: {d}"
        assert (k.status, k.json()) == (201, {"status": "ok"}), f"kvcoord: {k}"

    async def unregister(self, **body: Any) -> None:
        d, k = await self.both("POST", "/unregister", body)
        assert (d.status, d.json()) == (200, {"status": "ok"}), f"Dynamo: {d}"
        assert (k.status, k.json()) == (200, {"status": "ok"}), f"kvcoord: {k}"


@contextlib.asynccontextmanager
async def services(tmp_path: Path) -> AsyncIterator[Pair]:
    """Dynamo's indexer (a subprocess, killed whatever happens) and a kvcoord coordinator in-process."""
    port = free_port()
    log = tmp_path / "dynamo-indexer.log"
    cmd = [sys.executable, "-c", RUN_INDEXER, "--port", str(port), "--threads", "1"]
    with running(cmd, log=log) as proc:
        overrides: dict[str, Any] = {
            "listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "127.0.0.1:0",
            "models": [f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42",
                       f"{MODEL}@{GROUP},algo=sha256_cbor,block_size={BS},seed=42"]}
        server = CoordinatorServer(load_config(None, env={}, overrides=overrides), relay_engines=True)
        await server.start()
        try:
            await asyncio.to_thread(wait_for_port, port, "127.0.0.1", DEADLINE)

            async def healthy() -> str | None:
                if proc.poll() is not None:
                    why = log.read_text()[-2000:]
                    raise AssertionError(f"Dynamo's indexer exited {proc.returncode}: {why}")
                reply = await request(port, "GET", "/health")
                return None if reply.status == 200 else str(reply)

            await converge(healthy, "Dynamo's indexer /health")
            assert server.http_port is not None
            yield Pair(port, server.http_port, server)
        finally:
            await server.stop()


class Engine:
    """One vLLM engine's DP rank: a ZMQ PUB + ROUTER replay publisher on free loopback ports."""

    def __init__(self, instance_id: int, dp_rank: int = 0) -> None:
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        pub, replay = free_port(), free_port()
        # vLLM adds the DP rank to the configured ports; configure them so the ranks land on free ones.
        self.pub = ZmqEventPublisher(dp_rank, f"tcp://127.0.0.1:{pub - dp_rank}",
                                     f"tcp://127.0.0.1:{replay - dp_rank}", bind=True)
        assert self.pub.endpoint == f"tcp://127.0.0.1:{pub}"

    @property
    def endpoint(self) -> str:
        assert self.pub.endpoint is not None
        return self.pub.endpoint

    def registration(self, **extra: Any) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "endpoint": self.pub.endpoint,
                "replay_endpoint": self.pub.replay_endpoint, "model_name": MODEL, "block_size": BS,
                "dp_rank": self.dp_rank, **extra}

    def publish(self, *events: KVEvent) -> None:
        self.pub.publish(KVEventBatch(ts=time.time(), events=events))


def stored(tokens: Sequence[int], *, prefix: Sequence[int] = (), medium: str = "GPU",
           lora_name: str | None = None) -> BlockStored:
    """A vLLM BlockStored of ``tokens``' full blocks continuing ``prefix`` (hashes chained over both, as
    the engine computes them, so the same content has the same hashes on every engine)."""
    keys = RequestKeys(lora_name=lora_name) if lora_name else None
    chain = block_hashes64(PROFILE, [*prefix, *tokens], keys)
    skip = len(prefix) // BS
    return BlockStored(block_hashes=tuple(chain[skip:]), parent_block_hash=chain[skip - 1] if skip else None,
                       token_ids=tuple(tokens[: (len(chain) - skip) * BS]),
                       block_size=BS, lora_id=1 if lora_name else None,
                       medium=medium, lora_name=lora_name)


def hashes(tokens: Sequence[int], lora_name: str | None = None) -> list[int]:
    keys = RequestKeys(lora_name=lora_name) if lora_name else None
    return [int(h) for h in block_hashes64(PROFILE, tokens, keys)]


def answer(*matches: tuple[int, int, int, int, int]) -> dict[str, Any]:
    """Dynamo's ScoreResponse for ``(instance, dp_rank, gpu_blocks, cpu_blocks, disk_blocks)`` matches (the
    lower tiers continuing the prefix): tokens; ``scores`` GPU only; ``cpu``/``disk`` cumulative."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for iid, rank, g, c, d in matches:
        gpu, cpu, disk = g * BS, (g + c) * BS, (g + c + d) * BS
        if gpu:
            scores.setdefault(str(iid), {})[str(rank)] = gpu
        inst = instances.setdefault(str(iid), {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
        inst["dp"][str(rank)] = gpu
        inst["gpu"], inst["cpu"] = max(inst["gpu"], gpu), max(inst["cpu"], cpu)
        inst["disk"] = max(inst["disk"], disk)
        inst["longest_matched"] = max(inst["gpu"], inst["cpu"], inst["disk"])
    return {"scores": scores, "frequencies": [], "instances": instances}


def worker(instance_id: int, endpoints: dict[int, str], *, group: str = "default") -> dict[str, Any]:
    """A /workers entry with every listener active (Dynamo's fields only)."""
    return {"instance_id": instance_id, "source": "zmq", "status": "active", "model_name": MODEL,
            "routing_group": group, "block_size": BS,
            "endpoints": {str(r): e for r, e in endpoints.items()},
            "listeners": {str(r): {"endpoint": e, "status": "active"} for r, e in endpoints.items()}}


def dynamo_view(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body.get(k) for k in DYNAMO_FIELDS}


NOT_ANSWERING = ("connecting", "unreachable")
"""Where Dynamo says ``active`` of any registration, kvcoord says whether the engine answers (deliberate)."""


def _as_dynamo(status: Any) -> Any:
    return "active" if status in NOT_ANSWERING else status


def _listener_view(x: Any) -> Any:
    if not isinstance(x, dict) or x.get("status") not in NOT_ANSWERING:
        return x
    return {k: "active" if k == "status" else v for k, v in x.items() if k != "last_error"}


def workers_view(body: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dynamo's fields, with kvcoord's ``connecting``/``unreachable`` read as Dynamo's ``active``."""
    out = []
    for w in body:
        view = {k: w.get(k) for k in WORKER_FIELDS}
        view["status"] = _as_dynamo(view["status"])
        if isinstance(view["listeners"], dict):
            view["listeners"] = {r: _listener_view(x) for r, x in view["listeners"].items()}
        out.append(view)
    return sorted(out, key=lambda w: w["instance_id"])


async def converge(check: Callable[[], Awaitable[str | None]], what: str,
                   nudge: Sequence[Engine] = ()) -> None:
    """Poll ``check`` (None: satisfied; else what is still wrong) until it holds or the deadline passes.
    Between polls every engine in ``nudge`` publishes an empty batch: a subscriber that joined after a
    batch went out sees the gap and replays it (Dynamo replays only on a gap), as vLLM's next step would."""
    deadline = time.monotonic() + DEADLINE
    nudged = time.monotonic()
    while True:
        why = await check()
        if why is None:
            return
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out waiting for {what}: {why}")
        if nudge and now - nudged > 0.3:
            for engine in nudge:
                engine.publish()
            nudged = now
        await asyncio.sleep(0.05)


# --- the differential scenario -------------------------------------------------------------------------
Match = tuple[int, int, int, int, int]
"""(instance_id, dp_rank, GPU blocks, CPU blocks continuing them, disk blocks continuing those)"""


@dataclass
class Query:
    """A lookup asked of both: the same ``/query`` body, or each side's hashes for ``/query_by_hash``."""

    name: str
    matches: tuple[Match, ...]
    tokens: list[int] = field(default_factory=list)
    lora_name: str | None = None
    group: str | None = None
    by_hash: bool = False
    dynamo: tuple[Match, ...] | None = None
    """Dynamo's answer where it differs from kvcoord's (and the engine's) on purpose: see where it is set."""

    @property
    def expected(self) -> dict[str, Any]:
        return answer(*self.matches)

    @property
    def dynamo_expected(self) -> dict[str, Any]:
        return answer(*(self.matches if self.dynamo is None else self.dynamo))

    def bodies(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        extra: dict[str, Any] = {"model_name": MODEL}
        if self.group is not None:
            extra["routing_group"] = self.group
        if not self.by_hash:
            body = {"token_ids": self.tokens, **extra}
            if self.lora_name is not None:
                body["lora_name"] = self.lora_name
            return "/query", body, body
        return ("/query_by_hash", {"block_hashes": dynamo_hashes(self.tokens, self.lora_name), **extra},
                {"block_hashes": hashes(self.tokens, self.lora_name), **extra})


async def agree(pair: Pair, queries: Sequence[Query], workers: list[dict[str, Any]],
                nudge: Sequence[Engine]) -> None:
    """Wait until both services give every query's expected answer and list exactly ``workers``."""

    async def check() -> str | None:
        wrong = []
        for q in queries:
            path, dbody, kbody = q.bodies()
            d, k = await pair.both("POST", path, dbody, kvcoord_body=kbody)
            if d.status != 200 or k.status != 200:
                wrong.append(f"{q.name}: Dynamo {d} / kvcoord {k}")
                continue
            dv, kv = dynamo_view(d.json()), dynamo_view(k.json())
            if dv != q.dynamo_expected or kv != q.expected:
                wrong.append(f"{q.name}:\n  Dynamo  {dv}\n   want   {q.dynamo_expected}\n"
                             f"  kvcoord {kv}\n   want   {q.expected}")
        d, k = await pair.both("GET", "/workers")
        dw, kw = workers_view(d.json()), workers_view(k.json())
        if dw != workers or kw != workers:
            wrong.append(f"/workers: expected {workers}\n  Dynamo  {dw}\n  kvcoord {kw}")
        return "\n".join(wrong) or None

    await converge(check, "both services to agree", nudge)
    # kvcoord's extras are there, and right.
    for q in queries:
        path, _, kbody = q.bodies()
        k = await request(pair.kvcoord, "POST", path, kbody)
        body = k.json()
        assert all(x in body for x in KVCOORD_EXTRAS), body
        assert body["block_size"] == BS and body["num_blocks"] == len(q.tokens) // BS, body
        assert body["num_tokens"] == (0 if q.by_hash else len(q.tokens)), body
        nodes = {(n["node_id"], n["dp_rank"]): (n["matched_blocks"], n["tiers"]) for n in body["nodes"]}
        assert nodes == {(str(i), r): (g + c + s, {"GPU": g, "CPU": c, "STORAGE": s})
                         for i, r, g, c, s in q.matches}, body
    k = await request(pair.kvcoord, "GET", "/workers")
    assert all("serving_url" in w for w in k.json()), k


async def dump_view(pair: Pair) -> tuple[dict[Any, int], dict[Any, int]]:
    """Blocks per (partition, worker, dp_rank, storage tier) in each side's ``/dump``."""

    def view(body: dict[str, Any]) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for part, content in body.items():
            for ev in content["events"]:
                key = (part, content["block_size"], ev["worker_id"], ev["event"]["dp_rank"],
                       ev["storage_tier"])
                out[key] = out.get(key, 0) + len(ev["event"]["data"]["stored"]["blocks"])
        return out

    d, k = await pair.both("GET", "/dump")
    assert d.status == k.status == 200, (d, k)
    return view(d.json()), view(k.json())


async def test_same_events_same_answers(tmp_path: Path) -> None:
    p = list(range(1000, 1016))  # 4 blocks
    c = list(range(2000, 2008))  # 2 blocks continuing p, on CPU
    dsk = list(range(2100, 2104))  # 1 block continuing p + c, on disk
    other = list(range(3000, 3012))  # 3 blocks
    lora = list(range(4000, 4008))  # 2 blocks under a LoRA adapter
    engines: list[Engine] = []
    try:
        w1 = Engine(1)
        engines.append(w1)
        w2 = [Engine(2, 0), Engine(2, 1)]  # one engine, two DP ranks: one instance, two listeners
        engines.extend(w2)
        w3 = Engine(U64_MAX)
        engines.append(w3)
        w4 = Engine(4)  # in another routing group
        engines.append(w4)
        async with services(tmp_path) as pair:
            # Published before anyone listens: both get it from the engine's replay buffer.
            w1.publish(stored(p))
            for e in (w1, *w2, w3):
                await pair.register(**e.registration())
            await pair.register(**w4.registration(routing_group=GROUP))
            w1.publish(stored(c, prefix=p, medium="CPU"), stored(dsk, prefix=[*p, *c], medium="DISK"),
                       stored(lora, lora_name="adA"))
            w2[0].publish(stored(p[:8]))
            w2[1].publish(stored(p))
            w3.publish(stored(other))
            w4.publish(stored(p[:4]))

            workers = [worker(1, {0: w1.endpoint}), worker(2, {0: w2[0].endpoint, 1: w2[1].endpoint}),
                       worker(4, {0: w4.endpoint}, group=GROUP), worker(U64_MAX, {0: w3.endpoint})]
            full = [*p, *c, *dsk, 9, 9, 9]
            pc, pc_hash, p7 = (Query("p+c", (), full), Query("p+c by hash", (), full[:28], by_hash=True),
                               Query("p[:7]", (), p[:7]))
            pc.matches = pc_hash.matches = ((1, 0, 4, 2, 1), (2, 0, 2, 0, 0), (2, 1, 4, 0, 0))
            p7.matches = ((1, 0, 1, 0, 0), (2, 0, 1, 0, 0), (2, 1, 1, 0, 0))
            lora_q = Query("lora", ((1, 0, 2, 0, 0),), lora, lora_name="adA")
            lora_hash = Query("lora by hash", ((1, 0, 2, 0, 0),), lora, lora_name="adA", by_hash=True)
            other_q = Query("other", ((U64_MAX, 0, 3, 0, 0),), other)
            other_hash = Query("other by hash", ((U64_MAX, 0, 3, 0, 0),), other, by_hash=True)
            queries = [
                pc, pc_hash, p7, other_q, other_hash, lora_q, lora_hash,
                Query("c alone (not from the root)", (), c),
                Query("lora tokens, no adapter", (), lora),
                Query("lora tokens, empty adapter name", (), lora, lora_name=""),
                Query("group g", ((4, 0, 1, 0, 0),), p, group=GROUP),
                Query("group g by hash", ((4, 0, 1, 0, 0),), p, group=GROUP, by_hash=True),
            ]
            await agree(pair, queries, workers, engines)

            # The other side's hashes: kvcoord's engine hashes match nothing in Dynamo (deliberate); kvcoord
            # takes both their forms (uint64, int64), and Dynamo's local hashes match nothing in kvcoord.
            engine_hashes = hashes(p)
            d = await request(pair.dynamo, "POST", "/query_by_hash",
                              {"block_hashes": signed(engine_hashes), "model_name": MODEL})
            assert (d.status, d.json()) == (200, EMPTY), d
            for form in (engine_hashes, signed(engine_hashes)):
                k = await request(pair.kvcoord, "POST", "/query_by_hash",
                                  {"block_hashes": form, "model_name": MODEL})
                assert dynamo_view(k.json()) == answer((1, 0, 4, 0, 0), (2, 0, 2, 0, 0), (2, 1, 4, 0, 0)), k
            k = await request(pair.kvcoord, "POST", "/query_by_hash",
                              {"block_hashes": dynamo_hashes(p), "model_name": MODEL})
            assert dynamo_view(k.json()) == EMPTY, k

            # /workers filters.
            default_group = [workers[0], workers[1], workers[3]]
            for query, expect in (("?model_name=m", workers), ("?routing_group=g", [workers[2]]),
                                  ("?model_name=m&routing_group=default", default_group),
                                  ("?model_name=zz", []), ("?model_name=", []),
                                  ("?tenant_id=x&foo=1", workers)):
                d, k = await pair.both("GET", "/workers" + query)
                assert d.status == k.status == 200, (query, d, k)
                assert workers_view(d.json()) == workers_view(k.json()) == expect, query

            # /dump: Dynamo's shape; blocks per worker, rank and tier agree (the hashes differ on purpose).
            dd, kd = await dump_view(pair)
            assert dd == kd, f"Dynamo {dd}\nkvcoord {kd}"

            # Evictions: a middle GPU block cuts the prefix there (the CPU blocks after it no longer count).
            w1.publish(BlockRemoved(block_hashes=(engine_hashes[1],), medium="GPU"))
            pc.matches = pc_hash.matches = ((1, 0, 1, 0, 0), (2, 0, 2, 0, 0), (2, 1, 4, 0, 0))
            await agree(pair, queries, workers, engines)
            # A CPU block goes, and the middle GPU block comes back: the engine holds blocks 0-3 and one CPU
            # block again, and kvcoord says so. Dynamo does not: its tree dropped the worker from the blocks
            # below the removed one, so it counts only the two blocks stored since (a Dynamo quirk, kept).
            cpu_hashes = hashes([*p, *c])[4:]
            w1.publish(BlockRemoved(block_hashes=(cpu_hashes[1],), medium="CPU"),
                       stored(p[4:8], prefix=p[:4]))
            pc.matches = pc_hash.matches = ((1, 0, 4, 1, 0), (2, 0, 2, 0, 0), (2, 1, 4, 0, 0))
            pc.dynamo = pc_hash.dynamo = ((1, 0, 2, 0, 0), (2, 0, 2, 0, 0), (2, 1, 4, 0, 0))
            await agree(pair, queries, workers, engines)

            # AllBlocksCleared from one DP rank.
            w2[1].publish(AllBlocksCleared())
            pc.matches = pc_hash.matches = ((1, 0, 4, 1, 0), (2, 0, 2, 0, 0))
            pc.dynamo = pc_hash.dynamo = ((1, 0, 2, 0, 0), (2, 0, 2, 0, 0))
            p7.matches = ((1, 0, 1, 0, 0), (2, 0, 1, 0, 0))
            await agree(pair, queries, workers, engines)

            # AllBlocksCleared from a whole engine: GPU, CPU and disk blocks go.
            w1.publish(AllBlocksCleared())
            pc.matches = pc_hash.matches = ((2, 0, 2, 0, 0),)
            pc.dynamo = pc_hash.dynamo = None
            p7.matches = ((2, 0, 1, 0, 0),)
            lora_q.matches = lora_hash.matches = ()
            await agree(pair, queries, workers, engines)

            # Unregister one DP rank (routing_group and dp_rank given): its blocks go, the other rank's stay.
            w2[1].publish(stored(p))
            pc.matches = pc_hash.matches = ((2, 0, 2, 0, 0), (2, 1, 4, 0, 0))
            p7.matches = ((2, 0, 1, 0, 0), (2, 1, 1, 0, 0))
            await agree(pair, queries, workers, engines)
            await pair.unregister(instance_id=2, model_name=MODEL, routing_group="default", dp_rank=0)
            workers[1] = worker(2, {1: w2[1].endpoint})
            pc.matches = pc_hash.matches = ((2, 1, 4, 0, 0),)
            p7.matches = ((2, 1, 1, 0, 0),)
            await agree(pair, queries, workers, engines)
            # Whole instances: without a routing_group (any group), with one, and dp_rank without a group.
            await pair.unregister(instance_id=U64_MAX, model_name=MODEL)
            del workers[3]
            other_q.matches = other_hash.matches = ()
            await agree(pair, queries, workers, engines)
            await pair.unregister(instance_id=4, model_name=MODEL, routing_group=GROUP)
            await pair.unregister(instance_id=2, model_name=MODEL, dp_rank=7)  # dp_rank is ignored here
            await pair.unregister(instance_id=1, model_name=MODEL)
            d, k = await pair.both("GET", "/workers")
            assert (d.status, d.json()) == (k.status, k.json()) == (200, [])

            # The partitions are gone in Dynamo (404); kvcoord's configured models still answer (KNOWN).
            for group in ("default", GROUP):
                body = {"token_ids": p, "model_name": MODEL, "routing_group": group}
                d, k = await pair.both("POST", "/query", body)
                gone = {"error": f"no indexer for model={MODEL} routing_group={group}"}
                assert (d.status, d.json()) == (404, gone), d
                assert k.status == 200 and dynamo_view(k.json()) == EMPTY, k

            # Registered again: the engine's whole buffer comes back (Dynamo replays from 0 on a gap).
            await pair.register(**w3.registration())
            await agree(pair, [Query("other again", ((U64_MAX, 0, 3, 0, 0),), other)],
                        [worker(U64_MAX, {0: w3.endpoint})], [w3])
    finally:
        for e in engines:
            e.pub.shutdown()


MEDIA: dict[str | None, tuple[str, ...]] = {
    # medium: the tier a block lands on in both (Dynamo's names), none if both drop it.
    None: ("gpu",), "": ("gpu",), "GPU": ("gpu",), "DEVICE": ("gpu",), "CPU": ("cpu",),
    "CPU_PINNED": ("cpu",), "CPU_TIER1": ("cpu",), "DISK": ("disk",), "STORAGE": ("disk",),
    "REMOTE": ("disk",), "CPU_TIER2": ("disk",), "NVME": ("disk",), "EXTERNAL": ("disk",),
    "NETWORK": ("disk",), "SHARED": ("disk",),
}
KNOWN_MEDIA: dict[str | None, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # Deliberate (kvcoord/events.py _MEDIUM_ALIASES): medium: (Dynamo's tier, kvcoord's). kvcoord takes
    # every name Dynamo takes, and also vLLM/SGLang spellings that Dynamo silently drops.
    "gpu": ((), ("gpu",)), "SSD": ((), ("disk",)), "HOST": ((), ("cpu",)), "HOST_PINNED": ((), ("cpu",)),
}


def tiers_of(instance: dict[str, Any] | None) -> tuple[str, ...]:
    if instance is None:
        return ()
    return next((t,) for t in ("gpu", "cpu", "disk") if instance[t])


async def test_media_map_to_the_same_tiers(tmp_path: Path) -> None:
    media = [*MEDIA, *KNOWN_MEDIA]
    engines: list[Engine] = []
    try:
        engines.extend(Engine(100 + i) for i in range(len(media)))
        async with services(tmp_path) as pair:
            for e in engines:
                await pair.register(**e.registration())
            for i, (e, medium) in enumerate(zip(engines, media, strict=True)):
                block = stored(list(range(10_000 + 100 * i, 10_004 + 100 * i)))
                e.publish(BlockStored(**{**msgspec.structs.asdict(block), "medium": medium}))
                e.publish(stored([8, 8, 8, 8]))  # then a GPU block: the medium's batch was handled
            marker = Query("marker", tuple((e.instance_id, 0, 1, 0, 0) for e in engines), [8, 8, 8, 8])
            await agree(pair, [marker], [worker(e.instance_id, {0: e.endpoint}) for e in engines], engines)
            wrong = []
            for i, medium in enumerate(media):
                body = {"token_ids": list(range(10_000 + 100 * i, 10_004 + 100 * i)), "model_name": MODEL}
                d, k = await pair.both("POST", "/query", body)
                got = (tiers_of(d.json()["instances"].get(str(100 + i))),
                       tiers_of(k.json()["instances"].get(str(100 + i))))
                want = KNOWN_MEDIA.get(medium) or (MEDIA[medium], MEDIA[medium])
                if got != want:
                    known = " (a KNOWN difference changed: update KNOWN_MEDIA)" * (medium in KNOWN_MEDIA)
                    wrong.append(f"medium {medium!r}: (Dynamo, kvcoord) tiers {got}, want {want}{known}")
            assert not wrong, "\n".join(wrong)
    finally:
        for e in engines:
            e.pub.shutdown()


# --- bad requests ----------------------------------------------------------------------------------------
@dataclass
class Row:
    """One request to both. ``kvcoord``: the status kvcoord answers where it differs on purpose or by a
    KNOWN difference (``note`` says which); ``same_text``: compare Dynamo's JSON error text exactly."""

    path: str
    body: Any = None
    raw: bytes | None = None
    method: str = "POST"
    content_type: str | None = "application/json"
    expect_continue: bool = False
    kvcoord: int | None = None
    same_text: bool = True
    note: str = ""
    undo: dict[str, Any] | None = None
    """An /unregister to send to Dynamo alone afterwards (it registered what kvcoord refused)."""


def reg(instance_id: Any = 1, endpoint: Any = "tcp://127.0.0.1:{port}", **kw: Any) -> dict[str, Any]:
    return {"instance_id": instance_id, "endpoint": endpoint, "model_name": MODEL, "block_size": BS, **kw}


def q(**kw: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3, 4], "model_name": MODEL, **kw}


def qbh(**kw: Any) -> dict[str, Any]:
    return {"block_hashes": [1, 2], "model_name": MODEL, **kw}


def padded(body: dict[str, Any], size: int) -> bytes:
    raw = json.dumps(body).encode()
    return raw + b" " * (size - len(raw))


def too_big(size: int) -> bytes:
    return b"[" + b"1," * ((size - 3) // 2) + b"1" + b" " * ((size - 3) % 2) + b"]"


ROWS: list[Row] = [
    # Routing and methods: empty bodies, Allow.
    Row("/nonexistent", method="GET"),
    Row("/health", method="POST"),
    Row("/health", method="DELETE"),
    Row("/query", method="GET"),
    Row("/query_by_hash", method="GET"),
    Row("/register", method="GET"),
    Row("/register", method="PUT"),
    Row("/unregister", method="GET"),
    Row("/workers", method="POST"),
    Row("/dump", method="POST"),
    Row("/workers/", method="GET"),
    Row("/health", method="HEAD"),
    Row("/workers", method="HEAD"),
    Row("/health?x=1", method="GET"),
    # Body syntax and content types, on every JSON route.
    *(Row(path, raw=b"not json") for path in ("/query", "/query_by_hash", "/register", "/unregister")),
    *(Row(path, raw=b"") for path in ("/query", "/query_by_hash", "/register", "/unregister")),
    *(Row(path, q(), content_type=None) for path in ("/query", "/query_by_hash", "/register", "/unregister")),
    Row("/query", q(), content_type="text/plain"),
    Row("/query", q(), content_type="application/json; charset=utf-8"),
    Row("/query", q(), content_type="application/vnd.foo+json"),
    Row("/query", raw=b'{"token_ids":[1,2,3,4],"model_name":"m"'),
    Row("/query", raw=b'{"token_ids":[1,2,3,4],"model_name":"m"} trailing'),
    Row("/query", raw=b'{"token_ids":[1,2,3,4],"model_name":"m"}}'),
    Row("/query", raw=b' {"token_ids":[1,2,3,4],"model_name":"m"} \n'),
    Row("/query", raw=b'{"token_ids":[1],"model_name":"m","model_name":"m"}'),
    Row("/query", raw=b'{"token_ids":[1],"token_ids":[2],"model_name":"m"}'),
    Row("/query", raw=b'{"token_ids":[1],"model_name":"m","foo":1,"foo":2}'),
    Row("/query_by_hash", raw=b'{"block_hashes":[1],"model_name":"m","routing_group":"a",'
                              b'"routing_group":"b"}'),
    Row("/register", raw=b'{"instance_id":1,"instance_id":1,"endpoint":"tcp://127.0.0.1:5","model_name":"m",'
                         b'"block_size":4}'),
    Row("/query", raw=b"null"),
    Row("/query", raw=b"[1,2]"),
    Row("/query", raw=b"5"),
    Row("/register", raw=b"[1,2]"),
    Row("/register", raw=b"null"),
    # /query: field types and ranges.
    Row("/query", q(token_ids=[-1])),
    Row("/query", q(token_ids=[4294967296])),
    Row("/query", q(token_ids=[4294967295, 0, 1, 2])),
    Row("/query", q(token_ids=[1.0])),
    Row("/query", q(token_ids=["1"])),
    Row("/query", q(token_ids=[True])),
    Row("/query", q(token_ids=[None])),
    Row("/query", q(token_ids=None)),
    Row("/query", q(token_ids={})),
    Row("/query", {"model_name": MODEL}),
    Row("/query", {"token_ids": [1]}),
    Row("/query", q(model_name=5)),
    Row("/query", q(model_name=None)),
    Row("/query", q(routing_group=None)),
    Row("/query", q(tenant_id=None)),
    Row("/query", q(lora_name=5)),
    Row("/query", q(lora_name=None, cache_salt=None)),
    Row("/query", q(tenant_id="other", foo=[1, {"x": 2}])),
    Row("/query", q(token_ids=[])),
    Row("/query", q(model_name="nope")),
    Row("/query", q(routing_group="other")),
    Row("/query", q(model_name="nope", routing_group="other")),
    # A model without a hash profile: kvcoord cannot hash token ids for it (deliberate), hashes it takes.
    Row("/register", reg(7, model_name="r")),
    Row("/query", q(model_name="r"), kvcoord=400, note="deliberate: no hash profile for r"),
    Row("/query", q(model_name="r", token_ids=[]), kvcoord=400, note="deliberate: even no tokens need it"),
    Row("/query_by_hash", qbh(model_name="r")),
    Row("/unregister", {"instance_id": 7, "model_name": "r"}),
    Row("/query_by_hash", qbh(model_name="r")),
    # /query_by_hash.
    Row("/query_by_hash", qbh()),
    Row("/query_by_hash", qbh(block_hashes=[])),
    Row("/query_by_hash", qbh(block_hashes=[-1, -(1 << 63), (1 << 63) - 1])),
    Row("/query_by_hash", qbh(block_hashes=[1 << 63]), kvcoord=200,
        note="deliberate: kvcoord takes uint64 engine hashes too"),
    Row("/query_by_hash", qbh(block_hashes=[U64_MAX]), kvcoord=200,
        note="deliberate: kvcoord takes uint64 engine hashes too"),
    Row("/query_by_hash", qbh(block_hashes=[1 << 64])),
    Row("/query_by_hash", qbh(block_hashes=[-(1 << 63) - 1])),
    Row("/query_by_hash", qbh(block_hashes=["1"])),
    Row("/query_by_hash", qbh(block_hashes=[1.5])),
    Row("/query_by_hash", qbh(block_hashes=[1.0])),
    Row("/query_by_hash", qbh(block_hashes=None)),
    Row("/query_by_hash", {"model_name": MODEL}),
    Row("/query_by_hash", {"block_hashes": [1]}),
    Row("/query_by_hash", {"modKl_name": "m1b", "block_hasXes": []}),  # issue 23: both say `block_hashes`
    Row("/query_by_hash", qbh(cache_salt="x")),
    Row("/query_by_hash", qbh(cache_salt="")),
    Row("/query_by_hash", qbh(cache_salt=None)),
    Row("/query_by_hash", qbh(cache_salt=5)),
    Row("/query_by_hash", qbh(model_name="nope", cache_salt="x")),
    Row("/query_by_hash", qbh(model_name="nope")),
    Row("/query_by_hash", qbh(routing_group="other")),
    Row("/query_by_hash", qbh(model_name="nope", block_hashes=[1 << 64])),
    # /register: conflicts (instance 1 dp 0 and instance 2 dp 0 are registered on model m, bs 4).
    Row("/register", reg()),
    Row("/register", reg(dp_rank=0)),
    Row("/register", reg(model_name="other")),
    Row("/register", reg(model_name="other", block_size=8, dp_rank=3)),
    Row("/register", reg(routing_group="other", dp_rank=3)),
    Row("/register", reg(block_size=8)),
    Row("/register", reg(block_size=8, dp_rank=5)),
    Row("/register", reg(3, block_size=8)),
    Row("/register", reg(3, block_size=0)),
    Row("/register", reg(3, endpoint="udp://127.0.0.1:1")),  # the endpoint is checked first
    Row("/register", reg(1, endpoint="udp://127.0.0.1:1")),
    # /register: endpoints.
    *(Row("/register", reg(3, endpoint=e)) for e in (
        "http://127.0.0.1:1", "127.0.0.1:18557", "", "tcp://", "tcp://127.0.0.1", "tcp://:5557", "tcp://::1:5",
        "tcp://127.0.0.1:99999", "tcp://127.0.0.1:abc", "tcp://127.0.0.1:-1", "TCP://127.0.0.1:5",
    )),
    Row("/register", reg(3, endpoint="ipc://"), same_text=False,
        note="deliberate: tcp:// only (kvcoord says so; Dynamo: `missing address`)"),
    Row("/register", reg(3, endpoint="tcp://127.0.0.1:"), same_text=False,
        note="KNOWN (kvcoord/engine/zmq_wire.py check_endpoint): kvcoord says `missing TCP port`, Dynamo "
             "`invalid TCP port: cannot parse integer from empty string`"),
    Row("/register", reg(3, endpoint="tcp://[::1]"), same_text=False,
        note="KNOWN (zmq_wire.check_endpoint): kvcoord `missing TCP port`, Dynamo `missing closing `]``"),
    Row("/register", reg(3, replay_endpoint="bogus")),
    Row("/register", reg(3, replay_endpoint="tcp://127.0.0.1")),
    Row("/register", reg(3, endpoint="bogus", replay_endpoint="bogus2")),
    Row("/register", reg(3, endpoint="tcp://*:5"), kvcoord=400, undo={"instance_id": 3, "model_name": MODEL},
        note="deliberate: not an address to connect to"),
    Row("/register", reg(3, endpoint="ipc:///tmp/kvcoord-dynamo-compat"), kvcoord=400,
        undo={"instance_id": 3, "model_name": MODEL}, note="deliberate: tcp:// only"),
    Row("/register", reg(3, endpoint="inproc://x"), kvcoord=400, undo={"instance_id": 3, "model_name": MODEL},
        note="deliberate: tcp:// only"),
    Row("/register", reg(3, endpoint="tcp://127.0.0.1:0"), kvcoord=400,
        undo={"instance_id": 3, "model_name": MODEL},
        note="KNOWN (zmq_wire.check_endpoint, like tcp://*:5): port 0 is not an address to connect to"),
    Row("/register", reg(3, endpoint="tcp://127.0.0.1:+5"), kvcoord=400,
        undo={"instance_id": 3, "model_name": MODEL},
        note="KNOWN (zmq_wire.check_endpoint): Rust's u16 parser takes a leading `+`"),
    Row("/register", reg(3, endpoint="tcp://[]:5"), kvcoord=400, undo={"instance_id": 3, "model_name": MODEL},
        note="KNOWN (zmq_wire.check_endpoint): Dynamo takes an empty bracketed host"),
    Row("/register", reg(3, endpoint="tcp://" + "a" * 300 + ":5"), kvcoord=400,
        undo={"instance_id": 3, "model_name": MODEL},
        note="deliberate (issue 23): a host is a DNS name of at most 253 characters or an IP address"),
    Row("/register", reg(3, endpoint="tcp://a..b:5"), kvcoord=400,
        undo={"instance_id": 3, "model_name": MODEL},
        note="deliberate (issue 23): a host is a DNS name or an IP address"),
    # /register: shapes.
    Row("/register", {"instance_id": 3, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL}),
    Row("/register", {"instance_id": 3, "endpoint": "tcp://127.0.0.1:5", "block_size": BS}),
    Row("/register", {"instance_id": 3, "model_name": MODEL, "block_size": BS}),
    Row("/register", {"endpoint": "tcp://127.0.0.1:5", "model_name": MODEL, "block_size": BS}),
    Row("/register", reg(3, block_size=4.0)),
    Row("/register", reg(3, block_size=-1)),
    Row("/register", reg(3, block_size=1 << 32)),
    Row("/register", reg("3")),
    Row("/register", reg(1 << 64)),
    Row("/register", reg(-1)),
    Row("/register", reg(3, routing_group=None)),
    Row("/register", reg(3, tenant_id=None)),
    Row("/register", reg(3, dp_rank=-1)),
    Row("/register", reg(3, dp_rank=1 << 32)),
    Row("/register", reg(3, endpoint=None)),
    Row("/register", reg(3, additionalsalt=5)),
    Row("/register", reg(3, replay_endpoint=5)),
    # /register: accepted extras (then removed again).
    Row("/register", reg(5, dp_rank=None, replay_endpoint=None, tenant_id="t", additional_salt="s", foo=1)),
    Row("/register", reg(5, dp_rank=1, additionalsalt="s", additional_salt=None)),
    Row("/unregister", {"instance_id": 5, "model_name": MODEL, "dp_rank": 1}),  # no group: the whole instance
    Row("/unregister", {"instance_id": 5, "model_name": MODEL}),
    # /unregister.
    Row("/unregister", {"instance_id": 4242, "model_name": MODEL}),
    Row("/unregister", {"instance_id": U64_MAX, "model_name": MODEL}),
    Row("/unregister", {"instance_id": 1, "model_name": MODEL, "routing_group": "default", "dp_rank": 7}),
    Row("/unregister", {"instance_id": 1, "model_name": MODEL, "routing_group": "other"}),
    Row("/unregister", {"instance_id": 1, "model_name": "other"}),
    Row("/unregister", {"instance_id": 1, "model_name": "other", "routing_group": "default"}),
    Row("/unregister", {"model_name": MODEL}),
    Row("/unregister", {"instance_id": 1}),
    Row("/unregister", {"instance_id": 1 << 64, "model_name": MODEL}),
    Row("/unregister", {"instance_id": "1", "model_name": MODEL}),
    Row("/unregister", {"instance_id": 1, "model_name": MODEL, "dp_rank": -1}),
    Row("/unregister", {"instance_id": 1, "model_name": MODEL, "routing_group": 5}),
    # /workers query strings.
    Row("/workers?model_name=m&model_name=m", method="GET"),
    Row("/workers?routing_group=a&routing_group=b", method="GET"),
    Row("/workers?tenant_id=a&tenant_id=b", method="GET"),
    Row("/workers?foo=1&foo=2", method="GET"),
    Row("/workers?model_name", method="GET"),
    Row("/workers?&&", method="GET"),
    Row("/workers?model_name=a%20b", method="GET"),
    # Body limits: 8 MiB on the query routes, 2 MiB elsewhere (Expect: 100-continue, as curl sends it).
    Row("/query", raw=too_big(8 * MIB + 1), expect_continue=True),
    Row("/query_by_hash", raw=too_big(8 * MIB + 1), expect_continue=True),
    Row("/query", raw=too_big(8 * MIB + 1)),
    Row("/query_by_hash", raw=padded(qbh(), 8 * MIB), expect_continue=True),
    Row("/query", raw=padded(q(), 8 * MIB)),
    Row("/register", raw=too_big(2 * MIB + 1), expect_continue=True),
    Row("/unregister", raw=too_big(2 * MIB + 1), expect_continue=True),
    Row("/register", raw=too_big(2 * MIB + 1)),
    Row("/unregister", raw=padded({"instance_id": 4242, "model_name": MODEL}, 2 * MIB), expect_continue=True),
    Row("/nonexistent", raw=too_big(2 * MIB + 1), expect_continue=True),
    Row("/health", raw=too_big(2 * MIB + 1), expect_continue=True),
]


async def same_workers(pair: Pair, query: str = "") -> str | None:
    d, k = await pair.both("GET", "/workers" + query)
    if workers_view(d.json()) == workers_view(k.json()):
        return None
    return f"/workers{query} differ\n    Dynamo:  {d}\n    kvcoord: {k}"


def compare(row: Row, d: Reply, k: Reply) -> str | None:
    """What is wrong with kvcoord's answer, given Dynamo's; None if nothing."""
    want = d.status if row.kvcoord is None else row.kvcoord
    if row.kvcoord is not None and d.status == row.kvcoord:
        return f"Dynamo now answers {d.status} too: drop the deliberate/KNOWN marker ({row.note})"
    if k.status != want:
        return f"status {k.status}, want {want}"
    if row.kvcoord is not None:
        return None
    dtype = d.headers.get("content-type", "")
    if d.status in (404, 405) and not d.body:  # the router's own answers: empty, with Allow on 405
        if k.body or k.headers.get("allow") != d.headers.get("allow"):
            return f"want an empty body and allow={d.headers.get('allow')!r}"
        return None
    if row.method == "HEAD":
        return None if not k.body else "a HEAD answer with a body"
    if d.status == 200 and not d.body:  # /health
        return None if not k.body else "want an empty body"
    try:
        kj = k.json()
    except ValueError:
        return "not JSON"
    if k.headers.get("content-type") != "application/json":
        return f"content-type {k.headers.get('content-type')!r}"
    if d.status >= 400:
        if not (isinstance(kj, dict) and set(kj) == {"error"} and isinstance(kj["error"], str)
                and "\n" not in kj["error"]):
            return f"want a one-line {{'error': ...}}, got {kj}"
        if dtype.startswith("application/json"):  # a handler error: the text is Dynamo's, exactly
            if row.same_text and kj != d.json():
                return f"error text {kj['error']!r}, Dynamo {d.json()['error']!r}"
        elif not dtype.startswith("text/plain"):
            return f"Dynamo answered {dtype!r}: update this test"
        return None
    dj = d.json()
    if isinstance(dj, dict) and "scores" in dj:
        return None if dynamo_view(kj) == dj and all(x in kj for x in KVCOORD_EXTRAS) else f"{kj} vs {dj}"
    if isinstance(dj, list):  # /workers
        return None if workers_view(kj) == workers_view(dj) else f"{kj} vs {dj}"
    return None if kj == dj else f"{kj} vs {dj}"


async def test_bad_requests_get_dynamos_statuses(tmp_path: Path) -> None:
    idle = free_port()  # nothing listens there: both connect lazily and keep trying
    async with services(tmp_path) as pair:
        # A configured model without engines: kvcoord has the partition (its hash profile), Dynamo not yet.
        d, k = await pair.both("POST", "/query", q())
        assert (d.status, d.json()) == (404, {"error": "no indexer for model=m routing_group=default"})
        assert k.status == 200 and dynamo_view(k.json()) == EMPTY, k

        for iid in (1, 2):
            await pair.register(**reg(iid, endpoint=f"tcp://127.0.0.1:{idle}"))
        wrong = []
        for i, row in enumerate(ROWS):
            body = row.body
            if isinstance(body, dict) and isinstance(body.get("endpoint"), str):
                body = {**body, "endpoint": body["endpoint"].format(port=idle)}
            d, k = await pair.both(row.method, row.path, body, raw=row.raw, content_type=row.content_type,
                                   expect_continue=row.expect_continue)
            why = compare(row, d, k)
            if why is not None:
                shown = row.raw[:120] if row.raw is not None else body
                wrong.append(f"#{i} {row.method} {row.path} {shown!r}: {why}\n"
                             f"    Dynamo:  {d}\n    kvcoord: {k}")
            if row.undo is not None and d.status == 201:
                reply = await request(pair.dynamo, "POST", "/unregister", row.undo)
                assert reply.status == 200, reply
            # Neither side changed state where the other did not.
            try:
                await converge(functools.partial(same_workers, pair), "the same /workers")
            except AssertionError as exc:
                wrong.append(f"#{i} {row.method} {row.path}: {exc}")
                break
        assert not wrong, "kvcoord differs from Dynamo:\n" + "\n".join(wrong)

        # An engine kvcoord cannot relay (model "": kvcoord's index keys are never empty) is registered as
        # in Dynamo, shows as failed (KNOWN: Dynamo relays it), and neither stops the other engines' relays
        # nor breaks the next (un)registration.
        await pair.register(**reg(60, endpoint=f"tcp://127.0.0.1:{idle}", model_name="", block_size=0))

        async def unrelayable() -> str | None:
            d, k = await pair.both("GET", "/workers?model_name=")
            [dw], [kw] = d.json(), k.json()
            if dw["status"] == "active" and kw["status"] == "failed" and (
                "non-empty" in kw["listeners"]["0"].get("last_error", "")
            ):
                return None
            return f"Dynamo {d}, kvcoord {k}"

        await converge(unrelayable, "model '' active in Dynamo, failed in kvcoord")
        await pair.register(**reg(61, endpoint=f"tcp://127.0.0.1:{idle}"))
        await converge(functools.partial(same_workers, pair, "?model_name=m"), "the same /workers")
        d, k = await pair.both("GET", "/workers?model_name=m")
        assert {w["status"] for w in d.json()} == {"active"}, d
        # Nothing listens at idle: kvcoord never calls it active (deliberate).
        assert {w["status"] for w in k.json()} <= set(NOT_ANSWERING), k
        await pair.unregister(instance_id=60, model_name="")
        await pair.unregister(instance_id=61, model_name=MODEL)
        await converge(functools.partial(same_workers, pair), "the same /workers")
