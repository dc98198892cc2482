"""Lookups over the coordinator's HTTP API (``POST /query``, ``/query_by_hash``; docs/http-api.md) on
kept-alive connections (:mod:`kvcoord.router.http_pool`): what ``kvcoord route --coordinator-http URL``
asks per request.

Why: a grpc.aio unary call costs a router 0.6-1.5 ms of CPU per lookup (benchmarks/README.md, "Where
route's CPU goes"); a JSON POST on a kept-alive connection, decoded by msgspec, costs a fraction.
The answer carries what the gRPC answer does (per-node matches, tiers, load, trust, pull hints, the routers'
reservations, the query's block hashes) and the lookup holds its new prefix for this router's reservation
(``router_id``, ``reserve_id``, ``wait_ms``), as gRPC's ``Lookup`` does; the reservations themselves stay on
the gRPC ``Reserve`` stream.

:class:`HttpLookupClient` answers as :class:`~kvcoord.router.client.AsyncCoordinatorClient` does: a
:class:`~kvcoord.router.answer.LookupResult`, or :class:`~kvcoord.router.client.CoordinatorError` with the
gRPC status code the same failure has over gRPC (unreachable or 5xx: ``UNAVAILABLE``; too slow:
``DEADLINE_EXCEEDED``; 4xx: the refusal's code; a failed tokenizer: cause ``tokenizer``), so a router's
outage handling is the same on both. Queries the HTTP API cannot say (multimodal items, ``lora_path``,
prompt embeds, candidates) and every other call go to the gRPC client it wraps.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import grpc
import msgspec

from kvcoord.answer_json import NodeJson
from kvcoord.hashing import BlockHash64
from kvcoord.load import EXACT, NodeLoad
from kvcoord.router.answer import Candidate, LookupResult, PullSource
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError, check_lookup_query
from kvcoord.router.http_pool import HttpPool
from kvcoord.transport import CAUSE_METADATA, ChannelSecurity

__all__ = ["HttpLookupClient", "LookupClient", "http_query"]

_NO_LOAD = NodeLoad()
_TEXT_FIELDS = ("prompt", "messages", "tools", "chat_template_kwargs", "add_special_tokens",
                "add_generation_prompt", "lora_name", "cache_salt")
_CHAT_OPTIONS = ("tools", "chat_template_kwargs", "add_generation_prompt")
_GRPC_ONLY = ("lora_path", "mm_items", "prompt_embeds_digests", "candidates")
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
           422: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED}
"""HTTP status -> the gRPC code the same failure has on ``Lookup``; other 5xx are UNAVAILABLE, other 4xx
INVALID_ARGUMENT."""


# --- the answer, as decoded (the coordinator's encoder: kvcoord.coordinator.answers) -------------
class _Load(msgspec.Struct):
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0


def _candidate(n: NodeJson) -> Candidate:
    t, r, p = n.tiers, n.reserved, n.pull
    ld = _decode_load(n.load)
    kv = ld.kv_usage if 0.0 <= ld.kv_usage <= 1.0 else 0.0
    return Candidate(
        n.node_id, n.dp_rank, n.matched_blocks,
        (t.GPU, t.CPU, t.STORAGE, t.POOL) if t.POOL else (t.GPU, t.CPU, t.STORAGE),
        NodeLoad(ld.running_requests, ld.waiting_requests, kv), n.serving_url or "", n.trust or EXACT,
        n.trust_cause, r.blocks if r is not None else 0,
        NodeLoad(running_requests=r.requests, prefill_tokens=r.prefill_tokens)
        if r is not None and (r.requests or r.prefill_tokens) else _NO_LOAD,
        n.pool, n.pool_tier or "STORAGE",
        PullSource(p.node_id, p.host_port, p.tier, p.blocks) if p is not None else None)


class _Answer(msgspec.Struct):
    model: str
    block_size: int = 0
    num_blocks: int = 0
    num_tokens: int = 0
    nodes: list[NodeJson] = []
    block_hashes: list[int] | None = None


class _Error(msgspec.Struct):
    error: str = ""


_decode_answer = msgspec.json.Decoder(_Answer).decode
_decode_load = msgspec.json.Decoder(_Load).decode
_decode_error = msgspec.json.Decoder(_Error).decode
_encode = msgspec.json.Encoder().encode


def http_query(model: str, query: Mapping[str, Any], wait_ms: float) -> tuple[str, bytes] | None:
    """``(path, JSON body)`` of a lookup's keywords (:func:`~kvcoord.router.client.build_lookup_request`'s),
    or None when the HTTP API cannot say it (gRPC then asks). ``ValueError`` for a malformed query, as
    gRPC's builder raises."""
    get = query.get
    check_lookup_query(model, get("tokens"), get("hashes"), get("prompt"), get("messages"),
                       any(get(k) is not None for k in _CHAT_OPTIONS))
    if any(get(k) for k in _GRPC_ONLY):
        return None
    name, _, group = model.partition("@")
    body: dict[str, Any] = {"model_name": name}
    if group:
        body["routing_group"] = group
    if get("include_unmatched"):
        body["include_unmatched"] = True
    if get("hashes") is not None:
        if get("router_id") or get("want_block_hashes") or get("lora_name") or get("cache_salt"):
            return None
        body["block_hashes"] = [int(h) for h in query["hashes"]]
        return "/query_by_hash", _encode(body)
    if get("tokens") is not None:
        body["token_ids"] = query["tokens"]
    for key in _TEXT_FIELDS:
        if get(key) is not None:
            body[key] = query[key]
    if get("want_block_hashes"):
        body["want_block_hashes"] = True
    if get("router_id"):
        body.update(router_id=query["router_id"], reserve_id=get("reserve_id", ""), wait_ms=wait_ms)
    return "/query", _encode(body)


def _ssl_context(security: ChannelSecurity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=security.root_ca)
    if security.client_cert is not None:
        ctx.load_cert_chain(security.client_cert, security.client_key)
    return ctx


class HttpLookupClient:
    """Lookups over HTTP at ``url`` (``http(s)://HOST:PORT``, the coordinator's ``--http-listen``), everything
    else over ``rpc`` (the gRPC client, which the caller closes). ``timeout`` bounds a lookup (seconds)."""

    def __init__(self, url: str, rpc: AsyncCoordinatorClient, *, timeout: float) -> None:
        self.base = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
        self.rpc = rpc
        self.timeout = timeout
        parts = urlsplit(self.base)
        tls = parts.scheme == "https"
        if not parts.hostname:
            raise ValueError(f"{url!r}: not http(s)://HOST:PORT")
        security = rpc.security
        self._pool = HttpPool(parts.hostname, parts.port or (443 if tls else 80),
                              headers={"Content-Type": "application/json", **dict(security.metadata())},
                              ssl_context=_ssl_context(security) if tls else None,
                              server_hostname=security.server_name, wanted=frozenset({CAUSE_METADATA}))

    @property
    def security(self) -> ChannelSecurity:
        return self.rpc.security

    async def close(self) -> None:
        self._pool.close()

    async def lookup(self, model: str, *, timeout: float | None = None, **query: Any) -> LookupResult:
        """As :meth:`AsyncCoordinatorClient.lookup`; over gRPC when the HTTP API cannot say the query."""
        limit = self.timeout if timeout is None else timeout
        asked = http_query(model, query, max(0.0, limit * 1000.0 - 10.0))
        if asked is None:
            return await self.rpc.lookup(model, timeout=timeout, **query)
        path, body = asked
        try:
            async with asyncio.timeout(limit):
                status, data, headers = await self._pool.post(path, body)
        except TimeoutError:
            raise CoordinatorError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{self.base}{path}: no answer within {limit * 1000:g} ms") from None
        except OSError as exc:  # ConnectionError included
            why = str(exc) or type(exc).__name__
            raise CoordinatorError(grpc.StatusCode.UNAVAILABLE, f"{self.base}{path}: {why}") from None
        if status != 200:
            raise _failure(self.base + path, status, data, headers.get(CAUSE_METADATA, ""))
        try:
            answer = _decode_answer(data)
        except msgspec.DecodeError as exc:
            raise CoordinatorError(grpc.StatusCode.INTERNAL,
                                   f"{self.base}{path}: a malformed answer ({exc})") from None
        return _result(answer)

    async def ping(self, *, timeout: float | None = None) -> None:
        await self.rpc.ping(timeout=timeout)


def _failure(url: str, status: int, data: bytes, cause: str) -> CoordinatorError:
    try:
        message = _decode_error(data).error
    except msgspec.DecodeError:
        message = data[:200].decode("utf-8", "replace")
    code = _STATUS.get(status, grpc.StatusCode.UNAVAILABLE if status >= 500
                       else grpc.StatusCode.INVALID_ARGUMENT)
    return CoordinatorError(code, message or f"{url}: HTTP {status}", cause)


def _result(a: _Answer) -> LookupResult:
    got = cast(tuple[BlockHash64, ...], tuple(a.block_hashes)) if a.block_hashes else ()
    return LookupResult(a.model, a.block_size, a.num_blocks, [_candidate(n) for n in a.nodes], a.num_tokens,
                        got)


LookupClient = AsyncCoordinatorClient | HttpLookupClient
"""What a router asks its lookups of: gRPC, or HTTP with gRPC behind it."""
