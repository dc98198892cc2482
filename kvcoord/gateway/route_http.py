"""The HTTP side of ``kvcoord route`` around a placement: the headers passed to the engines, the body
sent (usage asked for on streams, image parts given their uuids), who the client is, and the request's
``Prefer`` header."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvcoord.router.answer import KV_SOURCE_HEADER, Candidate
from kvcoord.tokenize.base import InvalidChat
from kvcoord.tokenize.media import assign_uuids, has_media

from .keys import ApiKey
from .requests import BadRequest
from .route_place import Plan

__all__ = ["Client", "covered", "encoded", "header_safe", "if_available", "upstream_body", "upstream_headers",
           "with_media_ids"]

_HOP = frozenset({"host", "content-length", "content-type", "connection", "keep-alive", "transfer-encoding",
                  "upgrade", "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding",
                  "expect", KV_SOURCE_HEADER})
"""Request headers not forwarded: hop-by-hop ones, and those the router sets itself."""
_KEY_HEADERS = frozenset({"authorization", "x-api-key"})
def if_available(request: web.Request) -> bool:
    """llm-d's ``Prefer: if-available``: serve only where the prompt is cached, else 412."""
    prefs = ",".join(request.headers.getall("Prefer", [])).lower()
    return any(p.split(";")[0].strip() == "if-available" for p in prefs.split(","))


def covered(plan: Plan) -> list[Candidate]:
    """The candidates holding every block of the prompt a hit can use (all but the block of its last
    token, as vLLM computes that one; at least one block)."""
    r = plan.request
    need = max(1, (r.num_tokens - 1) // r.block_size)
    return [c for c in plan.candidates if c.matched_blocks >= need] if plan.prefix_aware else []


def header_safe(text: str, limit: int = 512) -> str:
    """Printable ASCII only (a header value); the common case, already so, skips the per-character pass."""
    text = text[:limit]
    if text.isascii() and text.isprintable():
        return text
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)


@dataclass(frozen=True, slots=True)
class Client:
    """Who sent the request: its session id ("" when none) and API key (None when keys are off)."""

    session: str
    key: ApiKey | None


def upstream_headers(request: web.Request, *, strip_keys: bool = False) -> dict[str, str]:
    """The client's headers as the engines get them (hop-by-hop ones dropped, bodies uncompressed; the
    client's router key too when the router checks keys: it is this router's secret, not the engines')."""
    drop = _HOP | _KEY_HEADERS if strip_keys else _HOP
    headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"  # bodies pass through as they are: never compressed
    return headers


def upstream_body(raw: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
    """The body to send upstream, and whether the router asked for usage the client did not ask for."""
    if body.get("stream") is not True:
        return raw, False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return raw, False
    if options is not None and not isinstance(options, dict):
        return raw, False  # malformed: the engine says how
    new = dict(body)
    new["stream_options"] = {**(options or {}), "include_usage": True}
    return json.dumps(new, separators=(",", ":")).encode(), True


_MEDIA_INPUTS = {"chat": "messages", "responses": "input"}
"""Where each endpoint's body holds the chat messages whose image parts the engine reads."""


def with_media_ids(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """``body`` with a ``uuid`` on every image part (:func:`~kvcoord.tokenize.media.assign_uuids`), so
    that the engine keys its blocks with the identifiers the lookup hashed; None when it has no image
    part. A malformed image part is :class:`BadRequest`."""
    key = _MEDIA_INPUTS.get(endpoint)
    items = body.get(key) if key else None
    if not isinstance(items, list) or not has_media(items):
        return None
    try:
        return {**body, key: assign_uuids(items)}  # type: ignore[dict-item]
    except InvalidChat as exc:
        raise BadRequest(str(exc)) from None


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
