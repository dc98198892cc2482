"""``kvcoord epp``: a Gateway API Inference Extension endpoint picker, an Envoy ``ext_proc`` v3 server.

Envoy opens one bidirectional ``Process`` stream per HTTP request. With the request body ``BUFFERED``
it sends the request headers (answered at once, unchanged), then the whole body (answered with the pick:
the ``x-gateway-destination-endpoint`` header mutation, ``clear_route_cache`` and the ``envoy.lb``
dynamic metadata), then the trailers if it forwards them. With ``FULL_DUPLEX_STREAMED`` (the mode the
reference picker uses) the headers answer waits for the whole body (a gRPC request's: its one message),
which is then sent back unchanged as a streamed body. A request without a body is placed on its headers.
The ``:path`` says what the body is: an OpenAI, Anthropic or Responses JSON body
(:func:`kvcoord.gateway.apis.query_of_body`), or, with ``content-type: application/grpc``, a vLLM or
SGLang ``Generate`` (:mod:`kvcoord.gateway.grpc_body`). Whatever cannot be placed ends at the proxy with an
ImmediateResponse, in the request's own error shape: 400 for a body that does not read, 413 for one cut
short by Envoy's buffer, 503 when no endpoint is eligible, 429 when every eligible endpoint is saturated.

``grpc.health.v1`` answers for ``""``, ``liveness``, ``readiness`` and the ext_proc service name, as the
protocol's health section defines them, and ``inference-extension`` (the name the reference deployment
probes): ready once the endpoint table was loaded (or static backends given). ``--health-listen`` adds a
plaintext health-only port for kubelet probes when ext_proc is served over TLS. Prometheus counters on
``--metrics-listen``.

``--conformance`` turns on the conformance suite's hooks as the reference picker has them: the
``test-epp-endpoint-selection`` request header restricts the pick (it wins over the subset hint), the pick
is echoed through the suite's echo server, and the response headers answer sets
``x-conformance-test-served-endpoint`` to the served endpoint the data plane reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvcoord.gateway import extproc as xp
from kvcoord.gateway.apis import ENDPOINT_API, endpoint_of_path, query_of_body
from kvcoord.gateway.disagg import PREFILLER_HEADER
from kvcoord.gateway.flow import DROPPED_HEADER, Dropped, FlowControl, RequestMeta, request_meta
from kvcoord.gateway.grpc_body import (
    ENCODING_HEADER,
    MODEL_HEADER,
    GrpcUsage,
    is_grpc,
    message_ready,
    read_generate,
)
from kvcoord.gateway.leader import FileLeader
from kvcoord.gateway.picker import Allowed, Pick, Picker, PickerConfig, PickFailed
from kvcoord.gateway.requests import BadRequest
from kvcoord.gateway.route_metrics import DecisionMetrics
from kvcoord.gateway.route_sse import ResponseUsage
from kvcoord.router.answer import KV_SOURCE_HEADER
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.transport import ChannelSecurity, ListenError, check_bindable, split_hostport

__all__ = ["EppConfig", "EppServer", "serve_epp"]

log = logging.getLogger("kvcoord.gateway.epp")

READY_NAMES = ("", "readiness", "inference-extension", xp.SERVICE_NAME)
"""Health names that turn SERVING once the picker can pick (``liveness`` is SERVING from the start)."""

PICK_HEADER = "x-kvcoord-pick"
"""Request header set next to the destination: the policy's reason for this endpoint, after ``degraded;``
when the index was not consulted (for the engine's and Envoy's logs)."""


@dataclass(frozen=True, slots=True)
class EppConfig:
    coordinator: str
    listen: str = "0.0.0.0:9002"
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    timeout: float = 0.5
    """Seconds per coordinator RPC: keep it well under Envoy's ext_proc ``message_timeout``."""
    picker: PickerConfig = field(default_factory=PickerConfig)
    mode: str = xp.BUFFERED
    """Request body mode when Envoy does not announce one (``protocol_config``)."""
    refresh_seconds: float = 2.0
    max_body_bytes: int = 16 << 20
    metrics_listen: str | None = None
    health_listen: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    conformance: bool = False
    """The conformance suite's request and response hooks (off: a client must not steer its own pick)."""
    objectives: Mapping[str, int] = field(default_factory=dict)
    """Objective name -> priority (``--objective``; llm-d reads them from InferenceObjectives)."""
    max_queued: int = 0
    """Requests that may wait for a saturated pool (0: the 429 at once); see :mod:`kvcoord.gateway.flow`."""
    queue_ttl: float = 30.0
    """Seconds a request waits at most, unless its ``x-llm-d-inference-ttl`` says otherwise."""
    emit_scores: bool = False
    """Send ``x-gateway-destination-endpoint-scores`` in the ``envoy.lb`` metadata (llm-d's opt-in)."""
    leader_lock: str | None = None
    """A file whose lock elects the one ready replica (:mod:`kvcoord.gateway.leader`); None: all ready."""
    grpc_model: str | None = None
    """The model of gRPC ``Generate`` requests without an ``x-gateway-model-name`` header (None: the one
    model the coordinator lists; :mod:`kvcoord.gateway.grpc_body`)."""


class EppMetrics:
    """The picker's Prometheus families, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcoord_epp_requests", "Requests answered, by outcome", ["outcome"],
                                registry=r)
        self.pick_seconds = Histogram("kvcoord_epp_pick_seconds", "Body received to pick sent", registry=r,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        self.open_streams = Gauge("kvcoord_epp_open_streams", "ext_proc streams holding a pick", registry=r)
        self.served = Counter("kvcoord_epp_served", "Responses the data plane reported, by endpoint",
                              ["endpoint"], registry=r)
        self.shared_view = Gauge("kvcoord_epp_shared_view", "1 while this picker's reservation stream to the "
                                 "coordinator is open (routers share one view); 0: it places on its own "
                                 "memory.", registry=r)
        self.outages = Gauge("kvcoord_epp_lookup_outages",
                             "Models whose lookups fail (picked least-loaded meanwhile)", registry=r)
        self.queued = Gauge("kvcoord_epp_flow_queued", "Requests waiting in flow control for a free endpoint",
                            registry=r)
        self.quality = DecisionMetrics(r, "kvcoord_epp")
        """Predicted against achieved cached tokens, when the data plane passes the response body."""
        self.bad_headers = Counter("kvcoord_epp_bad_headers", "Request headers whose value was ignored "
                                   "(flow control, SLO)", ["header"], registry=r)


def _pick_headers(pick: Pick, conformance: bool) -> dict[str, str]:
    why = pick.why.encode("ascii", "replace").decode()[:300]
    out = {PICK_HEADER: why if pick.prefix_aware else f"degraded; {why}"}
    if pick.pull:  # llm-d's peer-pull source, for the routing sidecar
        out[KV_SOURCE_HEADER] = pick.pull
    if pick.prefiller:  # llm-d's P/D: the decode pod's sidecar prefills there first
        out[PREFILLER_HEADER] = pick.prefiller
    if conformance:  # the reference's X-Echo-Set-Header: the echo server answers the pick
        out[xp.ECHO_SET_HEADER] = f"{xp.CONFORMANCE_SERVED_HEADER}:{pick.endpoints[0]}"
    return out


class _Stream:
    """One HTTP request's ext_proc stream: the protocol state machine. ``handle`` returns the responses
    a message calls for (none while a full-duplex body is still arriving)."""

    def __init__(self, epp: EppServer) -> None:
        self.epp = epp
        self.mode: str | None = ""
        self.subset: Allowed | None = None
        self.body = bytearray()
        self.picked: list[str] = []
        self.reserve_id = ""
        """The pick's reservation (:mod:`kvcoord.gateway.reserve`), released at the response and the end."""
        self.done = False
        """An ImmediateResponse went out: Envoy ends the request, later messages are not answered."""
        self.echo_response = False
        """The response body streams through this picker (``FULL_DUPLEX_STREAMED``): send it back."""
        self.meta = RequestMeta()
        self.predicted: int | None = None
        """Cached tokens a prefix-aware pick predicted, until the response's usage is read."""
        self.usage: ResponseUsage | GrpcUsage | None = None
        self.path = ""
        """``:path``: which API the JSON body speaks, or which gRPC method the body calls."""
        self.grpc = False
        """A gRPC request (``content-type: application/grpc``): the body is a length-prefixed message."""
        self.model_hint = ""
        """The ``x-gateway-model-name`` request header (gRPC requests name no model in their body)."""
        self.encoding = ""
        """The ``grpc-encoding`` request header: how a compressed gRPC message was compressed."""
        """The request's objective, fairness id, queue TTL and TTFT SLO (:mod:`kvcoord.gateway.flow`)."""

    def release(self) -> None:
        self.epp.picker.unreserve(self.reserve_id)
        self.reserve_id = ""
        if self.picked:
            self.epp.picker.in_flight.end(self.picked[0])
            self.epp.metrics.open_streams.dec()
            self.picked = []
            self.epp.flow.wake()

    async def handle(self, req: Any) -> list[Any]:
        if self.done:
            return []
        if req.observability_mode:  # Envoy ignores every answer then: a picker has nothing to say
            if not self.epp.warned_observability:
                self.epp.warned_observability = True
                log.warning("Envoy runs this ext_proc filter in observability_mode: picks cannot be applied")
            return []
        if self.mode == "":
            self.mode = xp.mode_of(req, self.epp.config.mode)
            self.echo_response = xp.response_streamed(req, self.mode == xp.FULL_DUPLEX)
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._headers(req)
        if kind == "request_body":
            return await self._body(req.request_body.body, req.request_body.end_of_stream)
        if kind == "request_trailers":
            return await self._trailers()
        return self._response_phase(req, kind)

    def fail(self, exc: PickFailed | BadRequest | Dropped) -> list[Any]:
        self.done = True
        self.epp.metrics.requests.labels(exc.reason).inc()
        log.info("answering %d (%s): %s", exc.status, exc.reason, exc.message)
        extra = {"retry-after": "1"} if exc.status == 429 else {}
        dropped = getattr(exc, "dropped", "")
        if dropped:
            extra[DROPPED_HEADER] = dropped
        api = "grpc" if self.grpc else ENDPOINT_API.get(endpoint_of_path(self.path), "openai")
        return [xp.immediate_response(exc.status, exc.message, f"kvcoord_epp_{exc.reason}", extra, api=api)]

    def _answer(self, pick: Pick) -> tuple[list[str], dict[str, str], Mapping[str, float] | None]:
        """The pick as a data plane answer: endpoints, request headers to set, scores (when emitted)."""
        cfg = self.epp.config
        return pick.endpoints, _pick_headers(pick, cfg.conformance), pick.scores if cfg.emit_scores else None

    def _hold(self, pick: Pick) -> None:
        self.picked = pick.endpoints
        self.reserve_id = pick.reserve_id
        self.epp.picker.in_flight.begin(pick.endpoints[0])
        self.epp.metrics.open_streams.inc()
        self.epp.metrics.requests.labels("picked" if pick.prefix_aware else "degraded").inc()
        if pick.hit is not None:
            self.predicted = self.epp.metrics.quality.predicted(*pick.hit)
        log.debug("picked %s: %s", ",".join(pick.endpoints), pick.why)

    async def _headers(self, req: Any) -> list[Any]:
        self.subset = _allowed(req, self.epp.config.conformance)
        headers = xp.headers_of(req.request_headers)
        self.path, self.grpc = headers.get(":path", ""), is_grpc(headers)
        self.model_hint, self.encoding = headers.get(MODEL_HEADER, ""), headers.get(ENCODING_HEADER, "")
        self.meta = request_meta(headers, self.epp.config.objectives)
        for name in self.meta.bad:
            self.epp.metrics.bad_headers.labels(name).inc()
            log.info("ignoring the request header %s: not a valid value", name)
        if self.mode is None:
            return self.fail(PickFailed(500, "unsupported_mode", "the ext_proc request body mode must be "
                                         "BUFFERED or FULL_DUPLEX_STREAMED for an endpoint picker"))
        if not req.request_headers.end_of_stream and self.mode != xp.HEADERS_ONLY:
            return [] if self.mode == xp.FULL_DUPLEX else [xp.headers_response()]
        try:
            picker, subset = self.epp.picker, self.subset
            pick = await self.epp.flow.admit(self.meta, lambda: picker.pick_without_body(subset), _is_shed)
        except (PickFailed, Dropped) as exc:
            return self.fail(exc)
        self._hold(pick)
        endpoints, headers, scores = self._answer(pick)
        return [xp.headers_response(endpoints, headers, scores)]

    def _placement(self, complete: bool) -> Callable[[], Awaitable[Pick]]:
        """How the body is placed: a lookup of its model and prompt, or least-loaded (with the reason)
        when the index cannot be asked about it. :class:`BadRequest` for a body that does not read."""
        picker, subset, slo = self.epp.picker, self.subset, self.meta.ttft_slo
        if not self.grpc:
            model, query = query_of_body(bytes(self.body), complete, self.path)
            return lambda: picker.pick(model, query, subset, slo)
        named = self.model_hint or self.epp.config.grpc_model or picker.table.only_model()
        cfg = self.epp.config
        gen = read_generate(self.path, bytes(self.body), complete, self.encoding, cfg.max_body_bytes)
        ports = cfg.picker.target_ports
        if gen.dp_rank is not None and ports:  # rank = port: the pinned rank's endpoints only
            if gen.dp_rank >= len(ports):
                raise BadRequest(f"data_parallel_rank {gen.dp_rank}: the pool has {len(ports)} target ports "
                                 f"(ranks 0 to {len(ports) - 1})")
            subset = Allowed.pinned(subset, gen.dp_rank)
        asked, why = gen.query, gen.why
        if asked is None:
            return lambda: picker.pick_unaskable(named, subset, why)
        if named is None:
            why = f"no {MODEL_HEADER} header, no --grpc-model, and not one model listed"
            return lambda: picker.pick_unaskable(None, subset, why)
        return lambda: picker.pick(named, asked, subset, slo)

    async def _pick_body(self, complete: bool) -> Pick | list[Any]:
        started = time.perf_counter()
        try:
            pick = await self.epp.flow.admit(self.meta, self._placement(complete), _is_shed)
        except (PickFailed, BadRequest, Dropped) as exc:
            return self.fail(exc)
        self.epp.metrics.pick_seconds.observe(time.perf_counter() - started)
        self.epp.metrics.outages.set(len(self.epp.picker.outages))
        self._hold(pick)
        return pick

    async def _body(self, chunk: bytes, end_of_stream: bool) -> list[Any]:
        if self.picked:  # a body after the pick: passed on as it is
            return ([xp.streamed_body_response(chunk, end_of_stream)] if self.mode == xp.FULL_DUPLEX
                    else [xp.body_response()])
        self.body += chunk
        if len(self.body) > self.epp.config.max_body_bytes:
            return self.fail(BadRequest(f"request body over {self.epp.config.max_body_bytes} bytes", 413))
        if self.mode == xp.BUFFERED:
            # Envoy sends a buffered body once: end_of_stream is false only when trailers follow.
            pick = await self._pick_body(complete=end_of_stream)
            if isinstance(pick, list):
                return pick
            endpoints, headers, scores = self._answer(pick)
            return [xp.body_response(endpoints, headers, scores=scores)]
        if not end_of_stream:  # a gRPC request is whole with its one message: no need to wait for the end
            whole = self.grpc and message_ready(self.body)
            return await self._duplex_pick(end_of_stream=False) if whole else []
        return await self._duplex_pick(end_of_stream=True)

    async def _duplex_pick(self, end_of_stream: bool) -> list[Any]:
        pick = await self._pick_body(complete=True)
        if isinstance(pick, list):
            return pick
        return [xp.headers_response(*self._answer(pick)),
                *xp.streamed_body_responses(bytes(self.body), end_of_stream)]

    async def _trailers(self) -> list[Any]:
        if self.mode == xp.FULL_DUPLEX and not self.picked:
            answers = await self._duplex_pick(end_of_stream=False)
            return answers if self.done else [*answers, xp.trailers_response()]
        return [xp.trailers_response()]

    def _usage_begins(self, req: Any) -> None:
        """The response's headers: read its body's usage for the decision metrics (prefix-aware picks)."""
        if self.predicted is None:
            return
        if req.response_headers.end_of_stream:  # no body: nothing to measure
            self.epp.metrics.quality.achieved(self.predicted, None)
            self.predicted = None
            return
        headers = xp.headers_of(req.response_headers)
        ctype = headers.get("content-type", "")
        self.usage = (GrpcUsage(self.path, encoding=headers.get(ENCODING_HEADER, "")) if is_grpc(headers)
                      else ResponseUsage(sse="text/event-stream" in ctype))

    def _usage_feed(self, chunk: bytes, end_of_stream: bool) -> None:
        """A piece of the response body; at its end (``end_of_stream``, or the trailers that end a gRPC
        response) the usage read is measured against the prediction."""
        if self.usage is None or self.predicted is None:
            return
        self.usage.feed(chunk)
        if end_of_stream:
            self.epp.metrics.quality.achieved(self.predicted, self.usage.usage())
            self.usage, self.predicted = None, None

    def _response_phase(self, req: Any, kind: str | None) -> list[Any]:
        if kind == "response_headers":
            self.epp.picker.unreserve(self.reserve_id, first_byte=True)
            self._usage_begins(req)
            served = xp.served_endpoint(req)
            if served:
                self.epp.metrics.served.labels(served).inc()
            if self.epp.config.conformance:
                return [xp.response_headers_response({xp.CONFORMANCE_SERVED_HEADER: xp.served_echo(req)})]
            return [xp.response_headers_response()]
        if kind == "response_body":
            rb = req.response_body
            self._usage_feed(rb.body, rb.end_of_stream)
            if self.echo_response:
                return [xp.streamed_body_response(rb.body, rb.end_of_stream, response=True)]
            return [xp.body_response(response=True)]
        if kind == "response_trailers":
            self._usage_feed(b"", True)
            return [xp.trailers_response(response=True)]
        return []


def _is_shed(exc: BaseException) -> bool:
    """Every eligible endpoint saturated: flow control may queue the request."""
    return isinstance(exc, PickFailed) and exc.reason == "shed"


def _allowed(req: Any, conformance: bool) -> Allowed | None:
    """The endpoints the request may go to: the conformance suite's selection header when on and present
    (it wins over the subset hint, as in the reference picker), else the data plane's subset hint."""
    if conformance:
        chosen = xp.selection(req)
        if chosen is not None:
            return Allowed(frozenset(chosen), f"the {xp.SELECTION_HEADER} header {','.join(chosen)!r}"[:200])
    subset = xp.subset_hint(req)
    return None if subset is None else Allowed(frozenset(subset), "the subset hint")


class EppServer:
    """The ext_proc and health gRPC server, the coordinator client and the endpoint-table refresher."""

    def __init__(self, config: EppConfig) -> None:
        self.config = config
        self.metrics = EppMetrics()
        self.client = AsyncCoordinatorClient(config.coordinator, security=config.security,
                                             timeout=config.timeout)
        self.picker = Picker(self.client, config.picker)
        self.flow = FlowControl(config.max_queued, config.queue_ttl)
        self.leader = FileLeader(config.leader_lock) if config.leader_lock else None
        self.synced = bool(config.picker.static_backends)
        """The node table was loaded (from ListNodes, or given): one half of ready, the leader the other."""
        self.metrics.queued.set_function(lambda: self.flow.queued)
        if self.picker.reserve is not None:
            self.picker.reserve.on_change = lambda up: self.metrics.shared_view.set(int(up))
        self._reserving: asyncio.Task[None] | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._refresher: asyncio.Task[None] | None = None
        self._metrics_server: Any = None
        self.warned_observability = False

    async def Process(self, requests: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The ext_proc stream (gRPC method name)."""
        stream = _Stream(self)
        try:
            async for req in requests:
                try:
                    answers = await stream.handle(req)
                except Exception:  # a bug must not leave Envoy waiting on the message: answer 500
                    log.exception("ext_proc message failed")
                    answers = stream.fail(PickFailed(500, "internal", "the endpoint picker failed"))
                for resp in answers:
                    yield resp
        finally:
            stream.release()

    async def _set_ready(self, ready: bool) -> None:
        hc = health_pb2.HealthCheckResponse
        status = hc.SERVING if ready else hc.NOT_SERVING
        for service in READY_NAMES:
            await self._health.set(service, status)

    async def _refreshed(self, ok: bool) -> None:
        """After each ListNodes: ready once synced (and, with ``--leader-lock``, while the leader). A
        later failed refresh keeps readiness: the picker still places, least-loaded, on the last table,
        and every replica would fail together (docs/epp.md, Readiness)."""
        self.synced = self.synced or ok
        await self._set_ready(self.synced and (self.leader is None or self.leader.try_acquire()))
        self.flow.wake()  # engines' reported load may have dropped

    async def refresh_once(self) -> None:
        """One ``ListNodes`` (failures are logged by the table, once per run of them)."""
        await self._refreshed(await self.picker.refresh())

    async def _refresh_loop(self) -> None:
        await self.picker.table.run(self.client, self.config.refresh_seconds, self._refreshed)

    async def start(self) -> None:
        """Health and metrics first, then the node list, then the ext_proc port (gRPC listens as soon as
        a port is added): once that port accepts, the probes answer and the node list is loaded."""
        cfg = self.config
        check_bindable(cfg.listen)
        await self._health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._refreshed(False)
        if cfg.metrics_listen:
            check_bindable(cfg.metrics_listen)
            host, mport = split_hostport(cfg.metrics_listen)
            self._metrics_server, _ = start_http_server(mport, host, registry=self.metrics.registry)
        await self.refresh_once()
        if cfg.health_listen:
            self._health_server = await self._start_health(cfg.health_listen)
        options = [("grpc.so_reuseport", 0), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.max_receive_message_length", cfg.max_body_bytes + (1 << 20))]
        server = grpc.aio.server(options=options)
        epg.add_ExternalProcessorServicer_to_server(self, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if cfg.tls_cert and cfg.tls_key:
                creds = grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))])
                self.port = server.add_secure_port(cfg.listen, creds)
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {cfg.listen}: {exc}") from None
        await server.start()
        self._server = server
        self._refresher = asyncio.create_task(self._refresh_loop())
        if self.picker.reserve is not None:
            self._reserving = asyncio.create_task(self.picker.reserve.run())
        log.info("kvcoord epp: ext_proc on %s (%s body mode unless Envoy says otherwise), coordinator %s",
                 cfg.listen, cfg.mode, cfg.coordinator)

    async def _start_health(self, listen: str) -> grpc.aio.Server:
        """grpc.health.v1 alone, in plaintext (kubelet's gRPC probes speak no TLS)."""
        check_bindable(listen)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if not server.add_insecure_port(listen):
                raise ListenError(f"cannot listen on {listen}")
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {listen}: {exc}") from None
        await server.start()
        return server

    async def stop(self, grace: float = 1.0) -> None:
        self.flow.close()
        for task in (self._refresher, self._reserving):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._health.enter_graceful_shutdown()
        if self.leader is not None:  # NOT_SERVING and the lock given up at once, as llm-d's lease
            self.leader.release()
        for srv in (self._server, self._health_server):
            if srv is not None:
                await srv.stop(grace)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        await self.client.close()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ListenError(f"cannot read {path}: {exc.strerror or exc}") from None


async def serve_epp(config: EppConfig, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set."""
    server = EppServer(config)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
