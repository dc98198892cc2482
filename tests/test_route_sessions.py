"""``kvcoord route``'s session affinity and API keys, as real processes: two sim-engines with their agents,
``kvcoord serve`` and two routers (one with default sessions, one with a short session TTL and
``--api-keys``). A session sticks to its node while prefix scores tie, yields to a clearly better prefix
hit, moves when its node is drained, and is forgotten after the TTL; keys answer 401 and 429 in each
API's error shape, with ``Retry-After``. Every wait is a poll; rate tests count outcomes, not durations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port
from tests.test_route import _chat, _metrics, _post, _until

pytestmark = pytest.mark.slow

MODEL = "sim-model"
BLOCK = 8
PROFILE = ("--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BLOCK))
NODES = ("node-a", "node-b")
KEYS = {"keys": [{"name": "open", "key": "sk-open-0123456789"},
                 {"name": "slow", "key": "sk-slow-0123456789", "requests_per_second": 0.001, "burst": 2},
                 {"name": "tok", "key": "sk-tok-0123456789", "tokens_per_minute": 30}]}


@dataclass
class Fleet:
    tmp: Path
    gport: int
    route: str
    keyed: str
    """The router with ``--api-keys`` and ``--session-ttl 2``."""
    engines: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("route-sessions")
    rport, kport = free_port(), free_port()
    f = Fleet(tmp, free_port(), f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{kport}")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    with contextlib.ExitStack() as stack:
        pubs = {}
        for node in NODES:
            http, pub = free_port(), free_port_pair()
            pubs[node] = pub
            f.engines[node] = f"http://127.0.0.1:{http}"
            cmd = kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}",
                              "--replay-bind", f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE,
                              "--http-listen", f"127.0.0.1:{http}", "--rate", "0", "--requests", "0",
                              "--token-interval", "0.01", "--num-blocks", "4096")
            stack.enter_context(running(cmd, log=tmp / f"{node}.log"))
        for node in NODES:
            wait_for_port(int(f.engines[node].rsplit(":", 1)[1]), timeout=60)
        tok = f.engines[NODES[0]]
        serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{f.gport}", "--metrics-listen", "",
                            "--model", f"{MODEL},algo=sha256_cbor,block_size={BLOCK},seed=0,tokenizer={tok}")
        stack.enter_context(running(serve, log=tmp / "serve.log"))
        wait_for_port(f.gport, timeout=60)
        for node in NODES:
            cmd = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{f.gport}", "--node-id", node,
                              "--model", MODEL, "--zmq-endpoint", f"tcp://127.0.0.1:{pubs[node]}",
                              "--replay-endpoint", f"tcp://127.0.0.1:{pubs[node] + 1}",
                              "--serving-url", f.engines[node])
            stack.enter_context(running(cmd, log=tmp / f"agent-{node}.log"))
        common = ("--coordinator", f"127.0.0.1:{f.gport}", "--model", MODEL, "--deadline-ms", "2000",
                  "--refresh-interval", "0.3", "--seed", "7")
        stack.enter_context(running(kvcoord_cmd("route", *common, "--listen", f"127.0.0.1:{rport}",
                                                "--session-bonus-tokens", "16"), log=tmp / "route.log"))
        stack.enter_context(running(kvcoord_cmd("route", *common, "--listen", f"127.0.0.1:{kport}",
                                                "--session-ttl", "2", "--api-keys", str(tmp / "keys.json")),
                                    log=tmp / "route-keyed.log"))
        wait_for_port(rport, timeout=60)
        wait_for_port(kport, timeout=60)
        yield f


async def _turn(s: aiohttp.ClientSession, base: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[int, Any, Any]:
    async with s.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers, await resp.json(content_type=None)


def _fresh(turn: int) -> dict[str, Any]:
    """A prompt no node holds (a tie on prefix scores)."""
    return _chat(f"{uuid.uuid4().hex} fresh conversation {turn} " * 4, f"turn {turn}")


async def _both_listed(s: aiohttp.ClientSession, base: str) -> None:
    """Both nodes are candidates of a lookup (the agents have registered)."""
    seen: set[str] = set()

    async def listed() -> bool:
        st, h, b = await _post(s, f"{base}/v1/chat/completions", _fresh(0))
        assert st == 200, b
        seen.add(h["x-kvcoord-node"])
        return h["x-kvcoord-prefix-aware"] == "true" and seen == set(NODES)

    await _until(listed, "both nodes to take requests", timeout=90)


async def test_a_session_sticks_to_its_node_when_prefix_scores_tie(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as s:
        await _both_listed(s, fleet.route)
        before = await _metrics(s, fleet.route)
        for sid_header in ("x-session-id", "x-claude-code-session-id", "session_id"):
            hdr = {sid_header: uuid.uuid4().hex}
            nodes, reasons = [], []
            for turn in range(6):
                st, h, b = await _turn(s, fleet.route, _fresh(turn), hdr)
                assert st == 200, b
                nodes.append(h["x-kvcoord-node"])
                reasons.append(h["x-kvcoord-reason"])
            assert len(set(nodes)) == 1, (sid_header, nodes, reasons)
            assert all("session affinity" in r for r in reasons[1:]), reasons
        after = await _metrics(s, fleet.route)
    hit, new = 'kvcoord_route_sessions_total{outcome="hit"}', 'kvcoord_route_sessions_total{outcome="new"}'
    assert after[hit] - before.get(hit, 0) == 15
    assert after[new] - before.get(new, 0) == 3


async def test_a_clearly_better_prefix_hit_elsewhere_wins_over_the_session(fleet: Fleet) -> None:
    system = "A long shared instruction block that one node will hold in its cache. " * 20
    async with aiohttp.ClientSession() as s:
        await _both_listed(s, fleet.route)

        async def held() -> str:
            st, h, b = await _post(s, f"{fleet.route}/v1/chat/completions", _chat(system, "warm"))
            assert st == 200, b
            return h["x-kvcoord-node"] if int(h.get("x-kvcoord-matched-blocks", "0")) >= 20 else ""

        holder = await _until(held, "the index to hold the long prefix")
        for _ in range(40):  # a session whose last node is the other one (ties go either way)
            hdr = {"x-session-id": uuid.uuid4().hex}
            st, h, b = await _turn(s, fleet.route, _fresh(1), hdr)
            assert st == 200, b
            if h["x-kvcoord-node"] != holder:
                break
        else:
            raise AssertionError("no session started on the other node")
        st, h, b = await _turn(s, fleet.route, _chat(system, "a question in the session"), hdr)
        assert st == 200, b
        assert h["x-kvcoord-node"] == holder, h["x-kvcoord-reason"]
        assert "session affinity" not in h["x-kvcoord-reason"]


async def test_a_session_expires_after_its_ttl(fleet: Fleet) -> None:
    auth = {"Authorization": "Bearer sk-open-0123456789"}
    async with aiohttp.ClientSession() as s:
        hdr = {**auth, "x-session-id": uuid.uuid4().hex}
        st, _, b = await _turn(s, fleet.keyed, _fresh(1), hdr)
        assert st == 200, b
        before = await _metrics(s, fleet.keyed)
        await asyncio.sleep(2.5)  # past the 2 s TTL: later is only more expired
        st, _, b = await _turn(s, fleet.keyed, _fresh(2), hdr)
        assert st == 200, b
        after = await _metrics(s, fleet.keyed)
    expired = 'kvcoord_route_sessions_dropped_total{reason="expired"}'
    new = 'kvcoord_route_sessions_total{outcome="new"}'
    assert after[expired] - before.get(expired, 0) == 1
    assert after[new] - before.get(new, 0) == 1


async def test_missing_or_unknown_keys_get_401_in_each_apis_shape(fleet: Fleet) -> None:
    msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        before = await _metrics(s, fleet.keyed)
        async with s.post(f"{fleet.keyed}/v1/chat/completions", json=_chat("s", "u")) as r:
            assert r.status == 401
            body = await r.json()
            assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401, body
        messages = f"{fleet.keyed}/v1/messages"
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-wrong-000000"}) as r:
            assert r.status == 401
            body = await r.json()
            assert body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid API key"}}, body
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-open-0123456789"}) as r:
            assert r.status == 200, await r.text()
        after = await _metrics(s, fleet.keyed)
        page = await (await s.get(f"{fleet.keyed}/metrics")).text()
    for reason in ("missing", "unknown"):
        name = f'kvcoord_route_auth_failures_total{{reason="{reason}"}}'
        assert after[name] - before.get(name, 0) == 1
    assert "sk-" not in page and "sk-" not in (fleet.tmp / "route-keyed.log").read_text()


async def test_a_key_over_its_request_rate_gets_429_with_retry_after(fleet: Fleet) -> None:
    """Burst 2 at one request per 1000 s: of 6 requests, exactly 2 pass."""
    auth = {"Authorization": "Bearer sk-slow-0123456789"}
    statuses, retry = [], []
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            chat = f"{fleet.keyed}/v1/chat/completions"
            async with s.post(chat, json=_chat("s", f"u{i}"), headers=auth) as r:
                statuses.append(r.status)
                if r.status == 429:
                    body = await r.json()
                    assert body["error"]["type"] == "RateLimitError", body
                    retry.append(int(r.headers["Retry-After"]))
        msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        messages = f"{fleet.keyed}/v1/messages"
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-slow-0123456789"}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        after = await _metrics(s, fleet.keyed)
    assert sorted(statuses) == [200, 200, 429, 429, 429, 429], statuses
    assert all(r >= 1 for r in retry)
    assert after['kvcoord_route_key_requests_total{key="slow",outcome="admitted"}'] == 2
    assert after['kvcoord_route_key_requests_total{key="slow",outcome="rate_limited"}'] == 5


async def test_a_key_over_its_tokens_per_minute_gets_429(fleet: Fleet) -> None:
    """30 tokens a minute: the first request (over 30 tokens) is admitted and charged, the next waits."""
    auth = {"Authorization": "Bearer sk-tok-0123456789"}
    async with aiohttp.ClientSession() as s:
        st, _, b = await _turn(s, fleet.keyed, _chat("a system prompt of some length " * 20, "u"), auth)
        assert st == 200, b
        st, h, b = await _turn(s, fleet.keyed, _chat("s", "u"), auth)
        assert st == 429 and int(h["Retry-After"]) >= 1, b
        after = await _metrics(s, fleet.keyed)
    assert after['kvcoord_route_key_tokens_total{key="tok"}'] > 30


async def test_a_session_moves_when_its_node_is_drained(fleet: Fleet) -> None:
    """Last: it drains a node (and undrains it)."""
    async with aiohttp.ClientSession() as s:
        await _both_listed(s, fleet.route)
        hdr = {"x-session-id": uuid.uuid4().hex}
        st, h, b = await _turn(s, fleet.route, _fresh(1), hdr)
        assert st == 200, b
        first = h["x-kvcoord-node"]
        before = await _metrics(s, fleet.route)
        drain = kvcoord_cmd("drain", first, "--coordinator", f"127.0.0.1:{fleet.gport}")
        out = subprocess.run(drain, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        try:
            async def moved() -> bool:
                st, h, b = await _turn(s, fleet.route, _fresh(2), hdr)
                assert st == 200, b
                return bool(h["x-kvcoord-node"] != first)

            await _until(moved, "the session to leave the drained node")
            nodes = []
            for turn in range(3, 6):  # and stick to its new node
                st, h, b = await _turn(s, fleet.route, _fresh(turn), hdr)
                nodes.append(h["x-kvcoord-node"])
            assert len(set(nodes)) == 1 and first not in nodes, nodes
        finally:
            subprocess.run([*drain, "--undrain"], capture_output=True, timeout=60, check=False)
        after = await _metrics(s, fleet.route)
    moved_n = 'kvcoord_route_sessions_total{outcome="moved"}'
    assert after[moved_n] - before.get(moved_n, 0) >= 1


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file"),
    ("{not json", "not JSON"),
    ('{"keys": []}', "expected"),
    ('{"keys": [{"name": "a", "key": "short"}]}', "at least 8"),
    ('{"keys": [{"name": "a", "key": "sk-0123456789", "requests_per_second": -1}]}', "positive number"),
    ('{"keys": [{"name": "a", "key": "sk-0123456789"}, {"name": "a", "key": "sk-9876543210"}]}', "twice"),
    ('{"keys": [{"name": "a", "key": "sk-0123456789", "rpm": 3}]}', "unknown field"),
])
def test_bad_key_files_are_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    out = subprocess.run(kvcoord_cmd("route", "--coordinator", "127.0.0.1:1", "--api-keys", str(path)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "sk-" not in out.stderr


@pytest.mark.parametrize("flag", [["--session-ttl", "-1"], ["--max-sessions", "0"],
                                  ["--session-bonus-tokens", "x"]])
def test_bad_session_flags_are_one_line(flag: list[str]) -> None:
    out = subprocess.run(kvcoord_cmd("route", "--coordinator", "127.0.0.1:1", *flag),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
