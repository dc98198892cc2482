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
methods (``GetModelInfo``, ``Embed``, ``Abort``...) are placed without the index. A ``data_parallel_rank``
the request pins is read with the prompt (:class:`Generate`), for the pick to honour. A message compressed
with ``gzip`` (the request's ``grpc-encoding``) is decompressed up to a size bound; other encodings are
refused. The messages are ``smg-grpc-proto``'s generated classes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message
from smg_grpc_proto.generated import sglang_scheduler_pb2, vllm_engine_pb2  # type: ignore[import-untyped]

from .requests import BadRequest

__all__ = ["ENCODING_HEADER", "GENERATE", "MODEL_HEADER", "Generate", "GrpcUsage", "is_grpc", "message_ready",
           "read_generate"]

MODEL_HEADER = "x-gateway-model-name"
"""The request header naming the model (Generate requests carry none): the Inference Extension's
body-based routing sets it; ``--grpc-model`` is the default."""

ENCODING_HEADER = "grpc-encoding"
"""How a message whose compressed flag is set was compressed (gRPC's request and response header)."""

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


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """A compressed message's protobuf bytes: ``gzip`` only (what gRPC clients send; ``deflate`` and
    ``snappy`` are rare), at most ``limit`` bytes once decompressed. :class:`BadRequest` otherwise: 400
    for another encoding or corrupt data, 413 over the bound (a small body must not unpack into a huge
    one)."""
    encoding = encoding.strip().lower()
    if not encoding:
        raise BadRequest("the gRPC message is compressed, and no grpc-encoding header says how")
    if encoding != "gzip":
        raise BadRequest(f"the gRPC message is compressed with {encoding[:40]!r}: the picker decompresses "
                         f"gzip only")
    inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflate.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"the gRPC message is not valid gzip ({exc})") from None
    if len(out) > limit:
        raise BadRequest(f"the gRPC message decompresses to over {limit} bytes", 413)
    if not inflate.eof or inflate.unused_data:
        raise BadRequest("the gRPC message is not one whole gzip stream")
    return out


def _first_message(body: bytes, complete: bool, encoding: str, limit: int) -> bytes:
    """The first message's protobuf bytes (decompressed); :class:`BadRequest` when cut short."""
    if len(body) < _FRAME.size:
        raise BadRequest(f"gRPC body of {len(body)} bytes holds no length-prefixed message")
    flag, length = _FRAME.unpack_from(body)
    if len(body) < _FRAME.size + length:
        if not complete:
            raise BadRequest("request body incomplete: larger than the proxy's buffer", 413)
        raise BadRequest(f"gRPC message cut short: {length} bytes announced, "
                         f"{len(body) - _FRAME.size} sent")
    data = body[_FRAME.size:_FRAME.size + length]
    return _decompress(data, encoding, limit) if flag else data


def _mm_items(req: Any) -> list[tuple[str, int, int]]:
    """vLLM's per-image hashes at their placeholders (the engine's block keys); none unless both match."""
    if not req.HasField("mm_inputs") or not hasattr(req.mm_inputs, "mm_hashes"):
        return []
    mm = req.mm_inputs
    if len(mm.mm_hashes) != len(mm.mm_placeholders):
        return []
    return [(h, p.offset, p.length) for h, p in zip(mm.mm_hashes, mm.mm_placeholders, strict=True)]


@dataclass(frozen=True, slots=True)
class Generate:
    """What the picker reads of a gRPC request: the lookup keywords (``tokens`` with ``mm_items``, or
    vLLM's ``prompt``), or why there are none; and the data-parallel rank the request pins."""

    query: dict[str, Any] | None
    """None: the index cannot be asked (another method, a request without token ids or text)."""
    why: str = ""
    dp_rank: int | None = None
    """The request's ``data_parallel_rank`` when it sets one (None: the engine chooses)."""


def read_generate(path: str, body: bytes, complete: bool = True, encoding: str = "",
                  limit: int = 16 << 20) -> Generate:
    """The :class:`Generate` of a gRPC request body sent to ``path``, its message compressed per
    ``encoding`` (the ``grpc-encoding`` header) and at most ``limit`` bytes decompressed.
    :class:`BadRequest` (400; 413 when ``complete`` is false and the message is cut short, or over
    ``limit``) for a body that does not decode."""
    kinds = GENERATE.get(path.partition("?")[0])
    if kinds is None:
        return Generate(None, f"the gRPC method {path[:200]!r} is not a Generate")
    kind = kinds[0]
    req: Any = kind()
    try:
        req.ParseFromString(_first_message(body, complete, encoding, limit))
    except DecodeError as exc:
        raise BadRequest(f"the gRPC body is not a {kind.DESCRIPTOR.full_name} ({exc})") from None
    rank = req.data_parallel_rank if req.HasField("data_parallel_rank") else None
    if rank is not None and rank < 0:
        raise BadRequest(f"data_parallel_rank {rank}: a rank is >= 0")
    ids = list(req.tokenized.input_ids) if req.HasField("tokenized") else []
    if ids:
        query: dict[str, Any] = {"tokens": ids}
        items = _mm_items(req)
        if items:
            query["mm_items"] = items
        return Generate(query, dp_rank=rank)
    text = req.text if kind is vllm_engine_pb2.GenerateRequest and req.HasField("text") else ""
    if text:
        return Generate({"prompt": text}, dp_rank=rank)
    return Generate(None, f"the {kind.DESCRIPTOR.full_name} has neither token ids nor text", rank)


class GrpcUsage:
    """The usage of a ``Generate`` response seen in pieces, as the picker sees it on the ext_proc response
    path (the gRPC counterpart of :class:`~kvcoord.gateway.route_sse.ResponseUsage`): the prompt and cached
    tokens of the last message that reports them (each stream chunk, and the final ``complete``), as chat's
    ``usage``. A message compressed per ``encoding`` (the response's ``grpc-encoding``) is decompressed as
    a request's is; an undecodable message, or one over ``limit`` bytes, ends the reading."""

    __slots__ = ("_body", "_encoding", "_kind", "_usage", "limit")

    def __init__(self, path: str, limit: int = 4 << 20, encoding: str = "") -> None:
        kinds = GENERATE.get(path.partition("?")[0])
        self._kind = kinds[1] if kinds is not None else None
        self._body = bytearray()
        self._usage: dict[str, Any] | None = None
        self._encoding = encoding
        self.limit = limit

    def feed(self, piece: bytes) -> None:
        if self._kind is None:
            return
        self._body += piece
        while self._kind is not None and len(self._body) >= _FRAME.size:
            flag, length = _FRAME.unpack_from(self._body)
            if length > self.limit:
                self._kind = None
                return
            if len(self._body) < _FRAME.size + length:
                return
            self._read(flag, bytes(self._body[_FRAME.size:_FRAME.size + length]))
            del self._body[:_FRAME.size + length]

    def _read(self, flag: int, data: bytes) -> None:
        assert self._kind is not None
        msg: Any = self._kind()
        try:
            msg.ParseFromString(_decompress(data, self._encoding, self.limit) if flag else data)
        except (DecodeError, BadRequest):
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
