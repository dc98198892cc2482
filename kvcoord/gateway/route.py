"""``kvcoord route``: an OpenAI-compatible HTTP proxy that places each request by prefix.

Per request: the coordinator tokenizes the prompt or chat as the engine will and answers which nodes hold
how much of it (:mod:`kvcoord.gateway.route_place`); the prefix-aware policy picks one, weighing tier, load
and the requests this router already has in flight (:mod:`kvcoord.gateway.route_backends`); the request is
forwarded and the answer streamed back event by event (:mod:`kvcoord.gateway.route_sse`). Response
headers say where it went and why; ``/metrics`` has the decision-quality figures
(:mod:`kvcoord.gateway.route_metrics`).

Faults: a connect failure or a 5xx before the first byte is retried on the next-best node; a backend
that dies mid-stream ends that stream with an SSE error event; either leaves the node out until its
``/health`` answers. A coordinator that is down or slower than the deadline turns placement into
least-loaded, visibly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvcoord.coordinator.httpd import HttpLimits
from kvcoord.index.base import NodeKey
from kvcoord.router.answer import KV_SOURCE_HEADER, Candidate
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.router.http_lookup import HttpLookupClient, LookupClient
from kvcoord.router.http_pool import HttpConn, HttpPools, ReadTimeout
from kvcoord.router.placement import Decision, LatencyModel
from kvcoord.router.policy import make_policy
from kvcoord.tokenize.media import MediaRule
from kvcoord.transport import ChannelSecurity, ListenError, split_hostport

from .apis import API, API_PATHS, ENDPOINT_API, as_lookup_body, error_body
from .disagg import PdConfig
from .keys import ApiKey, Keys, Refused
from .listener import GuardedSite
from .nodes import Prefill
from .requests import BadRequest, json_object
from .reserve import DEFAULT_TTL, ReserveStream
from .route_backends import Backends
from .route_http import (
    Client,
    covered,
    encoded,
    header_safe,
    if_available,
    upstream_body,
    upstream_headers,
    with_media_ids,
)
from .route_metrics import RouteMetrics, predicted_tokens
from .route_pd import PdRouter
from .route_place import Placer, Plan, node_label
from .route_ready import Readiness
from .route_sse import ChunkedOut, SseRelay, error_event, relay_events
from .sessions import SessionConfig, Sessions

__all__ = ["RouteConfig", "RouteServer", "serve_route"]

log = logging.getLogger("kvcoord.route")


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """``kvcoord route``'s flags, typed."""

    coordinator: str | None
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    coordinator_http: str | None = None
    """The coordinator's HTTP API (``--http-listen``): lookups go there (:mod:`kvcoord.router.http_lookup`),
    the rest over gRPC; None: everything over gRPC."""
    listen: str = "127.0.0.1:8000"
    backends: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None
    """Model for requests that name none (and the model whose nodes ``/v1/models`` lists first)."""
    deadline_ms: float = 50.0
    policy: str = "prefix-aware"
    degraded: str = "discount"
    """How prefix-aware counts nodes in trust state ``degraded``: one of ``DEGRADED_MODES``."""
    latency: LatencyModel | None = None
    """The prefix-aware policy's cost model (None: :class:`LatencyModel`'s defaults)."""
    rpc_timeout: float = 5.0
    refresh_interval: float = 2.0
    """Seconds between ListNodes calls (serving URLs, loads, which nodes are live)."""
    connect_timeout: float = 2.0
    read_timeout: float | None = 300.0
    """Seconds an engine may owe answer bytes and send none (stopped mid-answer, or hung before its head)
    before the attempt fails: a stream ends with an error event, an unanswered request is answered 504
    and not sent elsewhere (the engine may still run it) (None: no bound; 300 s is Envoy's
    ``stream_idle_timeout``)."""
    health_interval: float = 0.5
    """Seconds between ``/health`` probes of a node left out after a failure."""
    max_attempts: int = 3
    seed: int | None = None
    limits: HttpLimits = field(default_factory=HttpLimits)
    """What one client may hold of the listener (header timeout and size, connections)."""
    tokenizer: str | None = None
    """The engines' tokenizer (a local directory, or an engine URL for its /tokenize): the router then
    looks up by token ids and remembers the blocks it routed (see :mod:`kvcoord.gateway.route_place`)."""
    media: MediaRule = field(default_factory=MediaRule)
    """How images lay into the prompt when the router tokenizes (``--image-tokens``, ``--image-placeholder``;
    :mod:`kvcoord.tokenize.media`)."""
    reserve: bool = True
    """Share picks with the other routers of the coordinator (:mod:`kvcoord.gateway.reserve`)."""
    reserve_ttl: float = DEFAULT_TTL
    pd: PdConfig = field(default_factory=PdConfig)
    """Disaggregated prefill and decode pools by flags, else by the nodes' roles
    (:mod:`kvcoord.gateway.route_pd`); neither: one engine per request."""
    sessions: SessionConfig = field(default_factory=SessionConfig)
    """Session affinity (:mod:`kvcoord.gateway.sessions`)."""
    api_keys: Mapping[bytes, ApiKey] = field(default_factory=dict)
    """``--api-keys``' keys by secret digest (:mod:`kvcoord.gateway.keys`); empty: no key asked."""


def _openai_error(status: int, message: str, kind: str = "BadRequestError",
                  api: API = "openai") -> web.Response:
    return web.json_response(error_body(api, status, message, kind), status=status)


@dataclass(slots=True)
class _Attempt:
    """One forwarding of a request: where, what was predicted, what happened."""

    decision: Decision
    chosen: Candidate
    predicted: int = 0
    outcome: str = ""
    usage: dict[str, Any] | None = None
    """The answer's usage, when read (rate limits charge it)."""


class RouteServer:
    """The proxy. :meth:`start` listens and starts the background refresh; :meth:`close` stops it all."""

    def __init__(self, config: RouteConfig) -> None:
        self.config = config
        self.metrics = RouteMetrics()
        self.sessions = Sessions(config.sessions, self.metrics.registry)
        self.keys = Keys(config.api_keys, self.metrics.registry)
        self.backends = Backends(config.backends)
        self.client = (AsyncCoordinatorClient(config.coordinator, security=config.security,
                                              timeout=config.deadline_ms / 1000.0)
                       if config.coordinator else None)
        self.rpc = (AsyncCoordinatorClient(config.coordinator, security=config.security,
                                           timeout=config.rpc_timeout) if config.coordinator else None)
        self.lookups: LookupClient | None = self.client
        if self.client is not None and config.coordinator_http:
            self.lookups = HttpLookupClient(config.coordinator_http, self.client,
                                            timeout=config.deadline_ms / 1000.0)
        policy = make_policy(config.policy, config.seed, degraded=config.degraded, latency=config.latency)
        self.placer = Placer(self.lookups, self.backends, policy, self.metrics, seed=config.seed)
        self.placer.media = config.media
        if self.client is not None and policy.uses_index and config.reserve:
            self.placer.reserve = ReserveStream(self.client, log, ttl=config.reserve_ttl,
                                                on_change=lambda up: self.metrics.shared_view.set(int(up)))
        self.readiness = Readiness(self.lookups, self.placer, self._models, timeout=config.rpc_timeout,
                                   pause=min(1.0, config.refresh_interval))
        latency = getattr(policy, "latency", None)
        self._prefill_s_per_token = latency.prefill_s_per_token if isinstance(latency, LatencyModel) else 0.0
        """How long a placed prompt counts as queued prefill at most (see :class:`Prefill`)."""
        self.upstreams = HttpPools(connect_timeout=config.connect_timeout, read_timeout=config.read_timeout)
        """The engines' connections requests are forwarded on (aiohttp's client: probes and /v1/models)."""
        self.pd = PdRouter(config.pd, self.placer, self.backends, self.metrics, upstreams=self.upstreams,
                           max_attempts=config.max_attempts, fail=self._fail)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path, endpoint in API_PATHS.items():
            app.router.add_post(path, functools.partial(self._proxy, endpoint=endpoint))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    async def start(self) -> None:
        """Listen on ``config.listen``; :class:`ListenError` (one line) when it cannot, ``TokenizeError``
        when ``--tokenizer`` cannot be opened."""
        if self.config.tokenizer:
            from kvcoord.tokenize import open_tokenizer

            name, source = self.config.model or "default", self.config.tokenizer
            self.placer.tokenizer = await asyncio.to_thread(open_tokenizer, name, source)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None,
                                                                            connect=self.config.connect_timeout))
        host, port = split_hostport(self.config.listen)
        head = self.config.limits.max_header_bytes  # one line or field may be the whole head
        runner = web.AppRunner(self.app(), shutdown_timeout=1.0, access_log=None, handle_signals=False,
                               max_line_size=head, max_field_size=head,
                               keepalive_timeout=self.config.limits.idle_timeout)
        await runner.setup()
        try:
            await GuardedSite(runner, host or None, port, self.config.limits, self.metrics.registry).start()
        except OSError as exc:
            await runner.cleanup()
            await self._session.close()
            raise ListenError(f"cannot listen on {self.config.listen}: {exc.strerror or exc}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1]) if runner.addresses else port
        if self.rpc is not None:
            await self.refresh()
            self._tasks.append(asyncio.create_task(self.backends.table.run(self.rpc,
                                                                           self.config.refresh_interval)))
        if self.placer.reserve is not None:
            self._tasks.append(asyncio.create_task(self.placer.reserve.run()))
        self._tasks.append(asyncio.create_task(self._health_loop()))
        self._tasks.append(asyncio.create_task(self.readiness.run()))
        log.info("route: OpenAI-compatible API on http://%s:%d (coordinator %s, policy %s, %d static "
                 "backends)",
                 host or "0.0.0.0", self.port, self.config.coordinator or "none"
                 + (f", lookups over {self.config.coordinator_http}" if self.config.coordinator_http else ""),
                 self.config.policy,
                 len(self.config.backends))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
        self.upstreams.close()
        if isinstance(self.lookups, HttpLookupClient):
            await self.lookups.close()
        for client in (self.client, self.rpc):
            if client is not None:
                await client.close()
        if self.placer.tokenizer is not None:
            await self.placer.tokenizer.aclose()

    # ------------------------------------------------------------------ background
    async def refresh(self) -> None:
        """One ListNodes: serving URLs, loads and liveness of every node (static URLs win)."""
        assert self.rpc is not None
        await self.backends.table.refresh(self.rpc)

    async def _health_loop(self) -> None:
        """Probe suspect nodes' ``/health``; a 200 brings a node back."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            for node_id in list(self.backends.suspect()):
                if await self._healthy(self.backends.url(node_id)) and self.backends.mark_healthy(node_id):
                    self.metrics.suspect.labels(node_id).set(0)
                    log.info("route: %s answers /health again; routing to it", node_id)

    async def _healthy(self, url: str) -> bool:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout)
            async with self._session.get(f"{url}/health", timeout=timeout) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def _fail(self, node_id: str, kind: str, detail: str) -> None:
        self.metrics.backend_failures.labels(node_id, kind).inc()
        if self.backends.mark_failed(node_id, f"{kind}: {detail}"):
            self.metrics.suspect.labels(node_id).set(1)
            log.warning("route: %s failed (%s: %s); leaving it out until its /health answers",
                        node_id, kind, detail)

    # ------------------------------------------------------------------ endpoints
    def _models(self) -> list[str]:
        """The models this router serves: ``--model`` and every model ListNodes names now."""
        listed = {n.model for n in self.backends.table.nodes.values() if n.listed and n.model}
        return sorted(listed | ({self.config.model} if self.config.model else set()))

    async def health(self, request: web.Request) -> web.Response:
        """200 when ready, else 503 with the reason (:mod:`kvcoord.gateway.route_ready`)."""
        ready, status, reason = self.readiness.state()
        self.metrics.ready.set(1 if ready else 0)
        policy = self.placer.policy
        latency = getattr(policy, "latency", None)  # the cost model it decides with, in its flags' units
        prefix_aware = self.placer.outage_since is None and not self.placer.tokenizer_outages
        return web.json_response({"status": status, "reason": reason, "prefix_aware": prefix_aware,
                                  "policy": policy.name, "degraded": getattr(policy, "degraded", None),
                                  "latency": latency.flags() if isinstance(latency, LatencyModel) else None,
                                  "warm": sorted(self.readiness.warm), "shared_view": self._shared_view(),
                                  "backends": self.backends.urls(), "suspect": self.backends.suspect()},
                                 status=200 if ready else 503)

    def _shared_view(self) -> dict[str, Any]:
        """Whether this router's picks reach the other routers (its reservation stream is open)."""
        stream = self.placer.reserve
        if stream is None:
            return {"up": False,
                    "reason": "off (--no-reserve, no coordinator, or a policy without the index)"}
        return {"up": stream.up, "reason": stream.reason, "router_id": stream.router_id,
                "unsent": stream.dropped}

    async def live(self, request: web.Request) -> web.Response:
        """200 while the process serves (a liveness probe): readiness is ``/health``'s."""
        return web.json_response({"status": "ok"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        for key, n in self.backends.in_flight().items():
            self.metrics.in_flight.labels(node_label(key)).set(n)
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        """The union of the healthy backends' ``/v1/models`` (first answer per model id)."""
        assert self._session is not None
        urls = [u for n, u in self.backends.urls().items() if not self.backends.is_suspect(n)]

        async def one(url: str) -> list[Any]:
            try:
                async with self._session.get(f"{url}/v1/models",  # type: ignore[union-attr]
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    data = await r.json(content_type=None) if r.status == 200 else {}
            except (TimeoutError, aiohttp.ClientError, ValueError):
                return []
            items = data.get("data") if isinstance(data, dict) else None
            return items if isinstance(items, list) else []

        seen: dict[str, Any] = {}
        for items in await asyncio.gather(*(one(u) for u in urls)):
            for card in items:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    seen.setdefault(card["id"], card)
        if not seen and not urls:
            return _openai_error(503, "no backend known yet", "ServiceUnavailableError")
        return web.json_response({"object": "list", "data": list(seen.values())})

    # ------------------------------------------------------------------ proxying
    async def _proxy(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        api = ENDPOINT_API[endpoint]
        try:
            key = self.keys.admit(request.headers)
        except Refused as exc:
            outcome = "unauthorized" if exc.status == 401 else "rate_limited"
            self.metrics.requests.labels(endpoint, outcome).inc()
            return web.json_response(error_body(api, exc.status, exc.message, exc.kind), status=exc.status,
                                     headers=exc.headers)
        raw = await request.read()
        try:
            body = json_object(raw)
            if (tagged := with_media_ids(endpoint, body)) is not None:
                body, raw = tagged, encoded(tagged)
            shaped, chat = as_lookup_body(endpoint, body)
        except BadRequest as exc:
            self.metrics.requests.labels(endpoint, "bad_request").inc()
            return _openai_error(400, exc.message, api=api)
        model = body.get("model") or self.config.model or ""
        if not isinstance(model, str) or (not model and self.placer.policy.uses_index):
            self.metrics.requests.labels(endpoint, "bad_request").inc()
            return _openai_error(400, "the request names no model (and kvcoord route has no --model)",
                                 api=api)
        plan = await self.placer.plan(model, dict(shaped), chat=chat)
        plan.started = t0
        if if_available(request):
            plan.candidates = covered(plan)
            if not plan.candidates:
                self.placer.unreserve(plan.reserve_id)
                self.metrics.requests.labels(endpoint, "not_cached").inc()
                return _openai_error(412, "Prefer: if-available: no node holds this prompt's prefix "
                                     f"({plan.reason or 'not cached'})", "PreconditionFailed", api=api)
        openai = endpoint in ("completions", "chat")  # the others' streams carry usage unasked
        headers = upstream_headers(request, strip_keys=self.keys.enabled)
        client = Client(self.sessions.session_id(request.headers, body), key)
        try:
            pools = self.pd.pools(plan.model)
            if pools is not None:  # vLLM's disaggregated protocol is its OpenAI API's: others go whole
                staged = await self.pd.stage(pools, plan, body, request.path, headers, remote=openai)
                if isinstance(staged, web.Response):
                    self.metrics.requests.labels(endpoint, "upstream_error").inc()
                    return staged
                if staged is not body:
                    body, raw = staged, encoded(staged)
            payload, strip_usage = upstream_body(raw, body) if openai else (raw, False)
            resp = await self._attempts(request, endpoint, plan, payload, strip_usage, t0, headers, client)
        finally:
            self.placer.unreserve(plan.reserve_id)
        self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return resp

    async def _attempts(self, request: web.Request, endpoint: str, plan: Plan, payload: bytes,
                        strip_usage: bool, t0: float, headers: dict[str, str],
                        client: Client) -> web.StreamResponse:
        path = request.path
        headers = {**headers, **plan.send_headers}
        attempts = 0
        while attempts < self.config.max_attempts:
            picked = (self.sessions.prefer(plan, self.placer.policy, self.backends, client.session)
                      if attempts == 0 else None) or self.placer.choose(plan)
            if picked is None:
                break
            attempts += 1
            attempt = _Attempt(*picked)
            r = plan.request
            if plan.prefix_aware:
                blocks = attempt.chosen.matched_blocks
                attempt.predicted = predicted_tokens(blocks, r.block_size, r.num_tokens)
            self.metrics.overhead_seconds.observe(time.perf_counter() - t0 - plan.lookup_seconds)
            try:
                resp = await self._forward(request, plan, attempt, path, headers, payload, strip_usage,
                                           attempts)
            except ReadTimeout as exc:  # it has the request and may still be at it: not sent again
                node = attempt.decision.node_id
                self._fail(node, "timeout", str(exc))
                self.metrics.requests.labels(endpoint, "upstream_timeout").inc()
                return _openai_error(504, f"kvcoord route: backend {node} took the request and sent no "
                                     f"answer ({exc}); not sent elsewhere, as it may still be running there",
                                     "GatewayTimeoutError", api=ENDPOINT_API[endpoint])
            if resp is not None:
                self.metrics.requests.labels(endpoint, attempt.outcome).inc()
                if attempt.outcome == "ok":
                    self.sessions.served(client.session, attempt.decision.key)
                self.keys.charge(client.key, attempt.usage, r.num_tokens)
                if plan.judged:  # the answering node's prediction, once per request
                    self.metrics.predicted(attempt.chosen.matched_blocks, plan.best_blocks, r.block_size,
                                           r.num_tokens)
                return resp
        self.metrics.requests.labels(endpoint, "no_backend").inc()
        why = f"{plan.reason}: {plan.detail}" if plan.detail else plan.reason or "no routable node"
        return _openai_error(503, f"kvcoord route: no backend could take the request for model "
                             f"{plan.model!r} after {attempts} attempts ({why})", "ServiceUnavailableError",
                             api=ENDPOINT_API[endpoint])

    def _route_headers(self, plan: Plan, attempt: _Attempt, attempts: int) -> dict[str, str]:
        d, c = attempt.decision, attempt.chosen
        out = {"x-kvcoord-node": node_label(d.key), "x-kvcoord-prefix-aware": "true" if plan.prefix_aware
               else "false", "x-kvcoord-reason": header_safe(d.why if plan.prefix_aware or plan.policy
                                                             else f"{plan.reason}; {d.why}"),
               "x-kvcoord-attempts": str(attempts)}
        if d.pull:
            out[KV_SOURCE_HEADER] = d.pull
        if plan.prefix_aware:
            out.update({"x-kvcoord-matched-blocks": str(c.matched_blocks),
                        "x-kvcoord-predicted-cached-tokens": str(attempt.predicted),
                        "x-kvcoord-best-blocks": str(plan.best_blocks)})
        out.update(plan.answer_headers)
        return out

    async def _forward(self, request: web.Request, plan: Plan, attempt: _Attempt, path: str,
                       headers: dict[str, str], payload: bytes, strip_usage: bool,
                       attempts: int) -> web.StreamResponse | None:
        """Send to the chosen node; None means "try the next one" (nothing reached the client yet)."""
        key, node_id = attempt.decision.key, attempt.decision.node_id
        # Prefill this adds to the node's queue, as the policy saw it (its memory of in-flight placements
        # included); ``predicted`` stays the index's view, which is what the quality metrics judge.
        r = plan.request
        prefill = 0 if plan.remote_prefill else max(0, r.num_tokens - predicted_tokens(
            attempt.decision.matched_blocks, r.block_size, r.num_tokens))
        send = dict(headers)
        if attempt.decision.pull:  # llm-d's peer-pull source (an inbound value is never passed on)
            send[KV_SOURCE_HEADER] = attempt.decision.pull
        if self.backends.multi_rank(node_id):
            send["X-data-parallel-rank"] = str(key[1])
        queued = self.backends.begin(key, prefill, self._prefill_s_per_token,
                                     self.placer.reserved(plan, attempt.decision, prefill))
        self.metrics.placements.labels(node_label(key), str(plan.prefix_aware).lower()).inc()
        try:
            try:
                upstream = await self.upstreams.request(attempt.chosen.serving_url, path, payload, send)
            except ReadTimeout:
                raise
            except (TimeoutError, OSError) as exc:
                self._fail(node_id, "connect", f"{type(exc).__name__}: {exc}")
                self.metrics.retries.labels("connect").inc()
                return None
            try:
                if upstream.status >= 500:
                    with contextlib.suppress(TimeoutError, OSError):
                        await upstream.read()
                    self._fail(node_id, "status_5xx", f"HTTP {upstream.status}")
                    self.metrics.retries.labels("status_5xx").inc()
                    return None
                self.metrics.first_byte_seconds.observe(time.perf_counter() - plan.started)
                route_headers = self._route_headers(plan, attempt, attempts)
                ctype = upstream.headers.get("content-type", "")
                if ctype.partition(";")[0].strip().lower() == "text/event-stream":
                    return await self._relay_stream(request, plan, attempt, upstream, route_headers,
                                                    strip_usage, queued)
                return await self._relay_whole(plan, attempt, upstream, route_headers, queued)
            finally:
                upstream.release()  # kept alive when its answer ended, else closed (the engine sees it end)
        finally:
            queued.done()  # a failed attempt's prompt is not queued there any more either
            self.backends.end(key)

    async def _relay_whole(self, plan: Plan, attempt: _Attempt, upstream: HttpConn,
                           route_headers: dict[str, str],
                           queued: Prefill[NodeKey]) -> web.StreamResponse | None:
        try:
            data = await upstream.read()
        except ReadTimeout:
            raise
        except (TimeoutError, OSError) as exc:
            self._fail(attempt.decision.node_id, "connect", f"{type(exc).__name__}: {exc}")
            self.metrics.retries.labels("connect").inc()
            return None
        queued.done()
        attempt.outcome = "ok" if upstream.status < 400 else "upstream_error"
        if (plan.judged or self.keys.enabled) and upstream.status == 200:
            usage = None
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                obj = json.loads(data)
                usage = obj.get("usage") if isinstance(obj, dict) else None
            attempt.usage = usage if isinstance(usage, dict) else None
            if plan.judged:
                self.metrics.achieved(attempt.predicted, attempt.usage)
        ctype = upstream.headers.get("content-type", "application/json")
        return web.Response(body=data, status=upstream.status,
                            headers={"Content-Type": ctype, **route_headers})

    async def _relay_stream(self, request: web.Request, plan: Plan, attempt: _Attempt,
                            upstream: HttpConn, route_headers: dict[str, str],
                            strip_usage: bool, queued: Prefill[NodeKey]) -> web.StreamResponse:
        node_id = attempt.decision.node_id
        resp = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache", **route_headers})
        out = ChunkedOut(request, resp)
        await resp.prepare(request)
        relay = SseRelay(strip_usage=strip_usage)
        attempt.outcome = "ok" if upstream.status < 400 else "upstream_error"
        try:
            await relay_events(upstream, out, relay, queued.done)
        except ConnectionResetError:  # the client went away: so does the upstream request
            attempt.outcome = "client_gone"
            return resp
        except (TimeoutError, OSError) as exc:  # the engine's connection failed (ConnectionError)
            if not out.held:  # [DONE] already came: the answer is whole, only the connection's end was lost
                attempt.outcome = "midstream_failure"
                self._fail(node_id, "midstream", f"{type(exc).__name__}: {exc}")
                out.held = error_event(f"kvcoord route: backend {node_id} failed mid-stream "
                                   f"({type(exc).__name__}); the answer is incomplete")
        attempt.usage = relay.usage
        if plan.judged and upstream.status == 200 and attempt.outcome == "ok":
            self.metrics.achieved(attempt.predicted, relay.usage)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof(out.held)
        return resp


async def serve_route(config: RouteConfig, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set."""
    server = RouteServer(config)
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.close()
