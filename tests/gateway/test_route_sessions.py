"""``kvcoord route``'s session affinity and API keys, as real processes: two sim-engines with their agents,
``kvcoord serve`` and two routers (one with default sessions, one with a short session TTL and
``--api-keys``). A session sticks to its node while prefix scores tie, yields to a clearly better prefix
hit, moves when its node is drained, and is forgotten after the TTL; keys answer 401 and 429 in each
API's error shape, with ``Retry-After``. Every wait is a poll; rate tests count outcomes, not durations."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.procs import kvcoord_cmd
from tests.procs import until_async as _until
from tests.route_fleet import MODEL, RouteFleet, route_fleet
from tests.route_fleet import chat as _chat
from tests.route_fleet import post as _post
from tests.route_fleet import route_metrics as _metrics

pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b")
KEYS = {"keys": [{"name": "open", "key": "sk-open-0123456789"},
                 {"name": "slow", "key": "sk-slow-0123456789", "requests_per_second": 0.001, "burst": 2},
                 {"name": "tok", "key": "sk-tok-0123456789", "tokens_per_minute": 30}]}
KEYED = 1
"""``fleet.routes[KEYED]``: the router with ``--api-keys`` and ``--session-ttl 2``."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouteFleet]:
    """The fleet and two routers: ``route`` (default sessions) and ``routes[KEYED]``."""
    tmp = tmp_path_factory.mktemp("route-sessions")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    common = ("--refresh-interval", "0.3", "--seed", "7")
    with route_fleet(tmp, NODES, engine_args=("--token-interval", "0.01")) as f:
        f.start_route(*common, "--session-bonus-tokens", "16")
        f.start_route(*common, "--session-ttl", "2", "--api-keys", str(tmp / "keys.json"), log="route-keyed")
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


async def test_a_session_sticks_to_its_node_when_prefix_scores_tie(fleet: RouteFleet) -> None:
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


async def test_a_clearly_better_prefix_hit_elsewhere_wins_over_the_session(fleet: RouteFleet) -> None:
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


async def test_a_session_expires_after_its_ttl(fleet: RouteFleet) -> None:
    auth = {"Authorization": "Bearer sk-open-0123456789"}
    async with aiohttp.ClientSession() as s:
        hdr = {**auth, "x-session-id": uuid.uuid4().hex}
        st, _, b = await _turn(s, fleet.routes[KEYED], _fresh(1), hdr)
        assert st == 200, b
        before = await _metrics(s, fleet.routes[KEYED])
        await asyncio.sleep(2.5)  # past the 2 s TTL: later is only more expired
        st, _, b = await _turn(s, fleet.routes[KEYED], _fresh(2), hdr)
        assert st == 200, b
        after = await _metrics(s, fleet.routes[KEYED])
    expired = 'kvcoord_route_sessions_dropped_total{reason="expired"}'
    new = 'kvcoord_route_sessions_total{outcome="new"}'
    assert after[expired] - before.get(expired, 0) == 1
    assert after[new] - before.get(new, 0) == 1


async def test_missing_or_unknown_keys_get_401_in_each_apis_shape(fleet: RouteFleet) -> None:
    msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        before = await _metrics(s, fleet.routes[KEYED])
        async with s.post(f"{fleet.routes[KEYED]}/v1/chat/completions", json=_chat("s", "u")) as r:
            assert r.status == 401
            body = await r.json()
            assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401, body
        messages = f"{fleet.routes[KEYED]}/v1/messages"
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-wrong-000000"}) as r:
            assert r.status == 401
            body = await r.json()
            assert body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid API key"}}, body
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-open-0123456789"}) as r:
            assert r.status == 200, await r.text()
        after = await _metrics(s, fleet.routes[KEYED])
        page = await (await s.get(f"{fleet.routes[KEYED]}/metrics")).text()
    for reason in ("missing", "unknown"):
        name = f'kvcoord_route_auth_failures_total{{reason="{reason}"}}'
        assert after[name] - before.get(name, 0) == 1
    assert "sk-" not in page and "sk-" not in (fleet.tmp / "route-keyed.log").read_text()


async def test_a_key_over_its_request_rate_gets_429_with_retry_after(fleet: RouteFleet) -> None:
    """Burst 2 at one request per 1000 s: of 6 requests, exactly 2 pass."""
    auth = {"Authorization": "Bearer sk-slow-0123456789"}
    statuses, retry = [], []
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            chat = f"{fleet.routes[KEYED]}/v1/chat/completions"
            async with s.post(chat, json=_chat("s", f"u{i}"), headers=auth) as r:
                statuses.append(r.status)
                if r.status == 429:
                    body = await r.json()
                    assert body["error"]["type"] == "RateLimitError", body
                    retry.append(int(r.headers["Retry-After"]))
        msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        messages = f"{fleet.routes[KEYED]}/v1/messages"
        async with s.post(messages, json=msg, headers={"x-api-key": "sk-slow-0123456789"}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        after = await _metrics(s, fleet.routes[KEYED])
    assert sorted(statuses) == [200, 200, 429, 429, 429, 429], statuses
    assert all(r >= 1 for r in retry)
    assert after['kvcoord_route_key_requests_total{key="slow",outcome="admitted"}'] == 2
    assert after['kvcoord_route_key_requests_total{key="slow",outcome="rate_limited"}'] == 5


async def test_a_key_over_its_tokens_per_minute_gets_429(fleet: RouteFleet) -> None:
    """30 tokens a minute: the first request (over 30 tokens) is admitted and charged, the next waits."""
    auth = {"Authorization": "Bearer sk-tok-0123456789"}
    async with aiohttp.ClientSession() as s:
        long = _chat("a system prompt of some length " * 20, "u")
        st, _, b = await _turn(s, fleet.routes[KEYED], long, auth)
        assert st == 200, b
        st, h, b = await _turn(s, fleet.routes[KEYED], _chat("s", "u"), auth)
        assert st == 429 and int(h["Retry-After"]) >= 1, b
        after = await _metrics(s, fleet.routes[KEYED])
    assert after['kvcoord_route_key_tokens_total{key="tok"}'] > 30


async def test_a_session_moves_when_its_node_is_drained(fleet: RouteFleet) -> None:
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
