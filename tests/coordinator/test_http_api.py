"""The HTTP API (Dynamo's indexer API) on a live coordinator: engines registered over HTTP are relayed by
the coordinator itself, and lookups by tokens and hashes find them; every bad request gets a 4xx with a
one-line JSON error and leaves the index as it was."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import BlockRemoved, BlockStored, KVEventBatch
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.base import Index
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from tests.procs import free_port, kvcoord_cmd, until_async
from tests.tokenizers import build_tokenizer

MODEL = "m"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")
DEADLINE = 20.0


@dataclass
class Api:
    server: CoordinatorServer
    session: aiohttp.ClientSession
    base: str

    async def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"content-type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        async with self.session.request(method, self.base + path, data=data, headers=hdrs) as resp:
            text = await resp.read()
            return resp.status, (json.loads(text) if text else None)


@contextlib.asynccontextmanager
async def api(index: Index | None = None, **overrides: Any) -> AsyncIterator[Api]:
    ov: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "127.0.0.1:0",
                          "models": [f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"], **overrides}
    cfg = load_config(None, env={}, overrides=ov)
    server = CoordinatorServer(cfg, index=index, relay_engines=True)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(server, session, f"http://127.0.0.1:{server.http_port}")
    finally:
        await server.stop()


def chain(tokens: Sequence[int]) -> BlockStored:
    hashes = block_hashes64(PROFILE, tokens)
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None,
                       token_ids=tuple(tokens[: len(hashes) * BS]),  # full blocks only, as vLLM's
                       block_size=BS, lora_id=None, medium="GPU")


async def eventually(check: Any, what: str) -> Any:
    return await until_async(check, what, DEADLINE, interval=0.05)


async def test_registered_engine_is_relayed_and_found() -> None:
    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", bind=True)
    tokens = list(range(100, 116))  # 4 blocks
    try:
        # Published before registration: the relay replays it from the engine's buffer.
        pub.publish(KVEventBatch(ts=time.time(), events=[chain(tokens)]))
        async with api() as a:
            status, body = await a.call("POST", "/register", {
                "instance_id": 7, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "model_name": MODEL, "block_size": BS})
            assert (status, body) == (201, {"status": "ok"})

            async def hit() -> Any:
                st, b = await a.call("POST", "/query", {"token_ids": [*tokens, 1, 2], "model_name": MODEL})
                assert st == 200, b
                return b if b["scores"] else None

            answer = await eventually(hit, "the registered engine's blocks")
            assert answer["scores"] == {"7": {"0": 16}}
            assert answer["instances"] == {"7": {"longest_matched": 16, "gpu": 16, "dp": {"0": 16},
                                                 "cpu": 16, "disk": 16}}
            assert answer["frequencies"] == [] and answer["num_blocks"] == 4 and answer["num_tokens"] == 18
            assert answer["nodes"][0]["node_id"] == "7" and answer["nodes"][0]["matched_blocks"] == 4
            hashes = block_hashes64(PROFILE, tokens)
            st, by_hash = await a.call("POST", "/query_by_hash",
                                       {"block_hashes": hashes[:2], "model_name": MODEL})
            assert st == 200 and by_hash["scores"] == {"7": {"0": 8}}
            signed = [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]
            st, by_signed = await a.call("POST", "/query_by_hash",
                                         {"block_hashes": signed, "model_name": MODEL})
            assert st == 200 and by_signed["scores"] == {"7": {"0": 16}}

            st, workers = await a.call("GET", "/workers")
            assert st == 200 and len(workers) == 1
            w = workers[0]
            assert (w["instance_id"], w["source"], w["status"], w["model_name"], w["block_size"]) == (
                7, "zmq", "active", MODEL, BS)
            assert w["endpoints"] == {"0": f"tcp://127.0.0.1:{pub_port}"}

            pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=(hashes[2],))]))

            async def cut() -> Any:
                _, b = await a.call("POST", "/query", {"token_ids": tokens, "model_name": MODEL})
                return b["scores"] == {"7": {"0": 8}}

            await eventually(cut, "the removal")
            assert await a.call("POST", "/unregister", {"instance_id": 7, "model_name": MODEL}) == (
                200, {"status": "ok"})
            st, b = await a.call("POST", "/query", {"token_ids": tokens, "model_name": MODEL})
            assert st == 200 and b["scores"] == {}
            assert await a.call("GET", "/workers") == (200, [])
    finally:
        pub.shutdown()


def _lookup_by_bytes(port: int, raw: bytes, step: int) -> tuple[int, bytes]:
    """``raw`` written ``step`` bytes at a time on a new connection (each its own segment: no Nagle); the
    answer's status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(0, len(raw), step):
            sock.sendall(raw[i:i + step])
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += sock.recv(65536)
        return int(head.split()[1]), body


async def test_every_plain_lookup_takes_the_fast_path_however_it_is_written() -> None:
    """A lookup by tokens and by hashes, sent at once, as http.client sends it (head, then body), and byte
    by byte: the same answer each time, and the fast path answered each one (its counter says so)."""
    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", bind=True)
    tokens = list(range(200, 216))
    try:
        pub.publish(KVEventBatch(ts=time.time(), events=[chain(tokens)]))
        async with api() as a:
            status, _ = await a.call("POST", "/register", {
                "instance_id": 9, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "model_name": MODEL, "block_size": BS})
            assert status == 201

            async def hit() -> Any:
                _, answer = await a.call("POST", "/query", {"token_ids": tokens, "model_name": MODEL})
                return answer["scores"]

            await eventually(hit, "the registered engine's blocks")
            port = a.server.http_port
            metric = a.server.state.metrics.registry.get_sample_value
            bodies = {"/query": json.dumps({"token_ids": tokens, "model_name": MODEL}).encode(),
                      "/query_by_hash": json.dumps({"block_hashes": block_hashes64(PROFILE, tokens),
                                                    "model_name": MODEL}).encode()}

            def http_client(path: str) -> tuple[int, bytes]:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
                try:  # http.client writes the head and the body apart
                    conn.request("POST", path, bodies[path], {"content-type": "application/json"})
                    resp = conn.getresponse()
                    return resp.status, resp.read()
                finally:
                    conn.close()

            for path, body in bodies.items():
                raw = (f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                       f"content-length: {len(body)}\r\n\r\n").encode() + body
                answers = []
                sends: list[tuple[Any, ...]] = [(_lookup_by_bytes, port, raw, len(raw)), (http_client, path),
                                                (_lookup_by_bytes, port, raw, 1)]
                for send, *args in sends:
                    fast, handler = metric(*FAST), metric(*HANDLER)
                    answers.append(await asyncio.to_thread(send, *args))
                    assert (metric(*FAST), metric(*HANDLER)) == (fast + 1, handler), (path, len(answers))
                assert answers[0][0] == 200 and b'"9":{"0":16}' in answers[0][1]
                assert answers[0] == answers[1] == answers[2], path
    finally:
        pub.shutdown()


FAST = ("kvcoord_lookup_answers_total", {"path": "fast"})
HANDLER = ("kvcoord_lookup_answers_total", {"path": "handler"})


@pytest.mark.parametrize(("path", "body", "status", "error"), [
    ("/query", {"token_ids": [1], "model_name": "nope"}, 404,
     "no indexer for model=nope routing_group=default"),
    ("/query", {"token_ids": [-1], "model_name": MODEL}, 422, "Failed to deserialize"),
    ("/query", {"token_ids": [4294967296], "model_name": MODEL}, 422, "Failed to deserialize"),
    ("/query", {"token_ids": ["1"], "model_name": MODEL}, 422, "Failed to deserialize"),
    ("/query", {"token_ids": [1]}, 422, "model_name"),
    ("/query", {"model_name": MODEL}, 422, "token_ids"),
    ("/query_by_hash", {"block_hashes": [1], "model_name": MODEL, "cache_salt": "x"}, 400,
     "cache_salt is not accepted by /query_by_hash"),
    ("/query_by_hash", {"block_hashes": [1 << 64], "model_name": MODEL}, 422, "Failed to deserialize"),
    ("/query_by_hash", {"block_hashes": list(range(9000)), "model_name": MODEL}, 400, "max_query_blocks"),
    ("/register", {"instance_id": 1, "endpoint": "udp://127.0.0.1:1", "model_name": MODEL, "block_size": BS},
     400, "invalid ZMQ endpoint `udp://127.0.0.1:1`: unsupported scheme `udp`"),
    ("/register", {"instance_id": 1, "endpoint": "ipc:///tmp/x", "model_name": MODEL, "block_size": BS},
     400, "tcp:// endpoints only"),
    ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL, "block_size": 32},
     409, "block_size mismatch for model=m routing_group=default: existing=4, requested=32"),
    ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL}, 422,
     "block_size"),
    ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL, "block_size": BS,
                   "engine": "trtllm"}, 400, "invalid engine 'trtllm': expected one of vllm, sglang"),
    ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL, "block_size": BS,
                   "engine": "sglang"}, 409,
     "engine mismatch for model=m routing_group=default: existing=vllm (its hash profile is "
     "algo=sha256_cbor), requested=sglang"),
    ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": MODEL, "block_size": BS,
                   "engine": 1}, 422, "engine"),
    ("/unregister", {"instance_id": 4242, "model_name": MODEL}, 404, "instance 4242 not found"),
])
async def test_bad_requests_get_one_line_errors(path: str, body: Any, status: int, error: str) -> None:
    async with api() as a:
        before = await a.server.state.index.stats() if a.server.state else None
        st, answer = await a.call("POST", path, body)
        assert st == status and error in answer["error"] and "\n" not in answer["error"], answer
        assert await a.call("GET", "/workers") == (200, [])
        assert a.server.state is not None and await a.server.state.index.stats() == before


async def test_failed_lookups_are_counted_by_kind() -> None:
    """Every lookup answered with an error, over HTTP or gRPC, counts in kvcoord_lookup_errors_total{kind}."""
    async with api() as a:
        assert a.server.state is not None
        metric = a.server.state.metrics.registry.get_sample_value
        assert (await a.call("POST", "/query", {"token_ids": [1], "model_name": "nope"}))[0] == 404
        too_many = {"block_hashes": list(range(9000)), "model_name": MODEL}
        assert (await a.call("POST", "/query_by_hash", too_many))[0] == 400
        async with AsyncCoordinatorClient(f"127.0.0.1:{a.server.port}") as client:
            with pytest.raises(CoordinatorError):
                await client.lookup(MODEL, hashes=list(range(9000)))
        assert metric("kvcoord_lookup_errors_total", {"kind": "not_found"}) == 1
        assert metric("kvcoord_lookup_errors_total", {"kind": "invalid"}) == 2


async def test_http_protocol_errors() -> None:
    async with api() as a:
        assert (await a.call("POST", "/query", raw=b"not json"))[0] == 400
        assert (await a.call("POST", "/query", raw=b""))[0] == 400
        st, b = await a.call("POST", "/query", raw=b'{"token_ids":[1],"model_name":"m"}',
                             headers={"content-type": "text/plain"})
        assert st == 415 and "Content-Type: application/json" in b["error"]
        st, b = await a.call("POST", "/query", raw=b"[" + b"1," * (5 * 1024 * 1024) + b"1]")
        assert st == 413
        assert (await a.call("GET", "/nope"))[0] == 404
        async with a.session.get(a.base + "/query") as resp:
            assert resp.status == 405 and resp.headers["allow"] == "POST"
        async with a.session.post(a.base + "/health") as resp:
            assert resp.status == 405 and resp.headers["allow"] == "GET,HEAD"
        async with a.session.head(a.base + "/health") as resp:
            assert resp.status == 200
        assert await a.call("GET", "/health") == (200, None)


CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word, please."}]


async def test_lookups_by_prompt_and_chat_find_the_engine(tmp_path: Path) -> None:
    """Prompt text and chat messages, tokenized with the model's tokenizer directory exactly as
    ``transformers``' ``apply_chat_template`` does (then hashed), find the engine that cached those ids,
    over HTTP, gRPC and the command line; a model without a tokenizer is refused, naming it."""
    from transformers import AutoTokenizer

    tok_dir = build_tokenizer(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    prompt = "The quick brown fox jumps over the lazy dog, again and again and again."
    prompt_ids = hf(prompt, add_special_tokens=True)["input_ids"]
    chat_ids = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if not isinstance(chat_ids, list):  # transformers 5 returns an encoding
        chat_ids = chat_ids["input_ids"]
    assert len(prompt_ids) >= 2 * BS and len(chat_ids) >= 2 * BS
    pub_port = free_port()
    pub = ZmqEventPublisher(0, f"tcp://127.0.0.1:{pub_port}", None, bind=True)
    grpc_port = free_port()
    spec = f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42,tokenizer={tok_dir}"
    try:
        async with api(models=[spec, f"plain,algo=sha256_cbor,block_size={BS},seed=42"],
                       listen=f"127.0.0.1:{grpc_port}") as a:
            status, _ = await a.call("POST", "/register", {
                "instance_id": 3, "endpoint": f"tcp://127.0.0.1:{pub_port}", "model_name": MODEL,
                "block_size": BS})
            assert status == 201

            async def relayed() -> bool:  # the SUB joins asynchronously: publish until a block shows
                pub.publish(KVEventBatch(ts=time.time(), events=[chain(prompt_ids), chain(chat_ids)]))
                _, b = await a.call("POST", "/query", {"token_ids": prompt_ids, "model_name": MODEL})
                return bool(b["scores"])

            await eventually(relayed, "the engine's blocks")
            want = {"3": {"0": len(prompt_ids) // BS * BS}}
            st, b = await a.call("POST", "/query", {"prompt": prompt, "model_name": MODEL})
            assert st == 200 and b["scores"] == want and b["num_tokens"] == len(prompt_ids), b
            st, b = await a.call("POST", "/query", {"messages": CHAT, "model_name": MODEL})
            assert st == 200 and b["scores"] == {"3": {"0": len(chat_ids) // BS * BS}}, b
            st, b = await a.call("POST", "/query", {"prompt": prompt, "model_name": "plain"})
            assert st == 400 and "no tokenizer configured" in b["error"] and "'plain'" in b["error"]
            st, b = await a.call("POST", "/query", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "model_name": MODEL})
            assert st == 400 and MODEL in b["error"], b

            async with AsyncCoordinatorClient(f"127.0.0.1:{grpc_port}") as client:
                r = await client.lookup(MODEL, messages=CHAT, include_unmatched=True)
                assert (r.nodes[0].node_id, r.nodes[0].matched_blocks) == ("3", len(chat_ids) // BS)
                assert r.num_tokens == len(chat_ids)
                r = await client.lookup(MODEL, prompt=prompt)
                assert r.best is not None and r.best.matched_blocks == len(prompt_ids) // BS
            messages_file = tmp_path / "chat.json"
            messages_file.write_text(json.dumps({"messages": CHAT}))
            out = await asyncio.to_thread(subprocess.run, kvcoord_cmd(
                "lookup", "--coordinator", f"127.0.0.1:{grpc_port}", "--model", MODEL,
                "--messages-file", str(messages_file)), capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            answer = json.loads(out.stdout)
            assert answer["nodes"][0]["node_id"] == "3" and answer["num_tokens"] == len(chat_ids)
    finally:
        pub.shutdown()


def test_a_registrations_engine_is_kept_and_an_old_one_reads_as_vllm() -> None:
    """What the memory store's state file and the Redis hash keep: the engine, written only when not vLLM
    (so a registration stored before the field existed reads, and encodes, as it was)."""
    from kvcoord.coordinator.engines import Engine, Listener

    sgl = Engine(5, MODEL, "default", BS, (Listener(0, "tcp://127.0.0.1:5"),), kind="sglang")
    assert Engine.decode(sgl.encode()) == sgl and '"engine":"sglang"' in sgl.encode()
    old = Engine(6, MODEL, "default", BS, (Listener(0, "tcp://127.0.0.1:6"),))
    assert "engine" not in old.encode() and Engine.decode(old.encode()).kind == "vllm"
