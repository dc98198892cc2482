"""gRPC-bodied requests to the endpoint picker: vLLM's and SGLang's ``Generate`` (Gateway API Inference
Extension proposal 2162, pools whose ``targetPorts`` say ``appProtocol: kubernetes.io/h2c``).

Envoy hands the picker the HTTP/2 request as it is: the ``:path`` header names the method
(``/vllm.grpc.engine.VllmEngine/Generate``, ``/sglang.grpc.scheduler.SglangScheduler/Generate``), the
``content-type`` is ``application/grpc[+proto]``, and the body is the gRPC length-prefixed message (one
byte, 1 when the message is compressed; a 4-byte big-endian length; the protobuf), which may arrive split
over several body chunks. ``Generate``'s request is unary, so the first message is the whole request.

Both engines take token ids (``tokenized.input_ids``): the lookup is by those ids, exact, with no tokenizer
anywhere. vLLM's text input (``text``) is looked up as a completions prompt (the coordinator tokenizes it);
vLLM's image hashes and placeholders (``mm_inputs.mm_hashes`` / ``mm_placeholders``) become the lookup's
multimodal items, as the engine keys those blocks; images without hashes (SGLang's, vLLM's ``media_refs``)
leave the blocks from the first one on unmatched, never wrongly matched: the engine hashed them with keys
the lookup does not have. A request without token ids or text (SGLang's ``input_embeds``) and the other
methods (``GetModelInfo``, ``Embed``, ``Abort``...) are :class:`NotAskable`: placed without the index.
The messages are ``smg-grpc-proto``'s generated classes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError, Message
from smg_grpc_proto.generated import sglang_scheduler_pb2, vllm_engine_pb2  # type: ignore[import-untyped]

from .requests import BadRequest, NotAskable

__all__ = ["GENERATE", "MODEL_HEADER", "GrpcUsage", "generate_query", "is_grpc", "message_ready"]

MODEL_HEADER = "x-gateway-model-name"
"""The request header naming the model (Generate requests carry none): the Inference Extension's
body-based routing sets it; ``--grpc-model`` is the default."""

_FRAME = struct.Struct(">BI")


def _path(pb2: Any, service: str) -> str:
    method = pb2.DESCRIPTOR.services_by_name[service].methods_by_name["Generate"]
    return f"/{method.containing_service.full_name}/{method.name}"


GENERATE: dict[str, tuple[type[Message], type[Message]]] = {
    _path(vllm_engine_pb2, "VllmEngine"): (vllm_engine_pb2.GenerateRequest, vllm_engine_pb2.GenerateResponse),
    _path(sglang_scheduler_pb2, "SglangScheduler"): (sglang_scheduler_pb2.GenerateRequest,
                                                     sglang_scheduler_pb2.GenerateResponse),
}
"""``:path`` of each engine's ``Generate`` -> its request and response messages."""


def is_grpc(headers: Mapping[str, str]) -> bool:
    """A gRPC request: ``content-type`` ``application/grpc`` (``+proto`` and other suffixes included)."""
    return headers.get("content-type", "").strip().lower().startswith("application/grpc")


def message_ready(body: bytes | bytearray) -> bool:
    """The first length-prefixed message has arrived whole (the pick need not wait for the stream's end)."""
    return len(body) >= _FRAME.size and len(body) >= _FRAME.size + _FRAME.unpack_from(body)[1]


def _first_message(body: bytes, complete: bool) -> bytes:
    """The first message's protobuf bytes; :class:`BadRequest` when compressed or cut short."""
    if len(body) < _FRAME.size:
        raise BadRequest(f"gRPC body of {len(body)} bytes holds no length-prefixed message")
    flag, length = _FRAME.unpack_from(body)
    if flag:
        raise BadRequest("the gRPC message is compressed (grpc-encoding): the picker reads uncompressed "
                         "messages only")
    if len(body) < _FRAME.size + length:
        if not complete:
            raise BadRequest("request body incomplete: larger than the proxy's buffer", 413)
        raise BadRequest(f"gRPC message cut short: {length} bytes announced, "
                         f"{len(body) - _FRAME.size} sent")
    return body[_FRAME.size:_FRAME.size + length]


def _mm_items(req: Any) -> list[tuple[str, int, int]]:
    """vLLM's per-image hashes at their placeholders (the engine's block keys); none unless both match."""
    if not req.HasField("mm_inputs") or not hasattr(req.mm_inputs, "mm_hashes"):
        return []
    mm = req.mm_inputs
    if len(mm.mm_hashes) != len(mm.mm_placeholders):
        return []
    return [(h, p.offset, p.length) for h, p in zip(mm.mm_hashes, mm.mm_placeholders, strict=True)]


def generate_query(path: str, body: bytes, complete: bool = True) -> dict[str, Any]:
    """Lookup keywords of a gRPC request body: ``tokens`` (with ``mm_items``) or vLLM's ``prompt``.
    :class:`NotAskable` for a method that is not a ``Generate`` or a request without tokens or text;
    :class:`BadRequest` (400; 413 when ``complete`` is false and the message is cut short) for a body
    that does not decode."""
    kinds = GENERATE.get(path.partition("?")[0])
    if kinds is None:
        raise NotAskable(f"the gRPC method {path[:200]!r} is not a Generate")
    kind = kinds[0]
    req: Any = kind()
    try:
        req.ParseFromString(_first_message(body, complete))
    except DecodeError as exc:
        raise BadRequest(f"the gRPC body is not a {kind.DESCRIPTOR.full_name} ({exc})") from None
    ids = list(req.tokenized.input_ids) if req.HasField("tokenized") else []
    if ids:
        query: dict[str, Any] = {"tokens": ids}
        items = _mm_items(req)
        if items:
            query["mm_items"] = items
        return query
    text = req.text if kind is vllm_engine_pb2.GenerateRequest and req.HasField("text") else ""
    if text:
        return {"prompt": text}
    raise NotAskable(f"the {kind.DESCRIPTOR.full_name} has neither token ids nor text")


class GrpcUsage:
    """The usage of a ``Generate`` response seen in pieces, as the picker sees it on the ext_proc response
    path (the gRPC counterpart of :class:`~kvcoord.gateway.route_sse.ResponseUsage`): the prompt and cached
    tokens of the last message that reports them (each stream chunk, and the final ``complete``), as chat's
    ``usage``. A compressed or undecodable message, or one over ``limit`` bytes, ends the reading."""

    __slots__ = ("_body", "_kind", "_usage", "limit")

    def __init__(self, path: str, limit: int = 4 << 20) -> None:
        kinds = GENERATE.get(path.partition("?")[0])
        self._kind = kinds[1] if kinds is not None else None
        self._body = bytearray()
        self._usage: dict[str, Any] | None = None
        self.limit = limit

    def feed(self, piece: bytes) -> None:
        if self._kind is None:
            return
        self._body += piece
        while len(self._body) >= _FRAME.size:
            flag, length = _FRAME.unpack_from(self._body)
            if flag or length > self.limit:
                self._kind = None
                return
            if len(self._body) < _FRAME.size + length:
                return
            self._read(bytes(self._body[_FRAME.size:_FRAME.size + length]))
            del self._body[:_FRAME.size + length]

    def _read(self, data: bytes) -> None:
        assert self._kind is not None
        msg: Any = self._kind()
        try:
            msg.ParseFromString(data)
        except DecodeError:
            self._kind = None
            return
        which = msg.WhichOneof("response")
        part = getattr(msg, which) if which else None
        if part is not None and part.prompt_tokens:
            self._usage = {"prompt_tokens": part.prompt_tokens,
                           "prompt_tokens_details": {"cached_tokens": part.cached_tokens}}

    def usage(self) -> dict[str, Any] | None:
        """The usage seen (None when no message reported one)."""
        return self._usage
