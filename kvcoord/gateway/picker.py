"""The endpoint picker's decision: an OpenAI request body in, an ordered list of ``ip:port`` out.

Per request: the body's prompt or chat goes to the coordinator's lookup (which tokenizes it as the engine
will, and answers every live node of the model with its match, load and serving URL); nodes without a
known address, outside the data plane's subset hint, or saturated are left out; the placement policy
(:func:`kvcoord.router.policy.place`) picks one; the others follow as fallbacks, cheapest first.

Endpoints are ``host:port`` of the engine's serving URL (its agent announces it to the coordinator) or
a static ``--backend NODE=ADDR:PORT``, which wins; with the pool's ``targetPorts`` given, data-parallel rank
``r`` of a node is that host at ``targetPorts[r]`` (rank = port, as the reference picker's datastore makes
one endpoint per pod and target port), so the pick is per rank. The node table refreshed from ``ListNodes``
(:mod:`kvcoord.gateway.nodes`) keeps them for picks that need no lookup (requests without a body) and
for degraded picks: when the coordinator fails or is slow (:mod:`kvcoord.gateway.outage`), the pick is
least-loaded over the last known nodes, and says so.

Saturation (the 429 of the protocol): a node is saturated when its in-flight requests (the larger of
what its engine reports and the streams this picker has open on it) reach ``max_in_flight``, or its
queue reaches ``max_waiting``; a request whose every eligible node is saturated is shed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate, LookupResult
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError, NodeStatus
from kvcoord.router.placement import Decision, LatencyModel, RouteRequest
from kvcoord.router.policy import LeastLoadedPolicy, Policy, PrefixAwarePolicy, make_policy, place

from .disagg import PdConfig, pools_of, prefill_remote
from .flow import NO_ENDPOINTS, SATURATED
from .nodes import InFlight, NodeTable
from .outage import Outages, is_outage
from .requests import BadRequest
from .reserve import DEFAULT_TTL, ReserveStream
from .route_metrics import predicted_tokens

__all__ = ["Allowed", "EndpointTable", "Pick", "PickFailed", "Picker", "PickerConfig", "endpoint_of_url"]

log = logging.getLogger("kvcoord.gateway.epp")


class PickFailed(Exception):
    """The request cannot be placed: ``status`` is the HTTP status the proxy answers with, ``reason`` a
    short token for metrics and Envoy's response details."""

    def __init__(self, status: int, reason: str, message: str, dropped: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.dropped = dropped
        """llm-d's ``x-llm-d-request-dropped-reason`` (:mod:`kvcoord.gateway.flow`), empty for none."""


# --- endpoints -----------------------------------------------------------------------------------
def endpoint_of_url(url: str) -> str | None:
    """``host:port`` of an engine URL (``http://10.0.0.5:8000/v1`` → ``10.0.0.5:8000``; the scheme's
    default port when none is given); ``None`` when it has no host."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class EndpointTable(NodeTable):
    """The shared node table, with each node's endpoint: ``ip:port`` as Envoy's ``original_dst`` cluster
    needs (a serving URL naming a host is resolved: first address, cached until the next refresh)."""

    def __init__(self, static: Mapping[str, str], target_ports: Sequence[int] = ()) -> None:
        super().__init__(static, log)
        self.target_ports = tuple(target_ports)
        """The InferencePool's ``targetPorts``: rank ``r`` listens on ``target_ports[r]`` (empty: every
        rank of a node shares its one address)."""
        self._resolved: dict[str, str] = {}

    async def endpoint(self, node_id: str, serving_url: str, dp_rank: int = 0) -> str | None:
        """``ip:port`` of ``(node_id, dp_rank)``; ``None`` when the node has no address, or the rank no
        target port."""
        address = await self._address(node_id, serving_url)
        if address is None or not self.target_ports:
            return address
        if dp_rank >= len(self.target_ports):
            log.debug("node %s: dp rank %d has no target port (%d given)", node_id, dp_rank,
                      len(self.target_ports))
            return None
        return f"{address.rpartition(':')[0]}:{self.target_ports[dp_rank]}"

    async def _address(self, node_id: str, serving_url: str) -> str | None:
        if node_id in self.static:
            return self.static[node_id]
        if not serving_url:
            known = self.nodes.get(node_id)
            serving_url = known.serving_url if known is not None else ""
        ep = endpoint_of_url(serving_url) if serving_url else None
        if ep is None:
            return None
        host, _, port = ep.rpartition(":")
        if _is_ip(host):
            return ep
        if ep not in self._resolved:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("node %s: cannot resolve %s: %s", node_id, host, exc)
                return None
            addr = str(infos[0][4][0])
            self._resolved[ep] = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        return self._resolved[ep]

    def update(self, nodes: Iterable[NodeStatus]) -> None:
        super().update(nodes)
        self._resolved.clear()


# --- the pick ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PickerConfig:
    static_backends: Mapping[str, str] = field(default_factory=dict)
    policy: str = "prefix-aware"
    degraded: str = "discount"
    """How prefix-aware counts nodes in trust state ``degraded``: one of ``DEGRADED_MODES``."""
    latency: LatencyModel | None = None
    """The prefix-aware policy's cost model (None: :class:`LatencyModel`'s defaults)."""
    fallbacks: int = 0
    """Endpoints after the pick in the comma separated list (a data plane that walks the list tries them
    in order on retry). 0, as the reference picker sends: several gateways read one ``ip:port`` only."""
    target_ports: tuple[int, ...] = ()
    """The InferencePool's ``targetPorts``, rank ``r`` on ``target_ports[r]`` (see :class:`EndpointTable`)."""
    max_in_flight: int = 0
    """0: no limit."""
    max_waiting: int = 0
    """0: no limit."""
    seed: int | None = None
    reserve: bool = True
    """Share picks with the coordinator's other routers (:mod:`kvcoord.gateway.reserve`)."""
    reserve_ttl: float = DEFAULT_TTL
    pd: PdConfig = field(default_factory=PdConfig)
    """Disaggregated pools by flags, else by the nodes' roles: the pick is a decode node, a prefill
    endpoint is named when one is due (:mod:`kvcoord.gateway.disagg`)."""


@dataclass(frozen=True, slots=True)
class Pick:
    endpoints: list[str]
    """The pick first, then the fallbacks; distinct ``ip:port``."""
    node_id: str
    why: str
    prefix_aware: bool
    matched_blocks: int = 0
    reserve_id: str = ""
    """The id its reservation carries (released at the response's headers and at the stream's end)."""
    pull: str = ""
    """``host:port`` of a peer the engine should pull a longer prefix from (``KV_SOURCE_HEADER``); "" none."""
    scores: Mapping[str, float] = field(default_factory=dict)
    """Every endpoint scored for this pick, in [0, 1], 1 the best (``--emit-endpoint-scores``)."""
    hit: tuple[int, int, int, int] | None = None
    """Prefix-aware picks: blocks the pick holds, blocks the best node holds, the block size and the
    prompt's tokens, as :meth:`kvcoord.gateway.route_metrics.DecisionMetrics.predicted` takes them."""
    prefiller: str = ""
    """P/D: the prefill endpoint ``ip:port`` for llm-d's ``x-prefiller-host-port``; "" when none."""


@dataclass(frozen=True, slots=True)
class Allowed:
    """The endpoints a request may go to, and who said so (for the 503's message). An entry ``ip:port``
    allows that endpoint, a bare IP every port of it, as the reference picker matches both the subset hint
    and the conformance suite's ``test-epp-endpoint-selection`` header; an entry that is neither matches
    nothing. ``entries`` None: any endpoint; ``rank``: only that data-parallel rank's (a request pinning
    its ``data_parallel_rank``, see :meth:`pinned`)."""

    entries: frozenset[str] | None
    source: str
    rank: int | None = None

    def allows(self, endpoint: str, rank: int = 0) -> bool:
        if self.rank is not None and rank != self.rank:
            return False
        if self.entries is None:
            return True
        host = endpoint.rpartition(":")[0]
        return bool({endpoint, host, host.strip("[]")} & self.entries)

    @staticmethod
    def pinned(allowed: Allowed | None, rank: int) -> Allowed:
        """``allowed`` (None: any endpoint) narrowed to data-parallel rank ``rank``."""
        where = f"data_parallel_rank {rank}"
        if allowed is None:
            return Allowed(None, where, rank)
        return Allowed(allowed.entries, f"{allowed.source} and {where}", rank)


@dataclass(slots=True)
class _Eligible:
    candidate: Candidate
    endpoint: str


class Picker:
    """One per ``kvcoord epp``: the coordinator client, the endpoint table, the policy and the streams
    this picker has open per endpoint."""

    def __init__(self, client: AsyncCoordinatorClient, config: PickerConfig) -> None:
        self.client = client
        self.config = config
        self.table = EndpointTable(config.static_backends, config.target_ports)
        self.policy: Policy = make_policy(config.policy, config.seed, degraded=config.degraded,
                                           latency=config.latency)
        self.fallback_policy = LeastLoadedPolicy(config.seed)
        self.in_flight: InFlight[str] = InFlight()
        """Streams picked to each endpoint and not yet ended (the in-flight count the engine may not show)."""
        self.outages = Outages(log, "picking least-loaded from the last known nodes", probe_seconds=1.0)
        """Models whose lookups fail (coordinator down or slow, their tokenizer down)."""
        self._refused: set[str] = set()
        """Models the coordinator has no profile or tokenizer for (warned once each)."""
        self.reserve = (ReserveStream(client, log, ttl=config.reserve_ttl)
                        if config.reserve and self.policy.uses_index else None)
        """The reservation stream shared with other routers (None: this picker places alone)."""

    async def refresh(self) -> bool:
        """Reload the endpoint table from ``ListNodes``; False when that failed (the table is kept)."""
        return await self.table.refresh(self.client)

    def _saturated(self, load: NodeLoad) -> bool:
        cfg = self.config
        return bool((cfg.max_in_flight and load.in_flight >= cfg.max_in_flight)
                    or (cfg.max_waiting and load.waiting_requests >= cfg.max_waiting))

    async def _eligible(self, candidates: Sequence[Candidate], allowed: Allowed | None) -> list[_Eligible]:
        """Candidates (one per node and rank) with an endpoint, inside ``allowed``, each with its load
        adjusted; raises 503."""
        out: list[_Eligible] = []
        for c in candidates:
            endpoint = await self.table.endpoint(c.node_id, c.serving_url, c.dp_rank)
            if endpoint is None:
                log.debug("node %s rank %d has no known endpoint (no serving URL, no --backend, no target "
                          "port)", c.node_id, c.dp_rank)
                continue
            if allowed is not None and not allowed.allows(endpoint, c.dp_rank):
                continue
            load = self.in_flight.merged(endpoint, c.load, c.reserved)
            out.append(_Eligible(replace(c, load=load), endpoint))
        if not out:
            where = f"in {allowed.source}" if allowed is not None else "with a known address"
            raise PickFailed(503, "no_endpoint",
                             f"no eligible endpoint {where} ({len(candidates)} nodes known)", NO_ENDPOINTS)
        return out

    def _unsaturated(self, eligible: list[_Eligible]) -> list[_Eligible]:
        free = [e for e in eligible if not self._saturated(e.candidate.load)]
        if not free:
            cfg = self.config
            raise PickFailed(429, "shed", f"all {len(eligible)} eligible endpoints are saturated "
                                          f"(max in flight {cfg.max_in_flight or '-'}, "
                                          f"max waiting {cfg.max_waiting or '-'})", SATURATED)
        return free

    def _ordered(self, chosen: _Eligible, rest: list[_Eligible], request: RouteRequest) -> list[str]:
        """The pick, then up to ``fallbacks`` other endpoints, cheapest first."""
        policy = self.policy
        if isinstance(policy, PrefixAwarePolicy):
            k = policy.weight(request, [e.candidate for e in (*rest, chosen)])
            rest = sorted(rest, key=lambda e: (policy.cost(request, e.candidate, k), e.candidate.key))
        else:
            rest = sorted(rest, key=lambda e: (-e.candidate.matched_blocks, e.candidate.load.in_flight,
                                               e.candidate.key))
        out = [chosen.endpoint]
        for e in rest:
            if len(out) > self.config.fallbacks:
                break
            if e.endpoint not in out:
                out.append(e.endpoint)
        return out

    def _decide(self, answer: LookupResult, eligible: list[_Eligible], policy: Policy,
                slo: float | None = None) -> tuple[Decision, list[str], dict[str, float], str]:
        """The policy's choice among the unsaturated (and, with a TTFT ``slo`` in seconds, those predicted
        to meet it, while any does); returns it, the endpoints in order, every scored endpoint's score, and
        a note on the SLO for the reason."""
        free = self._unsaturated(eligible)
        num_tokens = answer.num_tokens or answer.num_blocks * answer.block_size
        request = RouteRequest(num_tokens, max(1, answer.block_size))
        free, note = _within_slo(free, request, policy, slo)
        by_key = {e.candidate.key: e for e in free}
        view = LookupResult(answer.model, answer.block_size, answer.num_blocks,
                            [e.candidate for e in free], answer.num_tokens, answer.block_hashes)
        decision = place(view, policy, now=time.monotonic())
        chosen = by_key[decision.key]
        rest = [e for e in free if e is not chosen]
        return decision, self._ordered(chosen, rest, request), _scores(free, request, policy), note

    async def pick(self, model: str, query: Mapping[str, Any], subset: Allowed | None,
                   slo: float | None = None) -> Pick:
        """Place one request (the body's model and lookup keywords; ``slo`` its TTFT SLO in seconds)."""
        outage = self.outages.waiting(model)
        if outage is not None:
            return await self._degraded(model, subset, f"coordinator {outage.error}")
        if query.get("continue_final_message"):
            return await self._degraded(model, subset, "continue_final_message (the index cannot be asked)")
        rid = self.reserve.next_id() if self.reserve is not None else ""
        try:
            pick = await self._pick(model, query, subset, rid, slo)
        except BaseException:
            self.unreserve(rid)  # no pick: its lookup's hold ends now
            raise
        if not pick.reserve_id:
            self.unreserve(rid)
        return pick

    def unreserve(self, rid: str, *, first_byte: bool = False) -> None:
        """The request's response began (``first_byte``) or ended: its reservation is released."""
        if self.reserve is not None and rid:
            self.reserve.release(rid, first_byte=first_byte)

    async def _pick(self, model: str, query: Mapping[str, Any], subset: Allowed | None, rid: str,
                    slo: float | None) -> Pick:
        if rid:
            assert self.reserve is not None
            query = {**query, "router_id": self.reserve.router_id, "reserve_id": rid}
        try:
            answer = await self.client.lookup(model, include_unmatched=True, want_block_hashes=True, **query)
        except CoordinatorError as exc:
            code = getattr(exc.code, "name", "")
            if code == "INVALID_ARGUMENT":
                raise BadRequest(f"the coordinator refused the prompt: {exc.details}") from None
            if not is_outage(exc.code):  # refused (no profile or tokenizer, a token): nothing to wait for
                if model not in self._refused:
                    self._refused.add(model)
                    log.warning("model %s: the coordinator cannot look it up (%s): picked least-loaded",
                                model, exc)
                return await self._degraded(model, subset, f"coordinator {exc}")
            self.outages.failed(exc, model)
            return await self._degraded(model, subset, f"coordinator {exc}")
        except ValueError as exc:  # refused before sending (build_lookup_request)
            raise BadRequest(str(exc)) from None
        self.outages.answered(model)
        for c in answer.nodes:  # known from now on, for degraded picks even before ListNodes names it
            self.table.learn(c.node_id, c.serving_url, model, (c.dp_rank,), {c.dp_rank: c.load},
                             answered=True)
        eligible = await self._eligible([*answer.nodes, *self._unlisted(model, answer)], subset)
        pd = self._pd(model)
        eligible, prefill_pool = self._pools(pd, eligible)
        decision, endpoints, scores, note = self._decide(answer, eligible, self.policy, slo)
        if rid:
            assert self.reserve is not None
            best = min(max((c.matched_blocks for c in answer.nodes), default=0), len(answer.block_hashes))
            tokens = answer.num_tokens or answer.num_blocks * answer.block_size
            prefill = max(0, tokens - decision.matched_blocks * max(1, answer.block_size))
            self.reserve.reserve(rid, model, decision.key, best, answer.block_hashes, prefill)
        return Pick(endpoints, decision.node_id, decision.why + note, True, decision.matched_blocks, rid,
                    decision.pull, scores, _hit(decision.matched_blocks, answer),
                    self._prefiller(pd, answer, decision.matched_blocks, prefill_pool))

    def _pd(self, model: str | None) -> PdConfig | None:
        """The P/D pools of ``model``'s requests now: the flags', else the nodes' roles; None: one engine."""
        return pools_of(self.config.pd, self.table.roles(model))

    @staticmethod
    def _pools(pd: PdConfig | None, eligible: list[_Eligible]) -> tuple[list[_Eligible], list[_Eligible]]:
        """P/D: the decode pool (where the pick goes; 503 when empty) and the prefill pool."""
        if pd is None:
            return eligible, []
        decode = [e for e in eligible if e.candidate.node_id in pd.decode]
        if not decode:
            raise PickFailed(503, "no_endpoint", f"no eligible decode endpoint ({len(eligible)} others)",
                             NO_ENDPOINTS)
        return decode, [e for e in eligible if e.candidate.node_id in pd.prefill]

    def _prefiller(self, pd: PdConfig | None, answer: LookupResult, decode_blocks: int,
                   pool: list[_Eligible]) -> str:
        """The prefill endpoint, by prefix and load, when the decode pick lacks more of the prompt than
        it prefills alone; "" otherwise, or when every prefill endpoint is saturated."""
        if pd is None or not pool:
            return ""
        bs, tokens = max(1, answer.block_size), answer.num_tokens or answer.num_blocks * answer.block_size
        if not prefill_remote(pd, tokens - predicted_tokens(decode_blocks, bs, tokens), True):
            return ""
        try:
            return self._decide(answer, pool, self.policy)[1][0]
        except PickFailed:  # the decode side prefills locally
            return ""

    def _unlisted(self, model: str, answer: LookupResult) -> list[Candidate]:
        """Nodes listed as serving that lookups leave out (resyncing after a reconnect, a hash mismatch;
        static backends the coordinator does not know), as holding nothing."""
        return self.table.candidates(model, exclude=[c.node_id for c in answer.nodes], ever=False)

    async def _degraded(self, model: str | None, subset: Allowed | None, reason: str | None) -> Pick:
        """Least-loaded over the last known nodes (no prefix information): lookup failed, or no body."""
        eligible, _ = self._pools(self._pd(model), await self._eligible(self.table.candidates(model), subset))
        answer = LookupResult(model or "", 1, 0, [e.candidate for e in eligible])
        decision, endpoints, scores, _ = self._decide(answer, eligible, self.fallback_policy)
        why = decision.why if reason is None else f"{decision.why}; not prefix-aware: {reason}"
        return Pick(endpoints, decision.node_id, why, False, scores=scores)

    async def pick_without_body(self, subset: Allowed | None) -> Pick:
        """A request with no body (``GET /v1/models``): least-loaded of every known node."""
        return await self._degraded(None, subset, None)

    async def pick_unaskable(self, model: str | None, subset: Allowed | None, reason: str) -> Pick:
        """A request the index cannot be asked about (``reason``): least-loaded over ``model``'s nodes
        (every known node for ``None``), saying why."""
        return await self._degraded(model, subset, reason)


def _within_slo(free: list[_Eligible], request: RouteRequest, policy: Policy,
                slo: float | None) -> tuple[list[_Eligible], str]:
    """The candidates predicted to meet a TTFT SLO (:meth:`PrefixAwarePolicy.ttft`), all of them when none
    does (best effort, as llm-d's latency scorer falls back to negative headroom)."""
    if slo is None or not isinstance(policy, PrefixAwarePolicy):
        return free, ""
    meets = [e for e in free if policy.ttft(request, e.candidate) <= slo]
    if not meets:
        return free, f"; no endpoint meets the TTFT SLO of {slo * 1000:g} ms (best effort)"
    if len(meets) == len(free):
        return free, ""
    return meets, f"; TTFT SLO {slo * 1000:g} ms left out {len(free) - len(meets)}"


def _scores(free: list[_Eligible], request: RouteRequest, policy: Policy) -> dict[str, float]:
    """Per endpoint, in [0, 1]: the cheapest predicted TTFT over this one's (prefix-aware), else
    ``1 / (1 + in flight)``; an endpoint with several ranks keeps its best."""
    if isinstance(policy, PrefixAwarePolicy):
        k = policy.weight(request, [e.candidate for e in free])
        costs = {id(e): policy.cost(request, e.candidate, k) for e in free}
        best = min(costs.values(), default=0.0)
        raw = {id(e): (best / c if c > 0 else 1.0) for e, c in ((e, costs[id(e)]) for e in free)}
    else:
        raw = {id(e): 1.0 / (1 + e.candidate.load.in_flight) for e in free}
    out: dict[str, float] = {}
    for e in free:
        out[e.endpoint] = round(max(out.get(e.endpoint, 0.0), raw[id(e)]), 6)
    return out


def _hit(matched_blocks: int, answer: LookupResult) -> tuple[int, int, int, int]:
    best = max((c.matched_blocks for c in answer.nodes), default=0)
    return matched_blocks, best, answer.block_size, answer.num_tokens or answer.num_blocks * answer.block_size
