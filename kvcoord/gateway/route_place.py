"""Where ``kvcoord route`` sends a request: the lookup (with its deadline and outage bookkeeping), the
candidates and the policy's choice, as one :class:`Plan` per request.

By default the coordinator tokenizes the prompt or chat as the engine will (lookups by ``prompt`` /
``messages``, see :mod:`kvcoord.tokenize`), so the router needs no tokenizer. With a tokenizer of its own
(``--tokenizer``) the router looks up by token ids and also knows the prompt's blocks, which feeds the
policy's memory of prefixes routed but not yet reported by the engine (a burst sharing a new prefix then
stays on one node). When the coordinator cannot answer in time the router places least-loaded, says so
in a header and a metric, and logs once per outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvcoord.router.answer import Candidate, LookupResult
from kvcoord.router.client import CoordinatorError
from kvcoord.router.http_lookup import LookupClient
from kvcoord.router.placement import Decision, RouteRequest
from kvcoord.router.policy import LeastLoadedPolicy, Policy, place
from kvcoord.tokenize.base import Tokenizer
from kvcoord.tokenize.media import MediaRule
from kvcoord.transport import TOKENIZER_CAUSE

from .outage import Outages, is_outage
from .requests import BadRequest, NotAskable, body_query, tokenize
from .reserve import ReserveStream
from .route_backends import Backends
from .route_metrics import RouteMetrics

__all__ = ["AUTH_REFUSALS", "Placer", "Plan"]

log = logging.getLogger("kvcoord.route")

AUTH_REFUSALS = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
"""Codes that refuse this router's token rather than one request: the router is not ready until a lookup
is answered again."""

@dataclass(slots=True)
class Plan:
    """One request's placement: candidates in play, and how the first pick was made."""

    model: str
    prefix_aware: bool
    reason: str
    """Why the pick was not prefix-aware, a short code such as ``coordinator_unavailable`` (the
    ``kvcoord_route_degraded_total`` label), or the non-index policy; "" when it was."""
    candidates: list[Candidate]
    request: RouteRequest
    best_blocks: int = 0
    lookup_seconds: float = 0.0
    detail: str = ""
    """What went wrong with the lookup, for logs and the 503 body (headers carry ``reason`` only)."""
    policy: Policy | None = None
    """The configured policy when it needs no index; None: prefix-aware if ``prefix_aware``, else
    least-loaded."""
    tried: set[tuple[str, int]] = field(default_factory=set)
    started: float = 0.0
    """``perf_counter()`` when the request arrived."""
    reserve_id: str = ""
    """The id this request's reservation carries (its lookup held its new prefix); "" when none."""
    first: tuple[Decision, Candidate] | None = None
    """A pick made before forwarding began (P/D: the decode node, chosen before the prefill), taken
    as the first attempt."""
    send_headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers for the engine (P/D: the ``X-Request-Id`` shared with the prefill)."""
    answer_headers: dict[str, str] = field(default_factory=dict)
    """Extra response headers (P/D: the prefill pick and the path taken)."""
    remote_prefill: bool = False
    """P/D: a prefill node prefilled, so the decode node pulls the prompt rather than computes it: it
    queues no prefill, and its cached tokens (which count the transfer) are not judged against its
    prediction (the prefill pick's are)."""

    @property
    def judged(self) -> bool:
        """Whether the answering node's cached tokens are judged against its prediction."""
        return self.prefix_aware and not self.remote_prefill

    def remaining(self, backends: Backends) -> list[Candidate]:
        return [c for c in self.candidates if c.key not in self.tried and not backends.is_suspect(c.node_id)]


class Placer:
    """Lookup, candidates, choice. ``client`` is None without a coordinator (static backends only)."""

    def __init__(self, client: LookupClient | None, backends: Backends, policy: Policy,
                 metrics: RouteMetrics, *, clock: Callable[[], float] = time.monotonic,
                 seed: int | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.media = MediaRule()
        """How images lay into the prompt when this router tokenizes (``--image-tokens``)."""
        self.backends = backends
        self.policy = policy
        self.fallback_policy = LeastLoadedPolicy(seed)
        self.metrics = metrics
        self.clock = clock
        self.outages = Outages(log, "placing least-loaded", probe_seconds=0.0, clock=clock)
        """The coordinator as a whole (key ""); every request probes (the lookup deadline bounds it)."""
        self.tokenizer_outages = Outages(log, "placing its text prompts least-loaded", probe_seconds=0.0,
                                         clock=clock)
        """Models whose tokenizer fails behind an answering coordinator (e.g. the one engine whose
        /tokenize it uses is down): their own reason, ``tokenize_error``, and the coordinator stays up."""
        self.refused: CoordinatorError | None = None
        """The coordinator refused this router's token (UNAUTHENTICATED, PERMISSION_DENIED) and has not
        answered a lookup since: ``/health`` reports not ready."""
        self._lookup_errors: set[str] = set()
        self.reserve: ReserveStream | None = None
        """The reservation stream shared with other routers (None: this router places alone)."""

    @property
    def outage_since(self) -> float | None:
        return self.outages.since()

    async def plan(self, model: str, body: dict[str, Any], *, chat: bool) -> Plan:
        """Ask the index (if the policy uses it) and build the candidates; never raises for a coordinator
        problem: that becomes a least-loaded plan with the reason."""
        now = self.clock()
        if not self.policy.uses_index or self.client is None:
            return Plan(model, False, f"policy {self.policy.name}", self.backends.fallback(model),
                        RouteRequest(0, 1, (), now), policy=self.policy)
        try:
            query = body_query(body, chat=chat, batches=False)
        except (BadRequest, NotAskable) as exc:  # a malformed body: the engine will say how, in its words
            self.metrics.degraded.labels("unsupported_prompt").inc()
            return self._degraded(model, "unsupported_prompt", str(exc))
        tokens: list[int] | None = None
        if self.tokenizer is not None:
            try:
                tokens, mm_items = await tokenize(self.tokenizer, query, self.media)
            except ValueError as exc:  # TokenizeError, an invalid chat: the engine will say how
                self.metrics.degraded.labels("tokenize_error").inc()
                return self._degraded(model, "tokenize_error", str(exc))
            salt = {"cache_salt": query["cache_salt"]} if "cache_salt" in query else {}
            query = {"tokens": tokens, **salt, **({"mm_items": mm_items} if mm_items else {})}
        elif query.pop("continue_final_message", False):
            self.metrics.degraded.labels("unsupported_prompt").inc()
            return self._degraded(model, "unsupported_prompt", "the index cannot be asked about "
                                  "continue_final_message")
        t0 = time.perf_counter()
        rid = self.reserve.next_id() if self.reserve is not None else ""
        if rid:
            assert self.reserve is not None
            query.update(router_id=self.reserve.router_id, reserve_id=rid)
        try:
            answer = await self.client.lookup(model, include_unmatched=True, want_block_hashes=True, **query)
        except CoordinatorError as exc:
            self.unreserve(rid)
            return self._failed(model, exc)
        except ValueError as exc:  # the query itself is malformed: the engine will say how
            self.metrics.degraded.labels("lookup_error").inc()
            return self._degraded(model, "lookup_error", str(exc))
        took = time.perf_counter() - t0
        self.metrics.lookup_seconds.observe(took)
        self._answered()
        self.tokenizer_outages.answered(model)
        plan = self._from_answer(model, answer, now, took)
        plan.reserve_id = rid
        return plan

    def _from_answer(self, model: str, answer: LookupResult, now: float, took: float) -> Plan:
        candidates = self.backends.routable(answer.nodes)
        num_tokens = answer.num_tokens or answer.num_blocks * answer.block_size
        request = RouteRequest(num_tokens, max(1, answer.block_size), answer.block_hashes, now)
        if not candidates:
            self.metrics.degraded.labels("no_routable_node").inc()
            plan = self._degraded(model, "no_routable_node", "the lookup named no node with a serving URL")
            plan.request = request
            plan.lookup_seconds = took
            return plan
        best = max(c.matched_blocks for c in candidates)
        return Plan(model, True, "", candidates, request, best, took)

    def reserved(self, plan: Plan, decision: Decision, prefill: int) -> Callable[[], None] | None:
        """Reserve ``decision`` for ``plan`` on the shared stream (the prompt's blocks beyond the index's
        best, the predicted ``prefill`` tokens); returns the release to call at the first byte."""
        stream, rid = self.reserve, plan.reserve_id
        if stream is None or not rid:
            return None
        r = plan.request
        stream.reserve(rid, plan.model, decision.key, min(plan.best_blocks, len(r.block_hashes)),
                       r.block_hashes, prefill)
        return lambda: stream.release(rid, first_byte=True)

    def unreserve(self, rid: str) -> None:
        """The request is over (or never placed): its reservation, or its lookup's hold, ends."""
        if self.reserve is not None and rid:
            self.reserve.release(rid, first_byte=False)

    def _degraded(self, model: str, reason: str, detail: str) -> Plan:
        return Plan(model, False, reason, self.backends.fallback(model),
                    RouteRequest(0, 1, (), self.clock()), detail=detail)

    def _failed(self, model: str, exc: CoordinatorError) -> Plan:
        if exc.cause == TOKENIZER_CAUSE:  # the coordinator answered: its tokenizer for this model failed
            self._answered()
            self.metrics.degraded.labels("tokenize_error").inc()
            self.tokenizer_outages.failed(exc, model)
            return self._degraded(model, "tokenize_error", exc.details or str(exc))
        if is_outage(exc.code):
            deadline = exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            reason = "deadline" if deadline else "coordinator_unavailable"
            self.metrics.degraded.labels(reason).inc()
            if self.outages.failed(exc):
                self.metrics.degraded_now.set(1)
                self.metrics.coordinator_up.set(0)
            return self._degraded(model, reason, exc.details or str(exc))
        self.metrics.degraded.labels("lookup_error").inc()
        key = f"{getattr(exc.code, 'name', exc.code)}"
        if key in AUTH_REFUSALS:
            self.refused = exc
        if key not in self._lookup_errors:
            self._lookup_errors.add(key)
            log.warning("route: lookup refused (%s); such requests are placed least-loaded", exc)
        return self._degraded(model, "lookup_error", str(exc))

    def _answered(self) -> None:
        self._lookup_errors.clear()
        self.refused = None
        if self.outages.answered():
            self.metrics.degraded_now.set(0)
            self.metrics.coordinator_up.set(1)

    def choose(self, plan: Plan) -> tuple[Decision, Candidate] | None:
        """The best candidate not tried yet and not suspect, or None when none is left."""
        if plan.first is not None:
            first, plan.first = plan.first, None
            return first
        left = plan.remaining(self.backends)
        if not left:
            return None
        policy = plan.policy or (self.policy if plan.prefix_aware else self.fallback_policy)
        r = plan.request
        answer = LookupResult(plan.model, r.block_size, r.num_tokens // r.block_size, left, r.num_tokens)
        decision = place(answer, policy, now=r.now, block_hashes=r.block_hashes)
        chosen = next(c for c in left if c.key == decision.key)
        plan.tried.add(decision.key)
        return decision, chosen


def node_label(key: tuple[str, int]) -> str:
    return key[0] if key[1] == 0 else f"{key[0]}/{key[1]}"
