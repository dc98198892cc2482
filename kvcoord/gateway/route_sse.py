"""Server-sent events as ``kvcoord route`` relays them: each complete event is passed on as soon as it
has arrived (never the whole stream), and the usage event is read on the way for the decision-quality
metrics (chat's top-level ``usage``, Anthropic's ``message_delta``, Responses' ``response.completed``).

When the client did not ask for usage (``stream_options.include_usage``), the router asks the engine for
it anyway and drops the usage-only event before it reaches the client, so every stream is measured; the
client may then see ``"usage": null`` in each chunk (engines that send it, as OpenAI's API does).
"""

from __future__ import annotations

import json
from typing import Any

from .apis import event_usage

__all__ = ["ResponseUsage", "SseRelay", "error_event"]

_SEP = b"\n\n"
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

    __slots__ = ("_pending", "events", "strip_usage", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self.events = 0
        self._pending = b""

    def feed(self, piece: bytes) -> bytes:
        """The bytes of ``piece`` that complete events (minus a stripped usage event), to send now."""
        data = self._pending + piece if self._pending else piece
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
            self.events += ready.count(_SEP)
            return ready
        return self._scan(ready)

    def _scan(self, ready: bytes) -> bytes:
        out = []
        for event in ready.split(_SEP)[:-1]:
            self.events += 1
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
