"""``kvcoord sim-engine --prefill-us-per-token`` and friends, as real processes: a cached prefix shortens
TTFT, prefills queue serially and show as ``vllm:num_requests_waiting``, and bad flags are one line.

No tight timing: the costs are large (hundreds of ms per prompt) and the assertions are lower bounds,
wide margins, orders and counts, so a busy machine passes them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.sim.test_sim_engine_http import (
    MODEL,
    _agent_cmd,
    _cli_json,
    _http_engine,
    _scrape,
    _serve_cmd,
    _until,
)

PROMPT_LEN = 400
COST_US = 2000  # 2 ms per uncached token: 0.8 s for a whole 400-token prompt


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30_000 + 1 for i in range(PROMPT_LEN)]


async def _ttft(session: aiohttp.ClientSession, base: str, prompt: list[int],
                order: list[int] | None = None, tag: int = 0) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the engine reported."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first, cached = None, -1
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev["choices"] and first is None:
                first = time.monotonic() - t0
                if order is not None:
                    order.append(tag)
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


async def test_cached_prefix_shortens_ttft(tmp_path: Path) -> None:
    """The same prompt twice: the second prefills 16 tokens, not 400, and its TTFT shows it."""
    with _http_engine(tmp_path, "--prefill-us-per-token", str(COST_US), "--max-batch-tokens", "128") as (
            base, _, _):
        async with aiohttp.ClientSession() as s:
            prompt = _prompt(1)
            cold, cached0 = await _ttft(s, base, prompt)
            warm, cached1 = await _ttft(s, base, prompt)
            assert cached0 == 0 and cached1 == (PROMPT_LEN - 1) // 8 * 8
            assert cold >= PROMPT_LEN * COST_US * 1e-6  # the model's time is a floor, never skipped
            assert warm < cold - 0.5, (cold, warm)


@pytest.mark.slow
async def test_concurrent_prefills_queue_and_finish_in_order(tmp_path: Path) -> None:
    """Three uncached prompts, each sent once the engine has the previous one: the engine reports the
    later ones waiting, and their first tokens come in arrival order."""
    with _http_engine(tmp_path, "--prefill-us-per-token", str(COST_US * 2)) as (base, _, _):
        async with aiohttp.ClientSession() as s:
            order: list[int] = []
            tasks, seen_waiting = [], 0
            for i in range(3):
                tasks.append(asyncio.create_task(_ttft(s, base, _prompt(10 + i), order, i)))
                deadline = time.monotonic() + 30
                while True:  # the engine has it: running (prefilling) or waiting behind the others
                    m = await _scrape(s, base)
                    inside = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
                    seen_waiting = max(seen_waiting, int(m["vllm:num_requests_waiting"]))
                    if inside + len(order) >= i + 1 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)
            assert order == [0, 1, 2]
            assert seen_waiting >= 1  # the third arrived while the first was still prefilling (1.6 s)
            m = await _scrape(s, base)
            assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0
            assert m["vllm:prefix_cache_hits_total"] == 0


async def test_decode_step_cost_bounds_generation(tmp_path: Path) -> None:
    """A decode step of 50 ms: ten tokens take at least nine steps after the first."""
    with _http_engine(tmp_path, "--decode-ms-per-token", "50") as (base, _, _):
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(f"{base}/v1/completions",
                              json={"model": MODEL, "prompt": _prompt(3), "max_tokens": 10}) as resp:
                body = await resp.json()
            assert body["usage"]["completion_tokens"] == 10
            assert time.monotonic() - t0 >= 9 * 0.05


@pytest.mark.parametrize("flag,value", [("--prefill-us-per-token", "-1"), ("--decode-ms-per-token", "x"),
                                        ("--max-batch-tokens", "-5"), ("--max-batch-tokens", "1.5")])
def test_bad_cost_flags_are_one_line(flag: str, value: str) -> None:
    out = subprocess.run(kvcoord_cmd("sim-engine", "--http-listen", "127.0.0.1:0", flag, value),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], out.stderr


async def test_step_clock_chunks_prefills_in_order_and_shares_decode_steps() -> None:
    """Counts, not durations: a 100-token budget chunks three 250-token prefills into 8 steps, finishing
    them in arrival order; five requests decoding ten tokens each share ten steps."""
    from kvcoord.sim.timing import StepClock, StepCosts

    clock = StepClock(StepCosts(prefill_s_per_token=1e-5, max_batch_tokens=100))
    done: list[int] = []

    async def prefill(i: int) -> None:
        await clock.prefill(250)
        done.append(i)

    await asyncio.gather(*(prefill(i) for i in range(3)))
    assert done == [0, 1, 2] and clock.steps == 8 and clock.prefilled == 750 and clock.queued == 0

    clock = StepClock(StepCosts(decode_s=1e-3))

    async def decode() -> None:
        for _ in range(10):
            await clock.decode(0.0)

    await asyncio.gather(*(decode() for _ in range(5)))
    assert clock.steps == 10


async def test_agent_carries_the_prefill_queue_and_a_cancelled_wait_leaves_it(tmp_path: Path) -> None:
    """Three uncached prompts on an engine that prefills 80 s each: one runs, two wait, and a lookup shows
    the agent's scrape of it; clients giving up take their requests out of the queue and the pool."""
    gport = free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve_cmd(gport), env={"KVCOORD_LEASE_SECONDS": "3"},
                                    log=tmp_path / "serve.log"))
        base, pub, _ = stack.enter_context(_http_engine(tmp_path, "--prefill-us-per-token", "200000"))
        wait_for_port(gport, timeout=30)
        agent = _agent_cmd(gport, pub, "--engine-metrics-url", f"{base}/metrics",
                           "--engine-metrics-interval", "0.2")
        stack.enter_context(running(agent, log=tmp_path / "agent.log"))
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(_ttft(s, base, _prompt(20 + i))) for i in range(3)]
            tokens = tmp_path / "tokens.json"
            tokens.write_text(json.dumps(_prompt(20)))

            def queued() -> object:
                res = _cli_json("lookup", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL,
                                "--tokens-file", str(tokens), "--candidate", "node-x")
                node = next((n for n in res["nodes"] if n["node_id"] == "node-x"), None)
                load = node and node["load"]
                ok = load and load["running_requests"] == 1 and load["waiting_requests"] == 2
                return load if ok else None

            try:
                await _until(queued, "lookup to show one prefill running and two waiting")
            finally:
                for t in streams:
                    t.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
            deadline = time.monotonic() + 30
            while True:
                m = await _scrape(s, base)
                if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                    break
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.1)
