"""``kvcoord route --read-timeout``: an engine that stops sending is cut off, visibly, instead of holding its
client for good: a stream ends with an error event; a request it never answered gets 504 and is not sent to
another node (the engine has it and may still be running it); the node and the outcome are counted."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.procs import free_port, kvcoord_cmd, running, until_async, wait_for_port
from tests.route_fleet import MODEL, route_metrics


async def test_an_engine_silent_mid_answer_is_cut_off_after_the_read_timeout(tmp_path: Path) -> None:
    released = asyncio.Event()
    received = 0

    async def stalls(request: web.Request) -> web.StreamResponse:
        """An engine that sends a stream's head and one event, then nothing (a hung GPU, a wedged process);
        a request for a whole answer gets nothing at all."""
        nonlocal received
        received += 1
        if not (await request.json()).get("stream"):
            await released.wait()
            return web.json_response({})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"first"}]}\n\n')
        await released.wait()
        return resp

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", stalls)
    app.router.add_get("/health", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    eport, rport = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", eport).start()
    cmd = kvcoord_cmd("route", "--listen", f"127.0.0.1:{rport}", "--policy", "round-robin", "--model", MODEL,
                      "--backend", f"stuck=http://127.0.0.1:{eport}", "--read-timeout", "1")
    base = f"http://127.0.0.1:{rport}"
    try:
        with running(cmd, log=tmp_path / "route.log"):
            await asyncio.to_thread(wait_for_port, rport, "127.0.0.1", 30)
            async with aiohttp.ClientSession() as s:
                async with asyncio.timeout(60):  # far above the 1 s: the test's guard, not its subject
                    whole = {"model": MODEL, "prompt": "hi"}
                    async with s.post(f"{base}/v1/completions", json=whole) as resp:
                        assert resp.status == 504, await resp.text()
                        error = (await resp.json())["error"]
                assert error["type"] == "GatewayTimeoutError" and "not sent elsewhere" in error["message"]
                assert received == 1

                async def back() -> bool:  # left out after the timeout, back once its /health answers
                    async with s.get(f"{base}/health") as r:
                        return not (await r.json())["suspect"]

                await until_async(back, "the engine back in rotation", timeout=30)
                async with asyncio.timeout(60):
                    body = {"model": MODEL, "prompt": "hello", "stream": True}
                    async with s.post(f"{base}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        text = (await resp.read()).decode()
                assert '"text":"first"' in text
                assert "backend stuck failed mid-stream (ReadTimeout)" in text, text
                m = await route_metrics(s, base)
        assert m['kvcoord_route_requests_total{endpoint="completions",outcome="upstream_timeout"}'] == 1
        assert m['kvcoord_route_requests_total{endpoint="completions",outcome="midstream_failure"}'] == 1
        assert m['kvcoord_route_backend_failures_total{kind="timeout",node="stuck"}'] == 1
        assert m.get('kvcoord_route_retries_total{reason="connect"}', 0) == 0
    finally:
        released.set()
        await runner.cleanup()


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_read_timeout_is_one_line(value: str) -> None:
    out = subprocess.run(kvcoord_cmd("route", "--backend", "a=http://h:1", "--policy", "round-robin",
                                     "--read-timeout", value), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--read-timeout" in out.stderr
