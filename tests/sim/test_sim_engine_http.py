"""``kvcoord sim-engine --http-listen`` as a real process: vLLM's OpenAI API on the engine's own BlockPool
(usage and cached tokens, SSE chunk by chunk, /tokenize ids that are the ids it hashes, /metrics with vLLM's
names), and ``kvcoord agent --engine-metrics-url`` carrying that load into lookups and stats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcoord.agent.engine_metrics import parse_engine_load
from kvcoord.load import NodeLoad
from kvcoord.sim.engine import PromptSource
from kvcoord.tokenize import toktok
from tests.http_util import parse_samples
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port
from tests.route_fleet import post
from tests.route_fleet import sse_events as _sse_events

MODEL = "sim-model"
BLOCK = 8
PROFILE = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BLOCK))
SYSTEM = "You are a careful assistant that answers in short words " * 6


def _engine_cmd(http: int, pub: int, *extra: str) -> list[str]:
    """The engine's replay socket is on ``pub + 1`` (an agent joining late catches up from it)."""
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                       "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
                       "--http-listen", f"127.0.0.1:{http}", *extra)


@contextlib.contextmanager
def _http_engine(tmp_path: Path, *extra: str, name: str = "engine") -> Iterator[tuple[str, int, Any]]:
    """A sim-engine serving HTTP only (``--rate 0 --requests 0``), unless ``extra`` says otherwise."""
    http, pub = free_port(), free_port_pair()
    flags = extra if "--rate" in extra else ("--rate", "0", "--requests", "0", *extra)
    with running(_engine_cmd(http, pub, *flags), log=tmp_path / f"{name}.log") as proc:
        wait_for_port(http, timeout=30)
        yield f"http://127.0.0.1:{http}", pub, proc


def _metrics(text: str) -> dict[str, float]:
    """``name{labels}`` → value for the vllm: samples (labels checked to be vLLM's)."""
    out = {}
    for (name, labels), value in parse_samples(text).items():
        if name.startswith("vllm:"):
            assert {("model_name", MODEL), ("engine", "0")} <= set(labels), (name, labels)
            out[name] = value
    return out


async def _scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        return _metrics(await resp.text())


async def test_completions_chat_usage_and_metrics(tmp_path: Path) -> None:
    """Non-streaming shapes; a repeated prompt is served from the cache; /metrics counts exactly that."""
    prompt = SYSTEM + "what is a prefix cache?"
    with _http_engine(tmp_path) as (base, _, _proc):
        async with aiohttp.ClientSession() as s:
            cached, usages = [], []
            for _ in range(2):
                status, _, body = await post(s, f"{base}/v1/completions",
                                             {"model": MODEL, "prompt": prompt, "max_tokens": 5})
                assert status == 200, body
                assert body["object"] == "text_completion" and body["model"] == MODEL
                assert body["id"].startswith("cmpl-")
                choice = body["choices"][0]
                assert choice["index"] == 0 and choice["finish_reason"] == "length"
                assert len(choice["text"].split()) == 5
                u = body["usage"]
                assert u["prompt_tokens"] == len(toktok.tokenize(prompt))
                assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
                cached.append(u["prompt_tokens_details"]["cached_tokens"])
                usages.append(u)
            # The second time the pool holds every full block of the prompt (vLLM recomputes the last token).
            n = usages[0]["prompt_tokens"]
            assert cached == [0, (n - 1) // BLOCK * BLOCK], cached

            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
            status, _, chat = await post(s, f"{base}/v1/chat/completions",
                                         {"messages": messages, "max_completion_tokens": 3})
            assert status == 200, chat
            assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
            msg = chat["choices"][0]["message"]
            assert msg["role"] == "assistant" and len(msg["content"].split()) == 3
            assert chat["usage"]["prompt_tokens"] == len(toktok.tokenize_chat(messages))
            usages.append(chat["usage"])

            async with s.get(f"{base}/v1/models") as resp:
                models = await resp.json()
            assert models["object"] == "list" and models["data"][0]["id"] == MODEL
            assert models["data"][0]["owned_by"] == "vllm" and models["data"][0]["max_model_len"] > 0
            async with s.get(f"{base}/health") as resp:
                assert resp.status == 200

            m = await _scrape(s, base)
            assert m["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
            assert m["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
            assert m["vllm:prefix_cache_queries_total"] == m["vllm:prompt_tokens_total"]
            assert m["vllm:prefix_cache_hits_total"] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                            for u in usages) > 0
            # Nothing in flight: no request holds blocks (cached blocks are free, not used).
            assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            assert m["vllm:kv_cache_usage_perc"] == 0

            # vLLM's error shapes.
            status, _, err = await post(s, f"{base}/v1/completions", {"model": "other", "prompt": "x"})
            assert status == 404 and err["error"]["type"] == "NotFoundError", err
            status, _, err = await post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 10**9})
            assert status == 400 and "maximum context length" in err["error"]["message"], err
            async with s.post(f"{base}/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
            status, _, err = await post(s, f"{base}/v1/chat/completions", {"messages": "hello"})
            assert status == 400 and err["error"]["code"] == 400, err


@pytest.mark.parametrize("chat", [False, True])
async def test_streaming_arrives_chunk_by_chunk(tmp_path: Path, chat: bool) -> None:
    """Chunks reach the client while the request is still generating (the engine's /metrics says so),
    one per token, in separate reads; then the finish, the usage chunk and ``[DONE]``."""
    n_tokens = 40
    with _http_engine(tmp_path, "--token-interval", "0.1") as (base, _, _proc):
        async with aiohttp.ClientSession() as s:
            if chat:
                url = f"{base}/v1/chat/completions"
                body: dict[str, Any] = {"messages": [{"role": "user", "content": SYSTEM}]}
            else:
                url = f"{base}/v1/completions"
                body = {"prompt": SYSTEM}
            body.update(model=MODEL, max_tokens=n_tokens, stream=True, stream_options={"include_usage": True})
            events: list[Any] = []
            seen_running: list[float] = []

            async def on_event(ev: Any) -> None:
                events.append(ev)
                texts = [ev for ev in events if ev and ev["choices"] and _text(ev, chat)]
                if len(texts) == 1 and not seen_running:  # the first token: the request is still running
                    m = await _scrape(s, base)
                    seen_running.append(m["vllm:num_requests_running"])
                    assert m["vllm:generation_tokens_total"] < n_tokens

            async with s.post(url, json=body) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                reads = await _sse_events(resp, on_event)
    assert seen_running == [1.0]
    assert events[-1] is None, "the stream must end with [DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == n_tokens
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finish = events[-3]["choices"][0]
    assert finish["finish_reason"] == "length"
    tokens = [ev for ev in events[:-3] if _text(ev, chat)]
    assert len(tokens) == n_tokens
    if chat:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(ev["object"] == "chat.completion.chunk" for ev in events[:-1])
    assert len({ev["id"] for ev in events[:-1]}) == 1
    assert reads > n_tokens // 2, f"{reads} reads for {n_tokens} tokens: the stream was buffered"


def _text(ev: Any, chat: bool) -> str:
    if not ev or not ev["choices"]:
        return ""
    c = ev["choices"][0]
    return str(c["delta"].get("content") or "") if chat else str(c["text"])


async def test_sigterm_with_streams_in_flight_exits_fast(tmp_path: Path) -> None:
    with _http_engine(tmp_path, "--token-interval", "0.05") as (base, _, proc):
        async with aiohttp.ClientSession() as s:
            resp = await s.post(f"{base}/v1/completions", json={"prompt": "a b c", "max_tokens": 10_000,
                                                                "stream": True})
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # generating
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()  # the stream ends (cut or closed), it does not hang
            await asyncio.to_thread(proc.wait, 10)
            assert time.monotonic() - t0 < 5.0  # generous: CI is a loaded 2-core VM
            resp.close()
        assert proc.returncode == 0, (tmp_path / "engine.log").read_text()[-2000:]


def test_http_port_in_use_is_one_line_and_publishes_nothing(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    pub = free_port_pair()
    state = tmp_path / "state.json"
    try:
        out = subprocess.run(_engine_cmd(held.getsockname()[1], pub, "--state-file", str(state)),
                             capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on" in lines[0], out.stderr
    assert not state.exists()
    with socket.socket() as s:  # the PUB port was never bound
        s.bind(("127.0.0.1", pub))


# --- with a coordinator and an agent ---------------------------------------------------------------
def _serve_cmd(gport: int) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}",
                       "--metrics-listen", f"127.0.0.1:{free_port()}",
                       "--http-listen", f"127.0.0.1:{free_port()}",
                       "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0")


def _agent_cmd(gport: int, pub: int, *extra: str) -> list[str]:
    return kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", "node-x",
                       "--model", MODEL, "--zmq-endpoint", f"tcp://127.0.0.1:{pub}",
                       "--replay-endpoint", f"tcp://127.0.0.1:{pub + 1}", *extra)


def _cli_json(*args: str) -> Any:
    out = subprocess.run(kvcoord_cmd(*args), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def _until(cond: Callable[[], Any], what: str, timeout: float = 45.0) -> Any:
    """Poll ``cond`` (run off the loop) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(cond)
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_tokenize_ids_are_the_ids_the_engine_hashes(tmp_path: Path) -> None:
    """/tokenize's ids, looked up on a real coordinator (fed by an agent relaying this engine), hit every full
    block the engine cached for the same prompt: the toy tokenizer is the one the pool hashes."""
    gport = free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve_cmd(gport), log=tmp_path / "serve.log"))
        base, pub, _ = stack.enter_context(_http_engine(tmp_path))
        wait_for_port(gport, timeout=30)
        stack.enter_context(running(_agent_cmd(gport, pub, "--serving-url", base),
                                    log=tmp_path / "agent.log"))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "tell me a story"}]
        cases = [("/v1/chat/completions", {"messages": messages}, {"messages": messages}),
                 ("/v1/completions", {"prompt": SYSTEM + " once upon a time"},
                  {"prompt": SYSTEM + " once upon a time"})]
        async with aiohttp.ClientSession() as s:
            for path, request, tok_request in cases:
                status, _, tok = await post(s, f"{base}/tokenize", {"model": MODEL, **tok_request})
                assert status == 200, tok
                assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > tok["count"]
                status, _, body = await post(s, f"{base}{path}", {"model": MODEL, "max_tokens": 2, **request})
                assert status == 200 and body["usage"]["prompt_tokens"] == tok["count"], body
                tokens_file = tmp_path / "tokens.json"
                tokens_file.write_text(json.dumps(tok["tokens"]))
                full = tok["count"] // BLOCK

                def hit(f: Path = tokens_file, full: int = full) -> Any:
                    res = _cli_json("lookup", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL,
                                    "--tokens-file", str(f))
                    nodes = res["nodes"]
                    return res if nodes and nodes[0]["matched_blocks"] == full else None

                res = await _until(hit, f"the index to hold {path}'s prompt")
                assert res["num_blocks"] == full and res["nodes"][0]["node_id"] == "node-x"
                assert res["nodes"][0].get("serving_url") == base
            # A different text misses: the ids really are the prompt's.
            status, _, other = await post(s, f"{base}/tokenize",
                                           {"prompt": "completely different words " * 8})
            f = tmp_path / "other.json"
            f.write_text(json.dumps(other["tokens"]))
            res = _cli_json("lookup", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL,
                            "--tokens-file", str(f))
            assert not res["nodes"] or res["nodes"][0]["matched_blocks"] == 0


async def test_agent_carries_engine_load_into_lookups_and_stats(tmp_path: Path) -> None:
    """A busy sim-engine (synthetic workload plus HTTP streams beyond --max-num-seqs): the agent scrapes
    its /metrics, and `kvcoord lookup` and `kvcoord stats` show running, waiting and kv_usage."""
    gport = free_port()
    agent_stats = tmp_path / "agent-stats.json"
    env = {"KVCOORD_LEASE_SECONDS": "3"}  # heartbeats every second
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve_cmd(gport), env=env, log=tmp_path / "serve.log"))
        base, pub, _ = stack.enter_context(_http_engine(
            tmp_path, "--rate", "50", "--concurrency", "4", "--max-num-seqs", "1", "--token-interval", "0.01",
            "--prefix-len", "64", "--suffix-len", "16"))
        wait_for_port(gport, timeout=30)
        stack.enter_context(running(_agent_cmd(
            gport, pub, "--engine-metrics-url", f"{base}/metrics", "--engine-metrics-interval", "0.2",
            "--stats-file", str(agent_stats)), log=tmp_path / "agent.log"))
        async with aiohttp.ClientSession() as s:
            # One stream runs (max-num-seqs 1), two wait: vllm:num_requests_waiting is 2 while they last.
            async def hold(i: int) -> None:
                body = {"prompt": f"stream {i}", "max_tokens": 10_000, "stream": True}
                async with s.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    async for _ in resp.content.iter_any():
                        pass

            streams = [asyncio.create_task(hold(i)) for i in range(3)]
            try:
                tokens = tmp_path / "tokens.json"
                # The workload's most common prompt prefix: the node holds it, so it is in every answer.
                prompt = PromptSource(0, prefixes=8, prefix_len=64, suffix_len=16, output_len=32).prompt()
                tokens.write_text(json.dumps(prompt))

                def loaded() -> Any:
                    res = _cli_json("lookup", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL,
                                    "--tokens-file", str(tokens), "--candidate", "node-x")
                    node = next((n for n in res["nodes"] if n["node_id"] == "node-x"), None)
                    load = node and node["load"]
                    return load if load and load["running_requests"] >= 2 and load["waiting_requests"] == 2 \
                        and load["kv_usage"] > 0 else None

                load = await _until(loaded, "lookup to show the engine's load")
                # Workload requests (up to --concurrency) plus the one HTTP stream hold blocks.
                assert 2 <= load["running_requests"] <= 5 and 0 < load["kv_usage"] <= 1, load
                stats = _cli_json("stats", "--coordinator", f"127.0.0.1:{gport}")
                node = next(n for n in stats["nodes"] if n["node_id"] == "node-x")
                assert node["load"]["running_requests"] > 0 and node["load"]["kv_usage"] > 0, node
                status = json.loads(agent_stats.read_text())["engine_metrics"]
                assert status["url"] == f"{base}/metrics" and status["ok"] and not status["stale"], status
                assert status["age_seconds"] is not None and status["age_seconds"] < 5
                assert json.loads(agent_stats.read_text())["serving_url"] == base
            finally:
                for t in streams:
                    t.cancel()
                results = await asyncio.gather(*streams, return_exceptions=True)
                assert all(isinstance(r, asyncio.CancelledError) for r in results), results


async def test_an_engine_without_kv_events_is_served_approximate_with_its_load(tmp_path: Path) -> None:
    """`kvcoord agent --no-kv-events` (an engine started without KV events): no relay, the node is live
    with trust approximate, and lookups and `kvcoord nodes` show its real load and URL."""
    gport = free_port()
    agent_stats = tmp_path / "agent-stats.json"
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve_cmd(gport), env={"KVCOORD_LEASE_SECONDS": "3"},
                                    log=tmp_path / "serve.log"))
        base, _, _ = stack.enter_context(_http_engine(tmp_path, "--max-num-seqs", "1",
                                                      "--token-interval", "0.01"))
        wait_for_port(gport, timeout=30)
        stack.enter_context(running(kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", "node-y", "--model", MODEL,
            "--no-kv-events", "--engine-metrics-url", f"{base}/metrics", "--engine-metrics-interval", "0.2",
            "--stats-file", str(agent_stats)), log=tmp_path / "agent.log"))
        async with aiohttp.ClientSession() as s:
            async def hold() -> None:
                body = {"prompt": "a long story", "max_tokens": 10_000, "stream": True}
                async with s.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    async for _ in resp.content.iter_any():
                        pass

            stream = asyncio.create_task(hold())
            try:
                tokens = tmp_path / "tokens.json"
                tokens.write_text(json.dumps(list(range(1, 4 * BLOCK + 1))))

                def served() -> Any:
                    res = _cli_json("lookup", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL,
                                    "--tokens-file", str(tokens), "--include-unmatched")
                    node = next((n for n in res["nodes"] if n["node_id"] == "node-y"), None)
                    return node if node and node["load"]["running_requests"] >= 1 else None

                node = await _until(served, "lookup to show the approximate node with its load")
                assert (node["matched_blocks"], node["trust"], node.get("serving_url")) == (
                    0, "approximate", base)
                nodes = _cli_json("nodes", "--coordinator", f"127.0.0.1:{gport}")["nodes"]
                listed = {n["node_id"]: n for n in nodes}
                assert listed["node-y"]["trust"] == "approximate" and listed["node-y"]["state"] == "active"
                assert "no KV events" in listed["node-y"]["trust_reason"]
                status = json.loads(agent_stats.read_text())
                assert status["relays"] == [] and status["engine_metrics"]["ok"], status
            finally:
                stream.cancel()
                results = await asyncio.gather(stream, return_exceptions=True)
                assert all(isinstance(r, asyncio.CancelledError) for r in results), results


@pytest.mark.slow
def test_agent_scrape_failures_are_counted_logged_once_and_recover(tmp_path: Path) -> None:
    """No engine on the metrics URL: the agent keeps relaying, says why in its stats file (load unknown,
    zeros), logs the outage once; when the engine comes up, scrapes succeed again."""
    http, pub, gport = free_port(), free_port_pair(), free_port()
    stats = tmp_path / "agent-stats.json"
    log = tmp_path / "agent.log"

    def status() -> dict[str, Any]:
        try:
            return dict(json.loads(stats.read_text())["engine_metrics"])
        except (OSError, ValueError):
            return {}

    def wait(cond: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            st = status()
            if st and cond(st):
                return st
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {status()}\n{log.read_text()[-2000:]}")

    with running(_agent_cmd(gport, pub, "--engine-metrics-url", f"http://127.0.0.1:{http}/metrics",
                            "--engine-metrics-interval", "0.1", "--stats-file", str(stats)), log=log):
        st = wait(lambda st: st["failures"] >= 5, "failed scrapes")
        assert not st["ok"] and st["last_error"] and st["age_seconds"] is None and st["stale"], st
        assert st["load"] == NodeLoad().to_json()
        engine = _engine_cmd(http, pub, "--rate", "20", "--concurrency", "3")
        with running(engine, log=tmp_path / "engine.log"):
            st = wait(lambda st: st["ok"] and st["load"]["running_requests"] > 0, "scrapes to succeed")
            assert 0 < st["load"]["kv_usage"] <= 1 and not st["stale"], st
            text = log.read_text()
            assert text.count("scrape failing") == 1 and "scraping again" in text, text
        # The engine is gone: a second outage, logged once more; the last good load is kept a few
        # seconds, then reported as unknown (zeros).
        st = wait(lambda st: not st["ok"] and st["stale"], "the load to go stale")
        assert st["load"] == NodeLoad().to_json() and st["age_seconds"] > 0, st
        assert log.read_text().count("scrape failing") == 2


# --- units ----------------------------------------------------------------------------------------
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="other"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""


def test_parse_engine_load_sums_requests_and_averages_usage() -> None:
    assert parse_engine_load(VLLM_PAGE, "m") == NodeLoad(5, 5, 0.375)
    # A model name no sample carries: a one-model engine served under another name counts whole.
    one = "\n".join(line for line in VLLM_PAGE.splitlines() if 'model_name="other"' not in line) + "\n"
    assert parse_engine_load(one, "served-as-something-else") == NodeLoad(5, 5, 0.375)
    # Older vLLM's gauge name, no labels at all.
    old = "vllm:num_requests_running 2\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parse_engine_load(old, "m") == NodeLoad(2, 0, 0.9)
    with pytest.raises(ValueError, match="no vllm:num_requests_running"):
        parse_engine_load("up 1\n", "m")


def test_toy_tokenizer_rules() -> None:
    ab = [toktok.BOS, toktok.word_id("a"), toktok.word_id("b")]
    assert toktok.tokenize("a  b") == toktok.tokenize("a b") == ab
    assert toktok.tokenize("a", add_special_tokens=False) == [toktok.word_id("a")]
    text = toktok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert toktok.tokenize_chat([{"role": "user", "content": "hi"}]) == [3, toktok.word_id("user"),
                                                                        toktok.word_id("hi"), 4, 3,
                                                                        toktok.word_id("assistant")]
    out = toktok.generate([1, 2, 3], 6)
    assert out == toktok.generate([1, 2, 3], 6)
    assert toktok.tokenize(toktok.detokenize(out), add_special_tokens=False) == out
    assert all(toktok.NUM_SPECIAL <= t < toktok.VOCAB for t in out)
