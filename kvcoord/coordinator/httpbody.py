"""Request bodies of the HTTP API, decoded as Dynamo's indexer (serde) decodes them: the content type,
bad JSON (400), a wrong shape (422, named as serde names it), a field given twice (refused, as serde does;
msgspec would keep the last), trailing bytes after the value (ignored, as serde does), and the native
path that packs a body's big integer array in one scan (:func:`decode_fast`)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from kvcoord.coordinator.httpd import Request, Response, json_error
from kvcoord.hashing import UINT64_MASK
from kvcoord.native import native
from kvcoord.validate import MAX_JSON_DEPTH, json_too_deep

_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _decoder(kind: type[Any]) -> msgspec.json.Decoder[Any]:
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return decoder


class BadBody(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def _check_json(req: Request) -> None:
    header = req.headers.get("content-type", "")
    if header in _JSON_TYPES:
        return
    ctype = header.split(";", 1)[0].strip().lower()
    if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
        raise BadBody(json_error(415, "Expected request with `Content-Type: application/json`"))
    if len(_JSON_TYPES) >= 64:
        _JSON_TYPES.clear()
    _JSON_TYPES.add(header)


_JSON_TYPES: set[str] = set()
"""``Content-Type`` values seen to be JSON: clients send the same one on every request."""


def decode_fast(req: Request, kind: type[Any], key: str, ints: str) -> tuple[Any, memoryview | None] | None:
    """The body as ``kind`` with its integer array ``key`` packed natively (``ints``: 'I' uint32, 'Q' uint64
    keys), in one scan; None when the native scanner does not claim the body or the rest is not ``kind``
    (then :func:`decode_body` decodes it typed, and its value or its error is the answer: a missing or
    mistyped field is named as the full struct's field order names it, with or without the native path)."""
    _check_json(req)
    if native is None:
        return None
    taken = native.json_take_ints(req.body, key, ints)
    if taken is None:
        return None
    packed, rest = taken
    try:
        value = _decoder(kind).decode(rest)
    except (msgspec.DecodeError, RecursionError):
        return None  # an error is decode_body's to word: the same answer with or without the native path
    if json_too_deep(rest, value):
        return None
    if packed is None:
        return value, None
    return value, memoryview(packed).cast("I" if ints == "I" else "Q")


def decode_body(req: Request, kind: type[Any]) -> Any:
    """The JSON body as ``kind``: 415 without a JSON content type, 400 for bad JSON, 422 for a wrong shape."""
    _check_json(req)
    decoder, body = _decoder(kind), req.body
    try:
        try:
            value = decoder.decode(body)
        except msgspec.DecodeError as exc:
            # Dynamo's serde stops after the JSON value and ignores what follows it: so do we.
            end = _TRAILING.search(str(exc))
            if end is None or isinstance(exc, msgspec.ValidationError):
                raise
            body = body[:int(end.group(1)) - 1]  # msgspec counts bytes from 1
            value = decoder.decode(body)
    except msgspec.ValidationError as exc:
        why = f"Failed to deserialize the JSON body into the target type: {exc}"
        raise BadBody(json_error(422, why)) from None
    except msgspec.DecodeError as exc:
        raise BadBody(json_error(400, f"Failed to parse the request body as JSON: {exc}")) from None
    except RecursionError:
        raise BadBody(_TOO_DEEP) from None
    if json_too_deep(body, value):
        raise BadBody(_TOO_DEEP)
    repeated = _repeated_field(body, _json_keys(kind))
    if repeated is not None:  # msgspec keeps the last value; serde refuses, and so does Dynamo
        raise BadBody(json_error(422, "Failed to deserialize the JSON body into the target type: "
                                      f"duplicate field `{repeated}`"))
    return value


_TOO_DEEP = json_error(400, f"Failed to parse the request body as JSON: nested deeper than {MAX_JSON_DEPTH} "
                                 "levels")
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
_KEY_END = re.compile(rb"[ \t\r\n]*:")
_ALIASES = {"additionalsalt": "additional_salt"}
"""JSON keys that set the same field as another (serde ``alias``): giving both is a duplicate."""


_KEYS: dict[type[Any], dict[bytes, str]] = {}


def _json_keys(kind: type[Any]) -> dict[bytes, str]:
    """The JSON keys of a body struct, each with the field it sets."""
    keys = _KEYS.get(kind)
    if keys is None:
        keys = _KEYS[kind] = {name.encode(): _ALIASES.get(name, name) for name in kind.__struct_fields__}
    return keys


def _repeated_field(body: bytes, keys: dict[bytes, str]) -> str | None:
    """A field the body's top-level object sets twice, if any. A scan of the string literals alone (the
    big token and hash arrays hold none), so a few microseconds; a repeat seen at any depth is confirmed
    on the top-level object by a full parse (rare)."""
    seen: set[str] = set()
    find = body.find
    start = find(b'"')
    while start >= 0:
        end = find(b'"', start + 1)
        while end > 0 and body[end - 1] == 0x5C:  # escaped, unless the backslashes escape each other
            back = end - 1
            while body[back - 1] == 0x5C:
                back -= 1
            if (end - back) % 2 == 0:
                break
            end = find(b'"', end + 1)
        if end < 0:
            return None
        name = keys.get(body[start + 1:end])
        if name is not None and _KEY_END.match(body, end + 1):
            if name in seen:
                return _top_level_repeat(body, keys)
            seen.add(name)
        start = find(b'"', end + 1)
    return None


def _top_level_repeat(body: bytes, keys: dict[bytes, str]) -> str | None:
    found: list[str | None] = [None]

    def pairs(items: list[tuple[str, Any]]) -> None:
        names = [keys.get(k.encode()) for k, _ in items]
        found[0] = next((n for i, n in enumerate(names) if n is not None and n in names[:i]), None)

    try:
        json.loads(body, object_pairs_hook=pairs)  # the last object it sees is the top-level one
    except (ValueError, RecursionError):
        return None
    return found[0]


def check_u64(name: str, value: int) -> None:
    if value > UINT64_MASK:
        raise BadBody(json_error(422, "Failed to deserialize the JSON body into the target type: "
                                      f"{name}: {value} is not a uint64"))
