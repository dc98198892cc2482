"""``kvcoord route --read-timeout``: an engine that stops sending mid-answer is cut off, visibly, instead of
holding its client for good (the stream ends with an error event, the attempt and the node are counted)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.route_fleet import MODEL, route_metrics


async def test_an_engine_silent_mid_stream_is_cut_off_after_the_read_timeout(tmp_path: Path) -> None:
    released = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        """An engine that sends its head and one event, then nothing (a hung GPU, a wedged process)."""
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"first"}]}\n\n')
        await released.wait()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stalls)
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
                    body = {"model": MODEL, "prompt": "hello", "stream": True}
                    async with s.post(f"{base}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        text = (await resp.read()).decode()
                assert '"text":"first"' in text
                assert "backend stuck failed mid-stream (TimeoutError)" in text, text
                m = await route_metrics(s, base)
        assert m['kvcoord_route_requests_total{endpoint="completions",outcome="midstream_failure"}'] == 1
    finally:
        released.set()
        await runner.cleanup()


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_read_timeout_is_one_line(value: str) -> None:
    out = subprocess.run(kvcoord_cmd("route", "--backend", "a=http://h:1", "--policy", "round-robin",
                                     "--read-timeout", value), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--read-timeout" in out.stderr
