"""Server-sent events as ``kvcoord route`` relays them: each complete event is passed on as soon as it
has arrived (never the whole stream), and the usage event is read on the way for the decision-quality
metrics (chat's top-level ``usage``, Anthropic's ``message_delta``, Responses' ``response.completed``).

When the client did not ask for usage (``stream_options.include_usage``), the router asks the engine for
it anyway and drops the usage-only event before it reaches the client, so every stream is measured; the
client may then see ``"usage": null`` in each chunk (engines that send it, as OpenAI's API does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvcoord.router.http_pool import HttpConn

from .apis import event_usage

__all__ = ["ChunkedOut", "ResponseUsage", "SseRelay", "error_event", "relay_events"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]\n\n"
_MAX_PENDING = 1 << 20
"""An "event" this long without a blank line is not SSE: pass it on rather than hold it."""


def error_event(message: str, *, code: int = 502, kind: str = "BackendError") -> bytes:
    """vLLM's in-stream error shape, then ``[DONE]``, so OpenAI clients stop and raise."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


def _data_of(event: bytes) -> bytes | None:
    """The ``data:`` line of an event (after an ``event:`` line in Anthropic's streams)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:]
    return None


class SseRelay:
    """Cuts a byte stream into SSE events; remembers the last ``usage`` object seen."""

    __slots__ = ("_pending", "strip_usage", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self._pending = b""

    def feed(self, piece: bytes) -> bytes:
        """The bytes of ``piece`` that complete events (minus a stripped usage event), to send now."""
        if self._pending:
            data = self._pending + piece
        elif piece.endswith(_SEP) and b'"usage":{' not in piece and b'"usage": {' not in piece:
            return piece  # the common case: whole events, no usage object (one pass each, no copy)
        else:
            data = piece
        end = data.rfind(_SEP)
        if end < 0:
            if len(data) > _MAX_PENDING:
                self._pending = b""
                return data
            self._pending = data
            return b""
        end += len(_SEP)
        ready, self._pending = data[:end], data[end:]
        if b'"usage":{' not in ready and b'"usage": {' not in ready:
            return ready
        return self._scan(ready)

    def _scan(self, ready: bytes) -> bytes:
        out = []
        for event in ready.split(_SEP)[:-1]:
            data = _data_of(event) if b'"usage"' in event else None
            if data is not None:
                try:
                    obj = json.loads(data)
                except ValueError:
                    obj = None
                usage = event_usage(obj)
                if usage is not None:
                    self.usage = usage
                    if self.strip_usage and isinstance(obj, dict) and not obj.get("choices"):
                        continue
            out.append(event + _SEP)
        return b"".join(out)

    def rest(self) -> bytes:
        """What is left when the stream ends (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        return rest


class ChunkedOut:
    """The client side of a relayed stream: each piece one HTTP chunk written straight on the transport
    (aiohttp's ``StreamResponse.write`` costs four Python calls a chunk, and this runs once per token,
    from the upstream connection's ``data_received``: it cannot await). The framing is aiohttp's own
    (``<hex length>\\r\\n<data>\\r\\n``; :meth:`StreamResponse.write_eof` ends the body as usual); an
    HTTP/1.0 client, which gets no chunked encoding, gets the bytes as they are (what aiohttp's writer
    sends it: the body ends with the connection)."""

    __slots__ = ("_protocol", "_writer", "framed", "held")

    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Call before ``resp.prepare(request)``: it asks for chunked encoding where HTTP/1.1 allows it."""
        self.framed = request.version >= (1, 1)
        if self.framed:
            resp.enable_chunked_encoding()
        self._protocol = request.protocol
        self._writer = request.writer
        self.held = b""
        """What :func:`relay_events` holds back for ``write_eof``."""

    def write(self, data: bytes) -> bool:
        """Sends ``data`` now; True when the client reads slower than the engine writes (the transport is
        above its high-water mark): then :meth:`drain`. ``ConnectionResetError`` once the client is gone."""
        protocol = self._protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.framed else data)
        return protocol.writing_paused

    async def drain(self) -> None:
        """Waits only while the transport is paused (above its high water)."""
        await self._writer.drain()


async def relay_events(source: HttpConn, out: ChunkedOut, relay: SseRelay,
                       first: Callable[[], None]) -> None:
    """Passes ``source``'s events to ``out`` as each read brings them (all bytes of one read at once,
    usage events stripped by ``relay``, from the connection's ``data_received``; the upstream stops
    reading while the client's transport is full), calling ``first`` at the first byte. Leaves in
    ``out.held`` what goes with ``write_eof``: the events ending in ``[DONE]`` (sent with the end of the
    body, in one write) and an unterminated last event. The upstream's and the client's errors propagate
    (``out.held`` then says whether ``[DONE]`` had come)."""
    started = False

    def sink(piece: bytes) -> bool:
        nonlocal started
        if not started:
            started = True
            first()
        data = relay.feed(piece)
        if not data:
            return False
        if out.held:
            held, out.held = out.held, b""
            out.write(held)
        if data.endswith(_DONE):
            out.held = data
            return False
        return out.write(data)

    await source.pipe(sink, out.drain)
    out.held += relay.rest()


class ResponseUsage:
    """The usage of a response body seen in pieces, as ``kvcoord epp`` sees it on the ext_proc response
    path: an SSE stream's usage event (through :class:`SseRelay`), or one JSON document's ``usage``
    (read only when it ends, and not past ``limit`` bytes)."""

    __slots__ = ("_body", "_relay", "limit")

    def __init__(self, *, sse: bool, limit: int = 4 << 20) -> None:
        self._relay = SseRelay(strip_usage=False) if sse else None
        self._body = bytearray()
        self.limit = limit

    def feed(self, piece: bytes) -> None:
        if self._relay is not None:
            self._relay.feed(piece)
        elif len(self._body) + len(piece) <= self.limit:
            self._body += piece
        else:
            self._body = bytearray(b"-")  # too long to parse: no usage

    def usage(self) -> dict[str, Any] | None:
        """The usage seen, once the body ended (None when it had none)."""
        if self._relay is not None:
            self._relay.feed(b"\n\n")  # a last event without its blank line
            return self._relay.usage
        try:
            return event_usage(json.loads(self._body))
        except ValueError:
            return None
