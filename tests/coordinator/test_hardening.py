"""Hostile or buggy agents against a live coordinator (issue 15, items 2 and 3): streams that never say
Hello, too many streams, oversized batches and nodes, 100 KB or look-alike identities, and a dp rank past
uint32 on the wire. Each is refused with a precise status, counted, and the index is left as it was.

The coordinator runs for real: as ``kvcoord serve`` (flags, /metrics) or in-process over real gRPC.
Nothing waits on a timer: every wait polls for its condition with a generous deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.index.base import Index
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.validate import check_model, check_node_id, shown
from tests.coordinator.test_coordinator_ingest import MODEL, Agent, Coord, P, removed, serving, stored
from tests.http_util import get_text
from tests.procs import free_port, kvcoord_cmd, running, until_async, wait_for_port

DEADLINE = 30.0
"""Seconds any one wait may take: only a broken rule should get near it."""

BAD_NODE_IDS = ["seed-node\x00evil", "\x00seed-node", "seed-node ", "seed\u2010node", "\u202eedon-dees", "",
                "-node", "node-", "a" * 254, "n\n1", "n/1", "n@1"]
GOOD_NODE_IDS = ["n1", "node-a", "seed-node", "7", "gpu_01.pod.cluster.local", "10.0.0.1:8000", "a" * 253]
BAD_MODELS = ["", "m\x00", "m ", "\u202em", "Qwen\u2215Qwen3", "m" * 257, "a b"]
GOOD_MODELS = ["m", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "/models/llama", "name@group", "llama3:8b"]


async def eventually(check: Callable[[], Awaitable[Any]], what: str) -> Any:
    return await until_async(check, what, DEADLINE, interval=0.02)


async def status(call: Any) -> tuple[grpc.StatusCode, str]:
    """The stream's final status (reading past whatever it still sends)."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        while await asyncio.wait_for(call.read(), DEADLINE) is not grpc.aio.EOF:
            pass
    return await asyncio.wait_for(call.code(), DEADLINE), await call.details()


def hello(node: str = "n1", model: str = MODEL, ranks: tuple[int, ...] = (0,)) -> pb.AgentMessage:
    h = pb.Hello(node_id=node, model=model, dp_ranks=list(ranks), epoch=1, next_seq=1)
    return pb.AgentMessage(hello=h)


def scrape(port: int) -> str:
    return get_text(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE)


# --- streams: Hello timeout and max_streams, through `kvcoord serve`'s flags ----------------------------
async def test_silent_streams_are_closed_and_streams_are_capped(tmp_path: Path) -> None:
    port, mport = free_port(), free_port()
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                      "--hello-timeout-s", "0.5", "--max-streams", "2")
    with running(cmd, log=tmp_path / "serve.log"):
        wait_for_port(port)
        wait_for_port(mport)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.CoordinatorStub(ch)
            # Before: a stream that never sent Hello stayed open forever. Now it is closed.
            silent = stub.Ingest()
            code, details = await status(silent)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "hello_timeout_s" in details, details
            # Two streams are the cap; a third is refused at once, before it could say anything.
            a, b = stub.Ingest(), stub.Ingest()
            for call, node in ((a, "node-a"), (b, "node-b")):
                await call.write(hello(node))
                assert (await asyncio.wait_for(call.read(), DEADLINE)).WhichOneof("msg") == "welcome"

            async def both_open() -> bool:
                return 'kvcoord_ingest_streams 2.0' in scrape(mport)

            await eventually(both_open, "two open streams")
            third = stub.Ingest()
            code, details = await status(third)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams is 2" in details, details
            # A slot that frees up is usable again.
            a.cancel()

            async def admitted() -> bool:
                call = stub.Ingest()
                with contextlib.suppress(grpc.aio.AioRpcError):  # refused: the read below says so
                    await call.write(hello("node-c"))
                try:
                    msg = await asyncio.wait_for(call.read(), DEADLINE)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    return False
                call.cancel()
                return msg.WhichOneof("msg") == "welcome"

            await eventually(admitted, "a stream admitted once a slot is free")
            b.cancel()
        text = scrape(mport)
        assert 'kvcoord_ingest_streams_refused_total{reason="hello_timeout"}' in text
        refused = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("kvcoord_ingest_streams_refused_total")}
        assert refused['kvcoord_ingest_streams_refused_total{reason="max_streams"}'] >= 1
        assert refused['kvcoord_ingest_streams_refused_total{reason="hello_timeout"}'] >= 1
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


async def test_a_feed_refused_for_good_frees_its_stream_slot() -> None:
    """A registered engine whose feed the coordinator refuses for good (strict models, an unknown one)
    stops relaying and no longer counts as an ingest stream."""
    ov: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "",
                          "strict_models": True, "models": [f"{MODEL},algo=sha256_cbor,block_size=16,seed=0"]}
    server = CoordinatorServer(load_config(None, env={}, overrides=ov), index=MemoryIndex(),
                               relay_engines=True)
    await server.start()
    try:
        state, engines = server.state, server.engines
        assert state is not None and engines is not None
        await engines.register(7, "unknown-model", "default", 16, 0, f"tcp://127.0.0.1:{free_port()}", None)

        async def freed() -> bool:
            gauge = state.metrics.registry.get_sample_value("kvcoord_ingest_streams")
            return state.local_feeds == 0 and gauge == 0.0 and state.registry.get("7") is None

        await eventually(freed, "the refused feed's slot back")
    finally:
        await server.stop()


async def test_registered_engines_count_as_ingest_streams(tmp_path: Path) -> None:
    """An engine registered over HTTP is relayed in-process: it counts in the streams gauge and against
    max_streams (before, in-process feeds were invisible to both), and at most max_streams engines can be
    registered (429, one line; nothing registered)."""
    port, mport, hport = free_port(), free_port(), free_port()
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                      "--http-listen", f"127.0.0.1:{hport}", "--max-streams", "2")

    async def register(session: aiohttp.ClientSession, instance: int) -> tuple[int, Any]:
        body = {"instance_id": instance, "endpoint": f"tcp://127.0.0.1:{free_port()}", "model_name": MODEL,
                "block_size": 16}
        async with session.post(f"http://127.0.0.1:{hport}/register", json=body) as r:
            return r.status, await r.json(content_type=None)

    with running(cmd, log=tmp_path / "serve.log"):
        for p in (port, mport, hport):
            wait_for_port(p)
        async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert (await register(session, 1))[0] == 201

            async def streams(n: int) -> bool:
                return f"kvcoord_ingest_streams {n}.0" in scrape(mport)

            await eventually(lambda: streams(1), "the registered engine's feed in the gauge")
            stub = pbg.CoordinatorStub(ch)
            a = stub.Ingest()
            await a.write(hello("node-a"))
            assert (await asyncio.wait_for(a.read(), DEADLINE)).WhichOneof("msg") == "welcome"
            await eventually(lambda: streams(2), "both streams in the gauge")
            code, details = await status(stub.Ingest())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams is 2" in details, details
            assert (await register(session, 2))[0] == 201
            got, body = await register(session, 3)
            assert got == 429 and "max_streams is 2" in body["error"] and "\n" not in body["error"], body
            async with session.get(f"http://127.0.0.1:{hport}/workers") as r:
                assert sorted(w["instance_id"] for w in await r.json()) == [1, 2]
            a.cancel()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


# --- batch and node bounds ------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def coordinator(**overrides: Any) -> AsyncIterator[Coord]:
    async with serving(MemoryIndex(), **overrides) as c:
        yield c


async def entries(c: Coord) -> int:
    return int((await c.index.stats()).entries)


async def test_a_million_hashes_in_one_store_is_refused_and_changes_nothing(index: Index) -> None:
    async with serving(index) as c:  # the default max_hashes_per_batch (262144)
        agent = Agent(c, "node-a")
        await agent.start()
        assert (await agent.batch(1, [stored([1, 2, 3])])).ack.seq == 1
        before = await entries(c)
        # Before: accepted (max_events_per_batch counts events), adding 1M entries. Now refused whole.
        await agent.send(batch=pb.EventBatch(seq=2, events=[stored(range(10, 10 + 1_000_000))]))
        err = await agent.aborted()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "max_hashes_per_batch" in (err.details() or "") and "\n" not in (err.details() or "")
        assert await entries(c) == before == 3
        m = c.server.state.metrics
        assert m.rejected_by_reason["max_hashes_per_batch"] == 1
        # The node's entries miss that batch: it is out of lookups until its agent sends a snapshot.
        assert (await c.node("node-a")).state == "resyncing"
        again = Agent(c, "node-a")
        assert (await again.hello(next_seq=2)).snapshot_required
        await again.close()


async def test_entries_per_node_are_bounded_through_batches_and_snapshots(index: Index) -> None:
    async with serving(index, max_entries_per_node=10) as c:
        agent = Agent(c, "node-a")
        await agent.hello()
        await agent.snapshot(0, {0: [(h, 0) for h in range(1, 7)]})  # 6 entries
        assert (await agent.batch(1, [stored([7, 8, 9])])).ack.seq == 1  # 9
        assert (await agent.batch(2, [removed([1, 2, 3, 4])])).ack.seq == 2  # 5: removals free room
        assert (await agent.batch(3, [stored([11, 12, 13, 14, 15])])).ack.seq == 3  # 10: at the bound
        assert await entries(c) == 10
        await agent.send(batch=pb.EventBatch(seq=4, events=[stored([16])]))
        err = await agent.aborted()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_entries_per_node" in (err.details() or "")
        assert await entries(c) == 10
        assert c.server.state.metrics.rejected_by_reason["max_entries_per_node"] == 1
        # A snapshot past the bound is refused too, and the index keeps what it had.
        big = Agent(c, "node-a")
        await big.hello()
        await big.send(snapshot=pb.Snapshot(epoch=1, seq=0, block_hashes=P(range(100, 111)), final=True))
        err = await big.aborted()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_entries_per_node" in (err.details() or "")
        assert await entries(c) == 10


# --- untrusted strings in errors ------------------------------------------------------------------------
async def test_a_100kb_unknown_node_id_gets_not_found_with_a_short_message() -> None:
    huge = "n" * 100_000
    async with coordinator() as c:
        for rpc, req in ((c.stub.DrainNode, pb.DrainNodeRequest(node_id=huge)),
                         (c.stub.RemoveNode, pb.RemoveNodeRequest(node_id=huge))):
            # Before: the whole id came back in the trailer, and the client saw RESOURCE_EXHAUSTED.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc(req, timeout=DEADLINE)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
            details = info.value.details() or ""
            assert len(details) < 200 and "100000 chars" in details, details
        agent = Agent(c, huge)
        await agent.send(hello=hello(huge).hello)
        err = await agent.aborted()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details() or "") < 300


def test_shown_escapes_and_cuts() -> None:
    assert shown("seed-node\x00evil") == "'seed-node\\x00evil'"
    assert shown("\u202eedon-dees") == "'\\u202eedon-dees'"
    assert shown("x" * 1000) == f"'{'x' * 64}'... (1000 chars)"
    assert shown("m", quote=False) == "m"


# --- identities -----------------------------------------------------------------------------------------
def test_identity_rules() -> None:
    for node in GOOD_NODE_IDS:
        assert check_node_id(node) == node
    for model in GOOD_MODELS:
        assert check_model(model) == model
    for node in BAD_NODE_IDS:
        with pytest.raises(ValueError, match="not a valid node id"):
            check_node_id(node)
    for model in BAD_MODELS:
        with pytest.raises(ValueError, match="not a valid model name"):
            check_model(model)


async def test_confusable_node_ids_and_models_are_refused_on_hello() -> None:
    async with coordinator() as c:
        for node, model in [(n, MODEL) for n in BAD_NODE_IDS] + [("n1", m) for m in BAD_MODELS]:
            agent = Agent(c, node, model=model)
            await agent.send(hello=hello(node, model).hello)
            err = await agent.aborted()
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (node, model, err)
            assert "\n" not in (err.details() or "") and len(err.details() or "") < 300
        assert not (await c.stub.ListNodes(pb.ListNodesRequest(), timeout=DEADLINE)).nodes
        for i, node in enumerate(GOOD_NODE_IDS):
            agent = Agent(c, node, model=GOOD_MODELS[i % len(GOOD_MODELS)])
            await agent.start()
            await agent.close()
        listed = {n.node_id for n in (await c.stub.ListNodes(pb.ListNodesRequest(), timeout=DEADLINE)).nodes}
        assert listed == set(GOOD_NODE_IDS)


async def test_http_register_refuses_bad_model_names() -> None:
    ov = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "127.0.0.1:0",
          "models": [f"{MODEL},algo=sha256_cbor,block_size=4,seed=42"]}
    server = CoordinatorServer(load_config(None, env={}, overrides=ov), relay_engines=True)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.http_port}"
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with aiohttp.ClientSession() as s:
            for field, value in (("model_name", "m\x00evil"), ("model_name", "\u202em"),
                                 ("routing_group", "g r"), ("model_name", "x" * 100_000)):
                body = {"instance_id": 7, "model_name": MODEL, "block_size": 4, "endpoint": endpoint,
                        field: value}
                async with s.post(f"{base}/register", json=body) as resp:
                    got = await resp.json()
                    assert resp.status == 400, got
                    assert "not a valid model name" in got["error"] and len(got["error"]) < 300, got
            async with s.get(f"{base}/workers") as resp:
                assert not await resp.json()  # nothing registered
            ok = {"instance_id": 7, "model_name": "meta-llama/Llama-3.1-8B", "block_size": 4,
                  "endpoint": endpoint}
            async with s.post(f"{base}/register", json=ok) as resp:
                assert resp.status == 201, await resp.text()
    finally:
        await server.stop()


# --- out-of-range values on the wire --------------------------------------------------------------------
def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


async def test_a_dp_rank_past_uint32_is_refused_not_cut_to_rank_0() -> None:
    async with coordinator() as c:
        agent = Agent(c, "node-a")
        await agent.start()
        raw = c.channel.stream_stream("/kvcoord.v2.Coordinator/Ingest", request_serializer=bytes,
                                      response_deserializer=pb.CoordinatorMessage.FromString)
        event = stored([1, 2]).SerializeToString()
        rank = varint(3 << 3) + varint(1 << 32)  # EventBatch.dp_rank (field 3) = 2**32
        cases = {
            "EventBatch.dp_rank": field(2, varint(1 << 3) + varint(1) + rank + field(4, event)),
            "Snapshot.dp_rank": field(3, varint(1 << 3) + varint(1) + rank + varint(6 << 3) + varint(1)),
            "EventBatches.batches[0].dp_rank": field(5, field(1, varint(1 << 3) + varint(1) + rank
                                                              + field(4, event))),
        }
        for where, body in cases.items():
            # Before: protobuf kept the low 32 bits, and the batch was applied to rank 0.
            parsed = pb.AgentMessage.FromString(body)
            inner = getattr(parsed, parsed.WhichOneof("msg") or "")
            assert (inner.batches[0] if where.startswith("EventBatches") else inner).dp_rank == 0
            call = raw()
            await call.write(hello("node-r").SerializeToString())
            assert (await asyncio.wait_for(call.read(), DEADLINE)).WhichOneof("msg") == "welcome"
            await call.write(body)
            code, details = await status(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and f"{where} 4294967296" in details, details
        call = raw()
        await call.write(field(1, field(1, b"node-r") + field(2, MODEL.encode())
                               + field(3, varint(1 << 32))))  # Hello.dp_ranks, packed
        code, details = await status(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Hello.dp_ranks" in details, details
        assert await entries(c) == 0
        await agent.close()


def test_agent_cli_refuses_a_bad_node_id_in_one_line() -> None:
    for flag, value in (("--node-id", "seed-node "), ("--model", "m\u202e")):
        args = {"--node-id": "node-a", "--model": MODEL, flag: value}
        proc = subprocess.run(
            kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{free_port()}", "--node-id", args["--node-id"],
                        "--model", args["--model"], "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}"),
            capture_output=True, text=True, timeout=DEADLINE, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and f"{flag} " in proc.stderr, proc.stderr


def test_refusal_counters_exist_at_zero() -> None:
    """``increase()`` sees the first refusal only if the series existed before it (see metrics.py)."""
    from prometheus_client import generate_latest

    from kvcoord.coordinator.metrics import REJECT_REASONS, STREAM_REFUSALS, Metrics

    text = generate_latest(Metrics().registry).decode()
    for reason in STREAM_REFUSALS:
        assert f'kvcoord_ingest_streams_refused_total{{reason="{reason}"}} 0.0' in text
    for reason in ("max_hashes_per_batch", "max_entries_per_node"):
        assert reason in REJECT_REASONS
        assert f'kvcoord_events_rejected_total{{reason="{reason}",type="block_stored"}} 0.0' in text
