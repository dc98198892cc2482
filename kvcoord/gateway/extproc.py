"""Envoy ``ext_proc`` v3 as the Gateway API Inference Extension's endpoint-picker protocol speaks it
(``docs/proposals/004-endpoint-picker-protocol``): what to read from a ``ProcessingRequest`` and how to
build each ``ProcessingResponse``.

The picked endpoints travel twice, with the same value, as the protocol requires: the
``x-gateway-destination-endpoint`` request header (a header mutation) and the ``envoy.lb`` dynamic
metadata namespace under the same key. The value is ``ip:port`` or an ordered, comma separated
``ip:port,ip:port,...`` whose first entry is the pick and the rest the fallbacks Envoy walks on retry.
The protobufs are the ``xds-protos`` package's (generated from Envoy's data-plane API), imported here only.

The conformance suite's hooks (``conformance/utils/headers/headers.go``) are read and written here too, as
the reference picker handles them (``pkg/lwepp/handlers/request.go``, ``response.go``, ``server.go``):
:func:`selection` reads ``test-epp-endpoint-selection``, :data:`ECHO_SET_HEADER` asks the suite's echo
server to answer the pick in ``x-conformance-test-served-endpoint``, and :func:`served_echo` is what the
response-headers answer overwrites it with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .apis import API, error_body

__all__ = [
    "CONFORMANCE_SERVED_HEADER",
    "DESTINATION_KEY",
    "DESTINATION_NAMESPACE",
    "ECHO_SET_HEADER",
    "SCORES_KEY",
    "SELECTION_HEADER",
    "SERVED_KEY",
    "SERVICE_NAME",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "body_response",
    "destination_metadata",
    "headers_of",
    "headers_response",
    "immediate_response",
    "mode_of",
    "response_streamed",
    "selection",
    "served_echo",
    "served_endpoint",
    "streamed_body_response",
    "streamed_body_responses",
    "subset_hint",
    "trailers_response",
]

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC service (and the grpc.health.v1 service name the protocol's health section names)."""
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SCORES_KEY = "x-gateway-destination-endpoint-scores"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SELECTION_HEADER = "test-epp-endpoint-selection"
CONFORMANCE_SERVED_HEADER = "x-conformance-test-served-endpoint"
ECHO_SET_HEADER = "x-echo-set-header"
"""The suite's echo server sets the response header ``name:value`` this request header names (the reference
writes ``X-Echo-Set-Header``; Envoy lower-cases header names)."""

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
"""A client's own ``x-gateway-destination-endpoint`` is replaced, never appended to: clients do not pick."""

BUFFERED = "buffered"
FULL_DUPLEX = "full-duplex"
HEADERS_ONLY = "headers-only"
"""Request body modes the picker serves: Envoy's ``BUFFERED`` (the whole body in one message, after the
headers were answered), ``FULL_DUPLEX_STREAMED`` (chunks that arrive without waiting; headers are
answered once the body is complete) and ``NONE`` (no body is sent: placed on the headers, least-loaded)."""

STREAMED_CHUNK = 62_000
"""Bytes per streamed body response, as the reference picker sends them (under Envoy's buffer limits)."""


def mode_of(req: Any, default: str) -> str | None:
    """The request body mode Envoy announces in ``protocol_config`` (first message only; Envoy sends it
    from 1.33 on), else ``default``; ``None`` for a mode whose body cannot steer the pick (``STREAMED``:
    Envoy applies header mutations only from headers responses or buffered body responses)."""
    if not req.HasField("protocol_config"):
        return default
    mode = req.protocol_config.request_body_mode
    pm = processing_mode_pb2.ProcessingMode
    if mode in (pm.BUFFERED, pm.BUFFERED_PARTIAL):
        return BUFFERED
    if mode == pm.FULL_DUPLEX_STREAMED:
        return FULL_DUPLEX
    if mode == pm.NONE:
        return HEADERS_ONLY
    return None


def response_streamed(req: Any, default: bool) -> bool:
    """Whether Envoy streams the response body through the server (``FULL_DUPLEX_STREAMED``), which must
    then send each chunk back; ``default`` when the first message does not say."""
    if not req.HasField("protocol_config"):
        return default
    pm = processing_mode_pb2.ProcessingMode
    return bool(req.protocol_config.response_body_mode == pm.FULL_DUPLEX_STREAMED)


def headers_of(http_headers: Any) -> dict[str, str]:
    """``HttpHeaders`` as a lower-cased dict (Envoy fills ``raw_value``; older releases ``value``)."""
    return {h.key.lower(): _header_value(h) for h in http_headers.headers.headers}


def _header_value(h: Any) -> str:
    """One ``HeaderValue``'s value: Envoy fills ``raw_value``; older releases ``value``."""
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)


def _metadata_field(req: Any, namespace: str, key: str) -> Any | None:
    fm = req.metadata_context.filter_metadata
    if namespace not in fm or key not in fm[namespace].fields:
        return None
    return fm[namespace].fields[key]


def _strings(value: Any) -> list[str]:
    """A metadata value as endpoints: a string (comma separated) or a list of such strings."""
    kind = value.WhichOneof("kind")
    parts: list[str] = []
    if kind == "string_value":
        parts = value.string_value.split(",")
    elif kind == "list_value":
        for v in value.list_value.values:
            if v.WhichOneof("kind") == "string_value":
                parts.extend(v.string_value.split(","))
    return [p.strip() for p in parts if p.strip()]


def subset_hint(req: Any) -> list[str] | None:
    """The endpoints the data plane allows for this request (``envoy.lb.subset_hint``), or ``None`` when
    it set no subset; an empty list means none is allowed (the protocol's 503)."""
    value = _metadata_field(req, SUBSET_NAMESPACE, SUBSET_KEY)
    return None if value is None else _strings(value)


def selection(req: Any) -> list[str] | None:
    """The ``test-epp-endpoint-selection`` request header as the reference picker splits it: ``None`` when
    absent or empty, else its comma separated entries, trimmed (an empty or malformed entry stays, and
    matches no endpoint)."""
    for h in req.request_headers.headers.headers:
        if h.key.lower() == SELECTION_HEADER:  # the first one, as the reference reads it
            value = _header_value(h)
            return [p.strip() for p in value.split(",")] if value else None
    return None


def served_echo(req: Any) -> str:
    """What the reference picker answers in ``x-conformance-test-served-endpoint`` on the response path:
    the data plane's ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` string as it is, else the
    reference's own failure strings, which the suite then reports."""
    if DESTINATION_NAMESPACE not in req.metadata_context.filter_metadata:
        return "fail: missing envoy lb metadata"
    value = _metadata_field(req, DESTINATION_NAMESPACE, SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return "fail: missing destination endpoint served metadata"
    return str(value.string_value)


def served_endpoint(req: Any) -> str | None:
    """The endpoint that served the request, as the data plane reports it on the response path."""
    value = _metadata_field(req, DESTINATION_NAMESPACE, SERVED_KEY)
    if value is None:
        return None
    got = _strings(value)
    return got[0] if got else None


def destination_metadata(endpoints: Sequence[str],
                         scores: Mapping[str, float] | None = None) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port,ip:port,..."}}``, and with ``scores``
    llm-d's ``x-gateway-destination-endpoint-scores``: a struct of every scored ``ip:port`` to its number
    (``generateMetadata`` under ``--emit-endpoint-scores``, llm-d-router ``pkg/epp/handlers``)."""
    md = struct_pb2.Struct()
    lb = md.fields[DESTINATION_NAMESPACE].struct_value
    lb.fields[DESTINATION_KEY].string_value = ",".join(endpoints)
    if scores:
        for endpoint, score in scores.items():
            lb.fields[SCORES_KEY].struct_value.fields[endpoint].number_value = score
    return md


def _set_headers(headers: Mapping[str, str]) -> list[Any]:
    return [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                       append_action=_OVERWRITE) for k, v in headers.items()]


def _pick_common(endpoints: Sequence[str], extra: Mapping[str, str]) -> Any:
    """A CommonResponse that sets the destination header (and ``extra``) and re-selects the route."""
    headers = {DESTINATION_KEY: ",".join(endpoints), **extra}
    return ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=_set_headers(headers)),
                             clear_route_cache=True)


def headers_response(endpoints: Sequence[str] = (), extra: Mapping[str, str] | None = None,
                     scores: Mapping[str, float] | None = None) -> Any:
    """Answer to ``request_headers`` (or ``response_headers``); with ``endpoints`` it carries the pick."""
    if not endpoints:
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse()))
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=_pick_common(endpoints, extra or {})),
        dynamic_metadata=destination_metadata(endpoints, scores))


def response_headers_response(headers: Mapping[str, str] | None = None) -> Any:
    """Answer to ``response_headers``: unchanged, or setting ``headers`` (overwritten, never appended)."""
    common = (ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=_set_headers(headers)))
              if headers else ep.CommonResponse())
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


def body_response(endpoints: Sequence[str] = (), extra: Mapping[str, str] | None = None, *,
                  response: bool = False, scores: Mapping[str, float] | None = None) -> Any:
    """Answer to a buffered body; with ``endpoints`` it carries the pick (Envoy applies header mutations
    from a body response in ``BUFFERED`` mode: the headers are still held)."""
    if not endpoints:
        common = ep.BodyResponse(response=ep.CommonResponse())
        return (ep.ProcessingResponse(response_body=common) if response
                else ep.ProcessingResponse(request_body=common))
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=_pick_common(endpoints, extra or {})),
        dynamic_metadata=destination_metadata(endpoints, scores))


def streamed_body_response(body: bytes, end_of_stream: bool, *, response: bool = False) -> Any:
    """``FULL_DUPLEX_STREAMED``: the body is the server's to send on, here unchanged."""
    streamed = ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    mutation = ep.BodyMutation(streamed_response=streamed)
    common = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
    return (ep.ProcessingResponse(response_body=common) if response
            else ep.ProcessingResponse(request_body=common))


def streamed_body_responses(body: bytes, end_of_stream: bool) -> list[Any]:
    """A whole request body sent back in :data:`STREAMED_CHUNK` pieces, ``end_of_stream`` on the last."""
    pieces = [body[i:i + STREAMED_CHUNK] for i in range(0, len(body), STREAMED_CHUNK)] or [b""]
    return [streamed_body_response(p, end_of_stream and i == len(pieces) - 1) for i, p in enumerate(pieces)]


def trailers_response(*, response: bool = False) -> Any:
    return (ep.ProcessingResponse(response_trailers=ep.TrailersResponse()) if response
            else ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))


_GRPC_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL}
"""The gRPC status a refused gRPC request gets (others: ``UNAVAILABLE``)."""


def immediate_response(status: int, message: str, details: str,
                       headers: Mapping[str, str] | None = None, *, api: str = "openai") -> Any:
    """End the request at the proxy with ``status`` and the error in the request's own API shape:
    ``openai`` (and ``responses``) and ``anthropic`` as :func:`kvcoord.gateway.apis.error_body` writes them,
    ``grpc`` as a gRPC status (Envoy answers a gRPC request trailers-only: ``grpc-status``, and the body as
    ``grpc-message``). ``details`` lands in Envoy's response-code details and access log."""
    hdrs = dict(headers or {})
    if api == "grpc":
        code = _GRPC_STATUS.get(status, grpc.StatusCode.UNAVAILABLE).value[0]
        return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status), grpc_status=ep.GrpcStatus(status=code),
            headers=ep.HeaderMutation(set_headers=_set_headers(hdrs)), body=message.encode(),
            details=details))
    kinds = {400: "BadRequestError", 413: "BadRequestError", 429: "RateLimitError",
             500: "InternalServerError"}
    shape: API = "anthropic" if api == "anthropic" else "openai"
    body = json.dumps(error_body(shape, status, message, kinds.get(status, "ServiceUnavailableError")))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=ep.HeaderMutation(set_headers=_set_headers({"content-type": "application/json", **hdrs})),
        body=body.encode(), details=details))
