"""Session affinity for ``kvcoord route``: a soft prior toward the node that served a session last.

Agent clients name their conversation in a header: ``x-session-id`` (the generic one; OpenRouter and
several gateways read it), Claude Code's ``x-claude-code-session-id`` (since v2.1.86), Codex CLI's
``session-id`` / ``session_id`` and ``conversation_id``, and ``x-session-affinity``. The first one present
keys the session (:data:`SESSION_HEADERS`, in that order). Without one, the body may name it: OpenAI's
``prompt_cache_key`` (a cache-routing hint by definition; Codex sets it to its conversation id), or older
Claude Code's ``metadata.user_id`` (``..._session_<uuid>``, or JSON with ``session_id``).

The prior sits *under* prefix scoring: the prefix-aware policy's cost (expected TTFT, seconds) decides,
and the session's last node is taken instead of the cheapest one only when its cost is within a bonus
of the best (``bonus_tokens`` of prefill, in the policy's own units) and it is under the policy's balance
cap. So a tie (every node holds the shared system prompt, or nothing) goes to the session's node, a
clearly better prefix hit elsewhere or an overloaded node wins over the prior, and a node gone from the
candidates (removed, drained, failed) simply loses its sessions to the policy's choice. Nodes that join
get new sessions through the policy's load term, and take old ones when the old node's queue costs more
than the bonus. Bounded memory: at most ``max_sessions`` entries, least recently used evicted first, each
forgotten ``ttl`` seconds after its last request.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvcoord.index.base import NodeKey
from kvcoord.router.answer import Candidate
from kvcoord.router.placement import Decision
from kvcoord.router.policy import PrefixAwarePolicy, reserved_as_held

from .route_backends import Backends
from .route_place import Plan, node_label

__all__ = ["SESSION_HEADERS", "SessionConfig", "Sessions"]

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id", "conversation_id",
                   "x-session-affinity")
"""Request headers naming a session, most specific first."""
MAX_ID_CHARS = 256
"""Longer session ids are cut (memory per entry stays bounded whatever a client sends)."""


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """``--session-ttl``, ``--max-sessions``, ``--session-bonus-tokens``; ``ttl`` 0 turns affinity off."""

    ttl: float = 600.0
    max_sessions: int = 100_000
    bonus_tokens: int = 512


class Sessions:
    """Which node served each session last; :meth:`prefer` proposes it, :meth:`served` records it."""

    def __init__(self, config: SessionConfig, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._last: OrderedDict[str, tuple[NodeKey, float]] = OrderedDict()
        self.outcomes = Counter("kvcoord_route_sessions", "Requests naming a session, by what their "
                                "placement did: hit (its last node again), moved (another node), new "
                                "(no live entry: first turn or expired).", ["outcome"], registry=registry)
        self.dropped = Counter("kvcoord_route_sessions_dropped", "Session entries forgotten, by reason "
                               "(expired after the TTL, evicted by the cap).", ["reason"], registry=registry)
        self.size = Gauge("kvcoord_route_sessions_known", "Sessions remembered now.", registry=registry)

    @property
    def enabled(self) -> bool:
        return self.config.ttl > 0 and self.config.max_sessions > 0

    def session_id(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        """The request's session id ("" when it names none, or affinity is off)."""
        if not self.enabled:
            return ""
        for name in SESSION_HEADERS:
            value = headers.get(name, "").strip()
            if value:
                return value[:MAX_ID_CHARS]
        return _body_session(body)[:MAX_ID_CHARS]

    def _node(self, sid: str) -> NodeKey | None:
        entry = self._last.get(sid)
        if entry is None:
            return None
        if self.clock() - entry[1] > self.config.ttl:
            del self._last[sid]
            self.dropped.labels("expired").inc()
            self.size.set(len(self._last))
            return None
        return entry[0]

    def prefer(self, plan: Plan, policy: object, backends: Backends,
               sid: str) -> tuple[Decision, Candidate] | None:
        """The session's last node as the first pick, when the prior may decide (see the module
        docstring); None leaves the choice to the policy."""
        if not sid or plan.first is not None or not plan.prefix_aware or plan.policy is not None \
                or not isinstance(policy, PrefixAwarePolicy):
            return None
        key = self._node(sid)
        left = plan.remaining(backends)
        if key is None or not left:
            return None
        held, _ = reserved_as_held(left)
        mine = next((c for c in held if c.key == key), None)
        if mine is None:
            return None
        cap = policy.balance_cap(held)
        if mine.load.in_flight > cap:
            return None
        r = plan.request
        k = policy.weight(r, held)
        best = min(policy.cost(r, c, k) for c in held if c.load.in_flight <= cap)
        bonus = k * policy.latency.prefill_s_per_token * self.config.bonus_tokens
        extra = policy.cost(r, mine, k) - best
        if extra > bonus:
            return None
        decision = policy.choose(r, [next(c for c in left if c.key == key)])
        why = (f"{decision.why}; session affinity: stays on {node_label(key)} "
               f"(+{max(0.0, extra) * 1e3:.1f} ms over the cheapest, bonus {bonus * 1e3:.1f} ms)")
        plan.tried.add(key)
        return replace(decision, why=why), next(c for c in left if c.key == key)

    def served(self, sid: str, key: NodeKey) -> None:
        """The session's request was answered by ``key``: remember it (most recently used)."""
        if not sid:
            return
        before = self._node(sid)
        self.outcomes.labels("new" if before is None else "hit" if before == key else "moved").inc()
        self._last[sid] = (key, self.clock())
        self._last.move_to_end(sid)
        while len(self._last) > self.config.max_sessions:
            self._last.popitem(last=False)
            self.dropped.labels("evicted").inc()
        self.size.set(len(self._last))


def _body_session(body: Mapping[str, Any]) -> str:
    """``prompt_cache_key``, else Claude Code's session in ``metadata.user_id`` (both of its formats)."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key.strip():
        return f"pck:{key.strip()}"
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(user, str):
        return ""
    if user.startswith("{"):
        try:
            parsed = json.loads(user)
        except ValueError:
            return ""
        sid = parsed.get("session_id") if isinstance(parsed, dict) else None
        return sid if isinstance(sid, str) else ""
    _, found, sid = user.rpartition("_session_")
    return sid if found else ""
