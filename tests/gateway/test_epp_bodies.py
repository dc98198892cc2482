"""``kvcoord epp`` for the request bodies besides OpenAI's completions and chat, with the test playing
Envoy over real gRPC against a real ``kvcoord epp`` process, in front of test_epp's fleet (a real
``kvcoord serve``, two sim-engines publishing KV events, their agents):

- gRPC-bodied requests (``appProtocol: kubernetes.io/h2c`` pools, GIE proposal 2162): vLLM's and SGLang's
  ``Generate``, built with ``smg-grpc-proto``'s generated classes and framed as gRPC frames them, looked up
  exactly by their token ids;
- Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses``, placed by the chat vLLM renders for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import vllm_engine_pb2 as vll

from kvcoord.gateway.grpc_body import Generate, read_generate
from kvcoord.router.client import CoordinatorClient
from tests.gateway.test_epp import (
    BLOCK,
    DEADLINE,
    MODEL,
    ONE_FALLBACK,
    PROMPT_A,
    PROMPT_B,
    Envoy,
    _until,
    _why,
    assert_immediate,
    assert_passthrough,
    assert_pick,
    assert_streamed,
    channel,
    epp,
    epp_metrics,
    fleet,
    request_body,
    request_headers,
    set_headers,
)
from tests.gateway.test_epp_flow import _engine, respond
from tests.http_util import http_json
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

__all__ = ["fleet"]  # the module-scoped fixture, shared by name

VLLM = "/vllm.grpc.engine.VllmEngine/Generate"
SGLANG = "/sglang.grpc.scheduler.SglangScheduler/Generate"
GRPC = {"content-type": "application/grpc", "te": "trailers"}
PREDICTED = "kvcoord_epp_predicted_tokens_total"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def framed(msg: Any, compressed: bool = False, gzipped: bool = False) -> bytes:
    """One gRPC length-prefixed message, as a gRPC client writes it on the wire (``gzipped``: compressed
    as with ``grpc-encoding: gzip``; ``compressed``: the flag set, the bytes left as they are)."""
    data = msg.SerializeToString()
    if gzipped:
        data = gzip.compress(data)
    return struct.pack(">BI", int(compressed or gzipped), len(data)) + data


def tokens_of(engine: str, prompt: str) -> list[int]:
    """The prompt's token ids as the engine tokenizes a completion (vLLM's ``/tokenize``)."""
    status, answer = http_json("POST", f"http://{engine}/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200, answer
    return list(answer["tokens"])


def vllm_generate(ids: Sequence[int]) -> Any:
    return vll.GenerateRequest(request_id="r1", tokenized=vll.TokenizedInput(input_ids=ids), stream=True,
                               sampling_params=vll.SamplingParams(temperature=0.0, max_tokens=8))


def sglang_generate(ids: Sequence[int]) -> Any:
    return sgl.GenerateRequest(request_id="r2", tokenized=sgl.TokenizedInput(input_ids=ids), stream=False,
                               sampling_params=sgl.SamplingParams(temperature=0.0, max_new_tokens=8))


async def exchange(address: str, path: str, body: bytes, headers: dict[str, str]) -> Any:
    """A buffered request (headers, then the whole body); the answer to the body (or the refusal)."""
    async with channel(address) as ch:
        envoy = Envoy(ch)
        [first] = await envoy.send(request_headers(path, extra=headers))
        assert_passthrough(first, "request_headers")
        [second] = await envoy.send(request_body(body))
        await envoy.close()
        return second


def blocks_of(resp: Any) -> str:
    """The ``(N blocks)`` part of the pick's reason: what the chosen node holds of the prompt."""
    why = _why(resp)
    return why[why.index("(") + 1:why.index(" blocks)")]


def assert_grpc_refused(resp: Any, status: int, code: grpc.StatusCode, words: str,
                        details: str = "kvcoord_epp_bad_request") -> None:
    """An ImmediateResponse a gRPC client reads: the gRPC status, the message as ``grpc-message``."""
    assert resp.WhichOneof("response") == "immediate_response", resp
    imm = resp.immediate_response
    assert imm.status.code == status and imm.details == details
    assert imm.grpc_status.status == code.value[0]
    assert words in imm.body.decode(), imm.body
    assert "content-type" not in {o.header.key for o in imm.headers.set_headers}


async def test_grpc_generate_is_placed_by_its_token_ids(fleet: Any) -> None:
    """vLLM's and SGLang's Generate (buffered): the pick is the node holding the token ids' prefix, every
    full block of it matched (no tokenizer: the ids are the lookup); the model from the header, from
    --grpc-model, or the one model the coordinator lists."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    ids_a, ids_b = tokens_of(a, PROMPT_A), tokens_of(b, PROMPT_B)
    mport = free_port()
    with epp(fleet, *ONE_FALLBACK, "--metrics-listen", f"127.0.0.1:{mport}") as address:
        named = {**GRPC, "x-gateway-model-name": MODEL}
        for path, msg, order, ids in ((VLLM, vllm_generate(ids_a), [a, b], ids_a),
                                      (SGLANG, sglang_generate(ids_b), [b, a], ids_b),
                                      (VLLM, vllm_generate(ids_b + [7, 8, 9] * 9), [b, a], ids_b),
                                      (SGLANG, sglang_generate(ids_a + [5] * 20), [a, b], ids_a)):
            resp = await exchange(address, path, framed(msg), named)
            assert_pick(resp, "request_body", order)
            assert blocks_of(resp) == str(len(ids) // BLOCK), _why(resp)
        # No header: the one model the coordinator lists. vLLM's text input: the coordinator tokenizes it.
        text = vll.GenerateRequest(request_id="r3", text=PROMPT_B)
        resp = await exchange(address, VLLM, framed(text), GRPC)
        assert_pick(resp, "request_body", [b, a])
        assert blocks_of(resp) == str(len(ids_b) // BLOCK)
        # Another gRPC method: no prompt to look up, placed least-loaded and saying why.
        info = vll.GetModelInfoRequest()
        resp = await exchange(address, "/vllm.grpc.engine.VllmEngine/GetModelInfo", framed(info), GRPC)
        picked = set_headers(resp.request_body.response)["x-gateway-destination-endpoint"].split(",")
        assert sorted(picked) == sorted([a, b])
        assert_pick(resp, "request_body", picked, prefix_aware=False)
        assert "is not a Generate" in _why(resp)
        m = epp_metrics(mport)
        assert m['kvcoord_epp_requests_total{outcome="picked"}'] == 5
        assert m['kvcoord_epp_requests_total{outcome="degraded"}'] == 1
    with epp(fleet, "--grpc-model", MODEL, name="epp-grpc-model") as address:
        resp = await exchange(address, SGLANG, framed(sglang_generate(ids_a)), GRPC)
        assert_pick(resp, "request_body", [a])
        assert blocks_of(resp) == str(len(ids_a) // BLOCK)


async def test_grpc_generate_split_over_chunks_full_duplex(fleet: Any) -> None:
    """FULL_DUPLEX_STREAMED: the message arrives in three chunks; the pick comes with the chunk that
    completes it (a unary request needs no more), the body goes back unchanged, and the stream's last,
    empty chunk passes on after it."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    body = framed(vllm_generate(tokens_of(b, PROMPT_B)))
    with epp(fleet, *ONE_FALLBACK) as address:
        async with channel(address) as ch:
            envoy = Envoy(ch)
            headers = {**GRPC, "x-gateway-model-name": MODEL}
            await envoy.call.write(request_headers(VLLM, mode=FULL_DUPLEX, response_mode=FULL_DUPLEX,
                                                   extra=headers))
            await envoy.call.write(request_body(body[:3], end_of_stream=False))  # inside the frame header
            await envoy.call.write(request_body(body[3:40], end_of_stream=False))
            # Had the picker answered before the message was whole, that answer would come first here.
            pick, streamed = await envoy.send(request_body(body[40:], end_of_stream=False), answers=2)
            assert_pick(pick, "request_headers", [b, a])
            assert_streamed([streamed], body, end_of_stream=False)
            [last] = await envoy.send(request_body(b"", end_of_stream=True))
            assert_streamed([last], b"", end_of_stream=True)
            await envoy.close()


async def test_undecodable_grpc_bodies_get_400_as_bad_json_does(fleet: Any) -> None:
    """Compressed messages, bytes that are no GenerateRequest, a frame cut short, a body too short for a
    frame: the bad-request path of bad JSON (the counter, a one-line log), answered as a gRPC status; the
    picker goes on."""
    a = fleet.endpoints["node-a"]
    ids_a = tokens_of(a, PROMPT_A)
    good = framed(vllm_generate(ids_a))
    mport = free_port()
    cases = [(framed(vllm_generate(ids_a), compressed=True), "no grpc-encoding header says how"),
             (struct.pack(">BI", 0, 6) + b"\xff" * 6, "is not a vllm.grpc.engine.GenerateRequest"),
             (good[:-10], "cut short"), (b"\x00\x00", "holds no length-prefixed message"),
             (framed(vll.GenerateRequest(request_id="empty")), "neither token ids nor text")]
    with epp(fleet, "--metrics-listen", f"127.0.0.1:{mport}") as address:
        headers = {**GRPC, "x-gateway-model-name": MODEL}
        for body, words in cases[:4]:
            resp = await exchange(address, VLLM, body, headers)
            assert_grpc_refused(resp, 400, grpc.StatusCode.INVALID_ARGUMENT, words)
        resp = await exchange(address, VLLM, cases[4][0], headers)  # valid, but nothing to look up
        assert_pick(resp, "request_body", [set_headers(resp.request_body.response)[
            "x-gateway-destination-endpoint"]], prefix_aware=False)
        assert cases[4][1] in _why(resp)
        resp = await exchange(address, VLLM, good, headers)
        assert_pick(resp, "request_body", [a])
        m = epp_metrics(mport)
        assert m['kvcoord_epp_requests_total{outcome="bad_request"}'] == 4
    log = (fleet.tmp / "epp.log").read_text()
    assert log.count("answering 400 (bad_request): ") >= 4 and "Traceback" not in log


async def test_gzip_compressed_generate_is_decoded_within_a_bound(fleet: Any) -> None:
    """A message compressed as ``grpc-encoding: gzip`` is decompressed and placed as the plain one is,
    buffered and split over full-duplex chunks; one that decompresses to more than ``--max-body-bytes``
    gets 413 (RESOURCE_EXHAUSTED), another encoding or corrupt gzip 400, each counted, the picker going on."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    ids_b = tokens_of(b, PROMPT_B)
    body = framed(vllm_generate(ids_b), gzipped=True)
    gz = {**GRPC, "x-gateway-model-name": MODEL, "grpc-encoding": "gzip"}
    mport = free_port()
    with epp(fleet, *ONE_FALLBACK, "--max-body-bytes", "65536", "--metrics-listen", f"127.0.0.1:{mport}",
             name="epp-gzip") as address:
        ids_a = tokens_of(a, PROMPT_A)
        resp = await exchange(address, SGLANG, framed(sglang_generate(ids_a), gzipped=True), gz)
        assert_pick(resp, "request_body", [a, b])
        resp = await exchange(address, VLLM, body, gz)
        assert_pick(resp, "request_body", [b, a])
        assert blocks_of(resp) == str(len(ids_b) // BLOCK)
        async with channel(address) as ch:  # full duplex, the compressed message in two chunks
            envoy = Envoy(ch)
            await envoy.call.write(request_headers(VLLM, mode=FULL_DUPLEX, response_mode=FULL_DUPLEX,
                                                   extra=gz))
            await envoy.call.write(request_body(body[:7], end_of_stream=False))
            pick, streamed = await envoy.send(request_body(body[7:], end_of_stream=True), answers=2)
            assert_pick(pick, "request_headers", [b, a])
            assert_streamed([streamed], body, end_of_stream=True)  # passed on compressed, unchanged
            await envoy.close()
        # A bomb: 2 MB of token ids compress to a few kB, under the body limit; decompressed, over it.
        bomb = framed(vllm_generate([7] * (1 << 20)), gzipped=True)
        assert len(bomb) < 65536
        resp = await exchange(address, VLLM, bomb, gz)
        assert_grpc_refused(resp, 413, grpc.StatusCode.RESOURCE_EXHAUSTED, "decompresses to over 65536 bytes",
                            "kvcoord_epp_body_too_large")
        resp = await exchange(address, VLLM, body, {**gz, "grpc-encoding": "snappy"})
        assert_grpc_refused(resp, 400, grpc.StatusCode.INVALID_ARGUMENT, "decompresses gzip only")
        corrupt = struct.pack(">BI", 1, 20) + b"\x1f\x8b" + b"\x00" * 18
        resp = await exchange(address, VLLM, corrupt, gz)
        assert_grpc_refused(resp, 400, grpc.StatusCode.INVALID_ARGUMENT, "not valid gzip")
        resp = await exchange(address, VLLM, body, gz)
        assert_pick(resp, "request_body", [b, a])
        m = epp_metrics(mport)
        assert m['kvcoord_epp_requests_total{outcome="picked"}'] == 4
        assert m['kvcoord_epp_requests_total{outcome="bad_request"}'] == 2
        assert m['kvcoord_epp_requests_total{outcome="body_too_large"}'] == 1


DP_PORTS = (3000, 3002, 3004)


@pytest.fixture(scope="module")
def dp_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A coordinator and two pods' agents, each pod three data-parallel ranks (no KV events: picks among
    equals); yields the coordinator and the pods' IPs."""
    tmp = tmp_path_factory.mktemp("epp-dp")
    gport = free_port()
    ips = ["127.0.0.41", "127.0.0.42"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{gport}",
            "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0"),
            log=tmp / "serve.log"))
        wait_for_port(gport, timeout=30)
        for i, ip in enumerate(ips):
            stack.enter_context(running(kvcoord_cmd(
                "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", f"pod-{i}", "--model", MODEL,
                "--no-kv-events", "--dp-ranks", "0,1,2", "--serving-url", f"http://{ip}:3000"),
                log=tmp / f"agent-{i}.log"))
        with CoordinatorClient(f"127.0.0.1:{gport}") as client:
            _until(lambda: sum(len(n.dp_ranks) == 3 and n.state == "active"
                               for n in client.list_nodes()) == 2, "both pods with three ranks")
        yield f"127.0.0.1:{gport}", ips


async def test_grpc_generate_pinned_rank_goes_to_that_ranks_port(fleet: Any, dp_pool: Any) -> None:
    """With ``--target-ports`` (rank = port), a ``Generate`` pinning ``data_parallel_rank`` r is placed on
    a pod's r-th port, within the subset hint when there is one; a rank with no port is a 400."""
    coordinator, ips = dp_pool
    ports = ",".join(map(str, DP_PORTS))
    flags = ("--target-ports", ports, "--grpc-model", MODEL)
    with epp(fleet, *flags, coordinator=coordinator, name="epp-dp-rank") as address:
        for rank, port in enumerate(DP_PORTS):
            for path, msg in ((VLLM, vllm_generate(range(40))), (SGLANG, sglang_generate(range(40)))):
                msg.data_parallel_rank = rank
                for _ in range(4):
                    resp = await exchange(address, path, framed(msg, gzipped=rank == 1),
                                          {**GRPC, "grpc-encoding": "gzip"} if rank == 1 else GRPC)
                    endpoint = set_headers(resp.request_body.response)["x-gateway-destination-endpoint"]
                    assert_pick(resp, "request_body", [endpoint])
                    ip, _, got = endpoint.rpartition(":")
                    assert ip in ips and got == str(port), (rank, endpoint)
        msg = vllm_generate(range(40))
        msg.data_parallel_rank = 2
        async with channel(address) as ch:  # the subset hint and the rank: both hold
            envoy = Envoy(ch)
            await envoy.send(request_headers(VLLM, subset=[ips[1]], extra=GRPC))
            [resp] = await envoy.send(request_body(framed(msg)))
            assert_pick(resp, "request_body", [f"{ips[1]}:3004"])
            await envoy.close()
        async with channel(address) as ch:
            envoy = Envoy(ch)
            await envoy.send(request_headers(VLLM, subset=[f"{ips[1]}:3000"], extra=GRPC))
            [resp] = await envoy.send(request_body(framed(msg)))
            assert_grpc_refused(resp, 503, grpc.StatusCode.UNAVAILABLE, "data_parallel_rank 2",
                                "kvcoord_epp_no_endpoint")
            await envoy.close()
        msg.data_parallel_rank = 3
        resp = await exchange(address, VLLM, framed(msg), GRPC)
        assert_grpc_refused(resp, 400, grpc.StatusCode.INVALID_ARGUMENT, "the pool has 3 target ports")


def test_read_generate_reads_image_hashes_and_the_pinned_rank() -> None:
    """vLLM's per-image hashes at their placeholders become the lookup's multimodal items, as the engine
    keys those blocks; a pinned data_parallel_rank is read (gzip-compressed too); a method that is not
    Generate is not askable."""
    mm = vll.MultimodalInputs(mm_hashes=["h1", "h2"], mm_placeholders=[
        vll.PlaceholderRange(offset=2, length=4), vll.PlaceholderRange(offset=9, length=3)])
    msg = vll.GenerateRequest(tokenized=vll.TokenizedInput(input_ids=range(16)), mm_inputs=mm)
    query = {"tokens": list(range(16)), "mm_items": [("h1", 2, 4), ("h2", 9, 3)]}
    assert read_generate(VLLM, framed(msg)) == Generate(query)
    msg.data_parallel_rank = 0
    assert read_generate(VLLM, framed(msg, gzipped=True), encoding="gzip") == Generate(query, dp_rank=0)
    other = read_generate("/vllm.grpc.engine.VllmEngine/Embed", framed(msg))
    assert other.query is None and "is not a Generate" in other.why


# --- Anthropic's /v1/messages and OpenAI's /v1/responses --------------------------------------------
def messages_body(system: str, *turns: str) -> dict[str, Any]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": MODEL, "max_tokens": 1, "system": [{"type": "text", "text": system}], "messages": msgs}


async def test_messages_and_responses_bodies_are_placed_by_prefix(fleet: Any) -> None:
    """``/v1/messages`` and ``/v1/responses`` bodies: placed by the prefix of the chat vLLM renders for them
    (the same conversion ``kvcoord route`` makes), each where the engine served that conversation before;
    a malformed one gets 400 in its own API's error shape."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    json_ct = {"content-type": "application/json"}
    with epp(fleet, *ONE_FALLBACK) as address:
        # The fleet's engines served PROMPT_A / PROMPT_B as one user message: the same chat.
        anthropic = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT_A}]}
        resp = await exchange(address, "/v1/messages", json.dumps(anthropic).encode(), json_ct)
        assert_pick(resp, "request_body", [a, b])
        responses = {"model": MODEL, "input": [{"role": "user", "content": PROMPT_B}]}
        resp = await exchange(address, "/v1/responses?x=1", json.dumps(responses).encode(), json_ct)
        assert_pick(resp, "request_body", [b, a])
        # An agent's session: node-b's engine served its first turn through its own /v1/messages; the
        # second turn, with the first's answer and a new question, follows it there.
        system = "You are a coding agent. Tools: read, edit, run. Answer in short steps. " * 8
        assert http_json("POST", f"http://{b}/v1/messages",
                         messages_body(system, "Open main.py and list its functions"))[0] == 200
        turn2 = messages_body(system, "Open main.py and list its functions", "main, parse, run",
                              "Now rename parse to read_args")
        deadline = time.monotonic() + DEADLINE
        while True:  # until the index shows the engine's KV events of the first turn
            resp = await exchange(address, "/v1/messages", json.dumps(turn2).encode(), json_ct)
            if _why(resp).startswith("prefix-aware: node-b") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert_pick(resp, "request_body", [b, a])
        held = int(blocks_of(resp))
        assert held > 0
        # An image in the new turn (epp rewrites no body, so the engine keys it by its own digest, as a
        # chat's): placed by the prefix before it, the same conversation's.
        shot = {"type": "image", "source": {"type": "url", "url": "https://x.test/screen.png"}}
        turn2["messages"][-1]["content"] = [shot, {"type": "text", "text": "Now rename parse to read_args"}]
        resp = await exchange(address, "/v1/messages", json.dumps(turn2).encode(), json_ct)
        assert_pick(resp, "request_body", [b, a])
        assert 0 < int(blocks_of(resp)) <= held
        # Malformed: the 400 comes in the API's own shape.
        resp = await exchange(address, "/v1/messages", json.dumps({"model": MODEL, "messages": []}).encode(),
                              json_ct)
        assert resp.immediate_response.status.code == 400
        err = json.loads(resp.immediate_response.body)
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert "messages" in err["error"]["message"]
        resp = await exchange(address, "/v1/responses", json.dumps({"model": MODEL, "input": 5}).encode(),
                              json_ct)
        assert_immediate(resp, 400, "kvcoord_epp_bad_request", "input must be")



async def test_decision_metrics_of_messages_and_responses(fleet: Any) -> None:
    """The response path of ``/v1/messages`` and ``/v1/responses`` requests, JSON and SSE: epp reads each
    API's own usage from the served engine's real answer and finds the cached tokens it predicted."""
    mport = free_port()
    cases = [("/v1/messages", {"model": MODEL, "max_tokens": 2,
                               "messages": [{"role": "user", "content": PROMPT_A}]}),
             ("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": PROMPT_B})]
    with epp(fleet, "--metrics-listen", f"127.0.0.1:{mport}", name="epp-quality-apis") as address:
        async with channel(address) as ch:
            for path, body in cases:
                for stream in (False, True):
                    req = {**body, "stream": stream}
                    envoy = Envoy(ch)
                    await envoy.send(request_headers(path))
                    [resp] = await envoy.send(request_body(json.dumps(req).encode()))
                    picked = set_headers(resp.request_body.response)["x-gateway-destination-endpoint"]
                    assert_pick(resp, "request_body", [picked])
                    raw, ctype = await asyncio.to_thread(_engine, picked, req, path)
                    await respond(envoy, raw, ctype)
                    await envoy.close()
        got = await asyncio.to_thread(epp_metrics, mport)
    assert got['kvcoord_epp_hit_outcomes_total{outcome="match"}'] == 4, got
    assert got["kvcoord_epp_achieved_tokens_total"] == got["kvcoord_epp_predicted_tokens_total"] > 0


async def test_decision_metrics_of_grpc_responses(fleet: Any) -> None:
    """A gRPC Generate's response path (pieces cut anywhere, ended by the trailers as gRPC ends it): epp
    reads the prompt and cached tokens of the engine's GenerateResponse messages (vLLM's stream chunks,
    SGLang's complete) and measures them against its prediction."""
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    mport = free_port()
    grpc_ct = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
        (":status", b"200"), ("content-type", b"application/grpc"))])
    with epp(fleet, "--metrics-listen", f"127.0.0.1:{mport}", name="epp-quality-grpc") as address:
        async with channel(address) as ch:
            for path, ids, engine in ((VLLM, tokens_of(a, PROMPT_A), vll),
                                      (SGLANG, tokens_of(b, PROMPT_B), sgl)):
                msg = vllm_generate(ids) if engine is vll else sglang_generate(ids)
                before = (await asyncio.to_thread(epp_metrics, mport)).get(PREDICTED, 0)
                envoy = Envoy(ch)
                await envoy.send(request_headers(path, extra={**GRPC, "x-gateway-model-name": MODEL}))
                [resp] = await envoy.send(request_body(framed(msg)))
                assert_pick(resp, "request_body", [a if engine is vll else b])
                # at the pick
                predicted = int((await asyncio.to_thread(epp_metrics, mport))[PREDICTED] - before)
                assert predicted == len(ids) // BLOCK * BLOCK
                await envoy.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=grpc_ct)))
                if engine is vll:  # a stream: every chunk carries the usage, the last counts
                    messages = [vll.GenerateResponse(chunk=vll.GenerateStreamChunk(
                        token_ids=[i], prompt_tokens=len(ids), completion_tokens=i + 1,
                        cached_tokens=predicted)) for i in range(3)]
                else:
                    messages = [sgl.GenerateResponse(request_id="r2", complete=sgl.GenerateComplete(
                        output_ids=[1, 2], prompt_tokens=len(ids), cached_tokens=predicted))]
                raw = b"".join(framed(m) for m in messages)
                cuts = [0, 3, len(raw) // 2 + 1, len(raw)]  # pieces cut anywhere, one inside a frame header
                for i in range(3):
                    await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(
                        body=raw[cuts[i]:cuts[i + 1]], end_of_stream=False)))
                status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="grpc-status", raw_value=b"0")])
                [done] = await envoy.send(ep.ProcessingRequest(response_trailers=ep.HttpTrailers(
                    trailers=status)))
                assert done == ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                await envoy.close()
        got = await asyncio.to_thread(epp_metrics, mport)
    assert got['kvcoord_epp_hit_outcomes_total{outcome="match"}'] == 2, got
    assert got["kvcoord_epp_achieved_tokens_total"] == got["kvcoord_epp_predicted_tokens_total"] > 0
