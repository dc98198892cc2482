"""``kvcoord route`` says what failed, as real processes: a dead tokenizer engine behind the coordinator is
``tokenize_error`` (the coordinator stays up), a refused token makes ``/health`` not ready with the
reason, and a fresh fleet's first requests are prefix-aware once ``/health`` says ready (the router and
the coordinator warm their lookups and tokenizer before)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.http_util import flat, http_json, metrics
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, until, wait_for_port

pytestmark = pytest.mark.slow

MODEL = "sim-model"
BLOCK = 8
SPEC = f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0"
SYSTEM = "You are a careful assistant and you answer every question about the weather in detail. " * 8


def _engine(http: int, pub: int) -> list[str]:
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--replay-bind",
                       f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, "--algo", "sha256_cbor", "--hash-seed",
                       "0", "--block-size", str(BLOCK), "--http-listen", f"127.0.0.1:{http}", "--rate", "0",
                       "--requests", "0", "--token-interval", "0.001", "--num-blocks", "4096")


def _serve(gport: int, tokenizer: str, *extra: str) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "", "--http-listen", "",
                       "--model", f"{SPEC},tokenizer={tokenizer}", *extra)


def _route(gport: int, rport: int, *extra: str) -> list[str]:
    return kvcoord_cmd("route", "--coordinator", f"127.0.0.1:{gport}", "--listen", f"127.0.0.1:{rport}",
                       "--model", MODEL, "--refresh-interval", "0.5", *extra)


def _get(url: str) -> tuple[int, Any]:
    """``GET url``'s status and JSON answer; ``(0, None)`` while nothing listens."""
    try:
        return http_json("GET", url, timeout=10)
    except OSError:
        return 0, None


def _metrics(base: str) -> dict[str, float]:
    return flat(metrics(f"{base}/metrics"), "kvcoord_route_")


def _health_when(base: str, cond: Any, what: str) -> tuple[int, Any]:
    """Poll ``base``'s /health until ``cond(status, body)``; returns ``(status, body)``."""
    def got() -> tuple[int, Any] | None:
        status, body = _get(f"{base}/health")
        return (status, body) if body is not None and cond(status, body) else None

    return until(got, what, timeout=60, diagnose=lambda: _get(f"{base}/health"))  # type: ignore[no-any-return]


async def _completions(base: str, n: int) -> list[dict[str, str]]:
    """``n`` concurrent text completions sharing a system prompt; their response headers."""
    async def one(session: aiohttp.ClientSession, i: int) -> dict[str, str]:
        body = {"model": MODEL, "prompt": f"{SYSTEM} Question {i}: will it rain?", "max_tokens": 2}
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return dict(resp.headers)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


@contextlib.contextmanager
def _fleet(tmp: Path, *, serve_extra: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """One sim-engine (HTTP and KV events) with its agent and a coordinator tokenizing through the engine's
    /tokenize; yields (engine URL, coordinator port)."""
    http, pub, gport = free_port(), free_port_pair(), free_port()
    engine = f"http://127.0.0.1:{http}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_engine(http, pub), log=tmp / "engine.log"))
        wait_for_port(http, timeout=30)
        stack.enter_context(running(_serve(gport, engine, *serve_extra), log=tmp / "serve.log"))
        wait_for_port(gport, timeout=30)
        agent = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", "node-a", "--model",
                            MODEL, "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint",
                            f"tcp://127.0.0.1:{pub + 1}", "--serving-url", engine,
                            *(("--token", "atok") if serve_extra else ()))
        stack.enter_context(running(agent, log=tmp / "agent.log"))
        yield engine, gport


def test_a_fresh_fleets_first_requests_are_prefix_aware_once_route_is_ready(tmp_path: Path) -> None:
    """Route's /health is 503 "starting" until its lookups are warm, then 200 listing the backend; the
    coordinator warmed its tokenizer at start; the first 10 concurrent completions are placed by prefix."""
    rport = free_port()
    base = f"http://127.0.0.1:{rport}"
    with _fleet(tmp_path) as (engine, _gport), \
            running(_route(_gport, rport, "--deadline-ms", "5000"), log=tmp_path / "route.log"):
        wait_for_port(rport, timeout=30)
        _, health = _health_when(base, lambda st, h: st == 200 and h["backends"], "ready with its backend")
        assert health["status"] == "ok" and health["reason"] == "", health
        assert health["backends"] == {"node-a": engine} and health["warm"] == [MODEL], health
        assert _metrics(base)["kvcoord_route_ready"] == 1
        headers = asyncio.run(_completions(base, 10))
    reasons = [h["x-kvcoord-reason"] for h in headers]
    assert all(h["x-kvcoord-prefix-aware"] == "true" for h in headers), reasons
    serve_log = (tmp_path / "serve.log").read_text()
    assert f"tokenizer for model '{MODEL}' warm in " in serve_log, serve_log
    route_log = (tmp_path / "route.log").read_text()
    assert f"route: ready (lookups warm for model {MODEL})" in route_log, route_log


def _over_http(over_http: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(serve's, route's)`` extra flags: lookups over the coordinator's HTTP API, or none (gRPC)."""
    if not over_http:
        return (), ()
    hport = free_port()
    return ("--http-listen", f"127.0.0.1:{hport}"), ("--coordinator-http", f"http://127.0.0.1:{hport}")


@pytest.mark.parametrize("over_http", [False, True], ids=["grpc", "http"])
def test_a_dead_tokenizer_engine_is_tokenize_error_and_the_coordinator_stays_up(tmp_path: Path,
                                                                                 over_http: bool) -> None:
    """The coordinator tokenizes through one engine's URL (the single point of failure docs/route.md warns
    of); while nothing answers there, text requests go least-loaded as ``tokenize_error``, with
    ``coordinator_up`` 1 and no coordinator outage; once the engine answers they are prefix-aware again.
    The same with lookups over the coordinator's HTTP API (``--coordinator-http``)."""
    http, pub, tok_http, tok_pub = free_port(), free_port_pair(), free_port(), free_port_pair()
    gport, rport = free_port(), free_port()
    engine, base = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{rport}"
    serve_http, route_http = _over_http(over_http)
    route = _route(gport, rport, "--backend", f"static={engine}", "--deadline-ms", "2000", *route_http)
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_engine(http, pub), log=tmp_path / "engine.log"))
        serve = _serve(gport, f"http://127.0.0.1:{tok_http}", *serve_http)
        stack.enter_context(running(serve, log=tmp_path / "serve.log"))
        wait_for_port(gport, timeout=30)
        wait_for_port(http, timeout=30)
        stack.enter_context(running(route, log=tmp_path / "route.log"))
        wait_for_port(rport, timeout=30)
        # The coordinator answered (its tokenizer did not): ready, and the failure is the tokenizer's.
        _health_when(base, lambda st, h: st == 200, "route ready")
        for h in asyncio.run(_completions(base, 3)):
            assert h["x-kvcoord-prefix-aware"] == "false", h
            assert h["x-kvcoord-reason"].startswith("tokenize_error; least-loaded: "), h["x-kvcoord-reason"]
        m = _metrics(base)
        assert m['kvcoord_route_degraded_total{reason="tokenize_error"}'] == 3, m
        assert m['kvcoord_route_degraded_total{reason="coordinator_unavailable"}'] == 0, m
        assert m["kvcoord_route_coordinator_up"] == 1 and m["kvcoord_route_degraded_mode"] == 0, m
        status, health = _get(f"{base}/health")
        assert status == 200 and health["prefix_aware"] is False, health
        # The tokenizer's engine comes (back): prefix-aware again, by itself.
        stack.enter_context(running(_engine(tok_http, tok_pub), log=tmp_path / "tok-engine.log"))
        wait_for_port(tok_http, timeout=30)
        until(lambda: asyncio.run(_completions(base, 1))[0]["x-kvcoord-prefix-aware"] == "true",
              "prefix-aware placement once the tokenizer answers", timeout=60)
    text = (tmp_path / "route.log").read_text()
    assert text.count("placing its text prompts least-loaded") == 1, text
    assert "coordinator lookups failing" in text and "answering again" in text, text


@pytest.mark.parametrize("over_http", [False, True], ids=["grpc", "http"])
def test_a_refused_token_makes_route_not_ready_with_the_reason(tmp_path: Path, over_http: bool) -> None:
    """``kvcoord route --token wrong`` against a coordinator with tokens: /health answers 503
    ``unauthorized`` naming UNAUTHENTICATED, one ERROR line says so, ``kvcoord_route_ready`` is 0; /live
    still answers. The right token is ready. The same with lookups over HTTP (a 401 there)."""
    bad, good = free_port(), free_port()
    serve_http, route_http = _over_http(over_http)
    tokens = ("--router-token", "rtok", "--agent-token", "atok=node-a", *serve_http)
    with _fleet(tmp_path, serve_extra=tokens) as (_engine_url, gport), \
            running(_route(gport, bad, "--token", "wrong", *route_http), log=tmp_path / "bad.log"), \
            running(_route(gport, good, "--token", "rtok", *route_http), log=tmp_path / "good.log"):
        for port in (bad, good):
            wait_for_port(port, timeout=30)
        status, health = _health_when(f"http://127.0.0.1:{bad}", lambda st, h: h["status"] == "unauthorized",
                                      "the wrong token reported")
        assert status == 503 and "UNAUTHENTICATED" in health["reason"], health
        assert _metrics(f"http://127.0.0.1:{bad}")["kvcoord_route_ready"] == 0
        assert _get(f"http://127.0.0.1:{bad}/live") == (200, {"status": "ok"})
        _health_when(f"http://127.0.0.1:{good}", lambda st, h: st == 200, "the right token ready")
    errors = [line for line in (tmp_path / "bad.log").read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "refuses this router's token (UNAUTHENTICATED" in errors[0], errors
    assert " ERROR " not in (tmp_path / "good.log").read_text()


def test_route_without_a_coordinator_answer_is_not_ready() -> None:
    """A router whose coordinator never answered knows no engine: /health says so (503 "starting")."""
    rport = free_port()
    cmd = kvcoord_cmd("route", "--coordinator", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{rport}",
                      "--model", MODEL, "--timeout", "1")
    with running(cmd, log=None):
        wait_for_port(rport, timeout=30)
        status, health = _health_when(f"http://127.0.0.1:{rport}", lambda st, h: "UNAVAILABLE" in h["reason"],
                                      "the reason")
    assert status == 503 and health["status"] == "starting", health


def test_static_backends_without_a_coordinator_are_ready() -> None:
    rport = free_port()
    cmd = kvcoord_cmd("route", "--policy", "least-loaded", "--backend", "a=http://127.0.0.1:9",
                      "--listen", f"127.0.0.1:{rport}")
    with running(cmd, log=None):
        wait_for_port(rport, timeout=30)
        assert _get(f"http://127.0.0.1:{rport}/health")[0] == 200


