"""The session prior's rules on real policy objects (the end-to-end behaviour is in
tests/gateway/test_route_sessions.py): ties go to the session's node, a busy node or a clearly better hit
elsewhere wins over it, entries expire and the cap evicts the least recently used."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcoord.gateway.route_backends import Backends
from kvcoord.gateway.route_place import Plan
from kvcoord.gateway.sessions import SessionConfig, Sessions
from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate
from kvcoord.router.placement import RouteRequest
from kvcoord.router.policy import PrefixAwarePolicy

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _plan(*candidates: Candidate) -> Plan:
    request = RouteRequest(100 * BLOCK, BLOCK, tuple(range(100)), 0.0)
    return Plan("m", True, "", list(candidates), request, max(c.matched_blocks for c in candidates))


def _sessions(clock: Clock, **kw: float) -> Sessions:
    return Sessions(SessionConfig(**kw), CollectorRegistry(), clock=clock)  # type: ignore[arg-type]


def test_ties_go_to_the_sessions_node_and_a_busy_node_or_better_hit_wins_over_it() -> None:
    clock, policy, backends = Clock(), PrefixAwarePolicy(seed=1), Backends()
    s = _sessions(clock, bonus_tokens=64)
    s.served("conv", ("b", 0))
    picked = s.prefer(_plan(Candidate("a"), Candidate("b")), policy, backends, "conv")
    assert picked is not None and picked[0].key == ("b", 0) and "session affinity" in picked[0].why
    busy = Candidate("b", load=NodeLoad(running_requests=40))
    assert s.prefer(_plan(Candidate("a"), busy), policy, backends, "conv") is None
    better = Candidate("a", matched_blocks=50, tiers=(50,))
    assert s.prefer(_plan(better, Candidate("b")), policy, backends, "conv") is None
    slightly = Candidate("a", matched_blocks=2, tiers=(2,))  # 32 tokens better: within the 64-token bonus
    picked = s.prefer(_plan(slightly, Candidate("b")), policy, backends, "conv")
    assert picked is not None and picked[0].key == ("b", 0)
    assert s.prefer(_plan(Candidate("a"), Candidate("c")), policy, backends, "conv") is None  # b is gone


def test_entries_expire_after_the_ttl_and_the_cap_evicts_the_least_recent() -> None:
    clock, policy, backends = Clock(), PrefixAwarePolicy(seed=1), Backends()
    s = _sessions(clock, ttl=10.0, max_sessions=2)
    s.served("one", ("a", 0))
    clock.now = 11.0
    assert s.prefer(_plan(Candidate("a"), Candidate("b")), policy, backends, "one") is None
    assert s.dropped.labels("expired")._value.get() == 1
    for sid in ("x", "y", "z"):
        s.served(sid, ("a", 0))
    assert s.dropped.labels("evicted")._value.get() == 1
    assert s.prefer(_plan(Candidate("a"), Candidate("b")), policy, backends, "x") is None
    assert s.prefer(_plan(Candidate("a"), Candidate("b")), policy, backends, "z") is not None
    s.served("z", ("b", 0))
    assert s.outcomes.labels("moved")._value.get() == 1
    assert s.outcomes.labels("new")._value.get() == 4


def test_the_session_id_comes_from_headers_first_then_the_body() -> None:
    s = _sessions(Clock())
    assert s.session_id({"x-claude-code-session-id": "cc", "session_id": "codex"}, {}) == "cc"
    assert s.session_id({"session-id": "codex"}, {"prompt_cache_key": "k"}) == "codex"
    assert s.session_id({}, {"prompt_cache_key": "k"}) == "pck:k"
    legacy = {"metadata": {"user_id": "user_abc_account_def_session_57a1"}}
    assert s.session_id({}, legacy) == "57a1"
    assert s.session_id({}, {"metadata": {"user_id": '{"device_id": "d", "session_id": "54c1"}'}}) == "54c1"
    assert s.session_id({}, {"metadata": {"user_id": "{broken"}}) == ""
    assert s.session_id({"x-session-id": "x" * 1000}, {}) == "x" * 256
    assert _sessions(Clock(), ttl=0.0).session_id({"x-session-id": "a"}, {}) == ""
