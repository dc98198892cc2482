"""Image parts of a chat: their identifiers, their placeholder tokens, and the multimodal items that go
into vLLM's block keys (:class:`~kvcoord.extra_keys.MultiModalItem`).

vLLM hashes a block that overlaps an image with ``(identifier, offset in block)`` next to its tokens
(``_gen_mm_extra_hash_keys``). The identifier is the item's ``uuid`` when the request gives one (the
chat part's ``"uuid"`` field, i.e. ``multi_modal_uuids``, with no per-request processor kwargs), else a
BLAKE3 digest of the decoded pixels and processor settings, which kvcoord cannot reproduce. So, as
Dynamo's router does, the router gives every image a uuid of its own (:func:`assign_uuids`): the client's
``uuid`` when it sent one, else a SHA-256 of the URL (``http(s)://``) or of the decoded bytes (``data:``).
The engine then keys its blocks with the same identifier.

The placeholder rule is kvcoord's explicit model of the processor (:class:`MediaRule`): each image is
rendered as ``placeholder`` (one token of the tokenizer), put before the message's text as vLLM's
``string`` content format does (placeholders first, then the text parts, joined by newlines), and that
token is expanded to ``tokens`` copies, the image's item (offset, length). A real processor's count
depends on the image size for most models (Qwen2-VL, LLaVA-NeXT); kvcoord's is one number per model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvcoord.extra_keys import MultiModalItem
from kvcoord.tokenize.base import MEDIA_PART_KEYS, InvalidChat, TokenizeError, Tokenizer

__all__ = [
    "DEFAULT_IMAGE_PLACEHOLDER",
    "DEFAULT_IMAGE_TOKENS",
    "MediaRule",
    "assign_uuids",
    "encode_media_chat",
    "expand_placeholders",
    "has_media",
    "media_uuid",
    "with_placeholders",
]

DEFAULT_IMAGE_TOKENS: Final = 576
"""Placeholder tokens per image unless configured: LLaVA-1.5's fixed 24x24 patches."""
DEFAULT_IMAGE_PLACEHOLDER: Final = "<image>"
"""The text an image renders as unless configured (LLaVA's; Qwen2-VL's is ``<|image_pad|>``)."""

_PLACEHOLDER_IDS: weakref.WeakKeyDictionary[Tokenizer, dict[str, int]] = weakref.WeakKeyDictionary()
"""Each open tokenizer's placeholder ids, asked once (for an engine's /tokenize, a round trip)."""
_IMAGE_KINDS: Final = frozenset({"image_url", "input_image"})
"""Chat content-part types that carry an image by URL (chat's ``image_url``, Responses' ``input_image``)."""


@dataclass(frozen=True, slots=True)
class MediaRule:
    """How a model's processor lays an image into the prompt: one ``placeholder`` token, expanded to
    ``tokens`` copies."""

    placeholder: str = DEFAULT_IMAGE_PLACEHOLDER
    tokens: int = DEFAULT_IMAGE_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"image tokens must be an integer >= 1, not {self.tokens!r}")
        if not isinstance(self.placeholder, str) or not self.placeholder.strip():
            raise ValueError("the image placeholder must be a non-empty string")


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") in _IMAGE_KINDS


def _url(where: str, part: Mapping[str, Any]) -> str:
    """The part's image URL: chat's ``{"image_url": {"url": ...}}``, or a string ``image_url``."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise InvalidChat(f"{where}: an image part needs image_url.url, a data: or http(s):// URL")
    return url


def _data_bytes(where: str, url: str) -> bytes:
    """The decoded payload of a ``data:image/...;base64,...`` URL."""
    head, comma, payload = url.partition(",")
    meta = head[len("data:"):].split(";")
    if not comma or not meta[0].startswith("image/") or "base64" not in meta[1:]:
        raise InvalidChat(f"{where}: a data URL must be data:image/<type>;base64,<data>")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidChat(f"{where}: the data URL's payload is not valid base64") from None
    if not data:
        raise InvalidChat(f"{where}: the data URL's payload is empty")
    return data


def media_uuid(where: str, part: Mapping[str, Any]) -> str:
    """The identifier of an image part: its own non-empty ``uuid``, else a digest of what it points at.

    Raises :class:`~kvcoord.tokenize.base.InvalidChat` (one line) for a malformed part."""
    url = _url(where, part)  # checked even when a uuid is given: the engine needs the image too
    if url.startswith("data:"):
        digest = hashlib.sha256(b"data\0" + _data_bytes(where, url)).hexdigest()
    elif url.startswith(("http://", "https://")) and len(url) > len("https://"):
        digest = hashlib.sha256(b"url\0" + url.encode("utf-8", "surrogatepass")).hexdigest()
    else:
        raise InvalidChat(f"{where}: image URL must be a data: or http(s):// URL")
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise InvalidChat(f"{where}.uuid must be a non-empty string")
    return uuid if uuid else f"kvc-{digest}"


def _image_parts(messages: Sequence[Any]) -> Iterator[tuple[int, Any, list[Any] | None]]:
    """Each message with its index and its content parts when they hold an image (else None)."""
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        yield i, msg, content if isinstance(content, list) and any(map(_is_image, content)) else None


def has_media(messages: object) -> bool:
    """Whether any message of a chat holds an image part."""
    return isinstance(messages, list) and any(parts is not None for _, _, parts in _image_parts(messages))


def assign_uuids(messages: Sequence[Any]) -> list[Any]:
    """``messages`` with a ``uuid`` on every image part (:func:`media_uuid`), as fresh copies of the
    messages and parts that change; raises :class:`~kvcoord.tokenize.base.InvalidChat` for a bad part."""
    out: list[Any] = []
    for i, msg, content in _image_parts(messages):
        if content is None:
            out.append(msg)
            continue
        parts = [{**p, "uuid": media_uuid(f"messages[{i}].content[{j}]", p)} if _is_image(p) else p
                 for j, p in enumerate(content)]
        out.append({**msg, "content": parts})
    return out


def _text(where: str, part: object) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type", "text") in ("text", "input_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidChat(f"{where}.text must be a string")
        return text
    return None


def with_placeholders(messages: Sequence[Any], rule: MediaRule) -> tuple[list[Any], list[str]]:
    """The chat as text only, and the identifiers of its images in prompt order.

    A message with images gets string content: one ``rule.placeholder`` per image, then its text
    parts, joined by newlines (vLLM's string content format). Other parts of such a message are dropped
    as the string format drops them. Messages without images are left as they are."""
    out: list[Any] = []
    uuids: list[str] = []
    for i, msg, content in _image_parts(messages):
        if content is None:
            out.append(msg)
            continue
        holders: list[str] = []
        texts: list[str] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if _is_image(part):
                uuids.append(media_uuid(where, part))
                holders.append(rule.placeholder)
            elif (text := _text(where, part)) is not None:
                texts.append(text)
            elif isinstance(part, Mapping) and part.get("type") in MEDIA_PART_KEYS:
                raise InvalidChat(f"{where} is a {part['type']!r} part: only images are routed by prefix")
        out.append({**msg, "content": "\n".join([*holders, "\n".join(texts)])})
    return out, uuids


def expand_placeholders(ids: Sequence[int], placeholder_id: int, uuids: Sequence[str],
                        rule: MediaRule) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """``ids`` with each ``placeholder_id`` repeated ``rule.tokens`` times, and one item per image.

    The k-th placeholder is the k-th image; a count that differs from ``len(uuids)`` (the text itself
    holds the placeholder) is :class:`~kvcoord.tokenize.base.InvalidChat`, as vLLM refuses it."""
    found = sum(1 for t in ids if t == placeholder_id)
    if found != len(uuids):
        raise InvalidChat(f"the rendered prompt holds {found} image placeholders "
                          f"({rule.placeholder!r}) for {len(uuids)} images")
    out: list[int] = []
    items: list[MultiModalItem] = []
    for t in ids:
        if t == placeholder_id:
            items.append(MultiModalItem(uuids[len(items)], len(out), rule.tokens))
            out.extend([placeholder_id] * rule.tokens)
        else:
            out.append(t)
    return out, tuple(items)


async def encode_media_chat(tokenizer: Tokenizer, messages: Sequence[Any], rule: MediaRule,
                            **chat: Any) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """The prompt ids of a chat with images and its multimodal items: rendered with placeholders
    (:func:`with_placeholders`), encoded by ``tokenizer`` (``chat``: :meth:`Tokenizer.encode_chat`'s
    options), expanded (:func:`expand_placeholders`). The placeholder must be one token."""
    text_only, uuids = with_placeholders(messages, rule)
    known = _PLACEHOLDER_IDS.setdefault(tokenizer, {})
    holder = [known[rule.placeholder]] if rule.placeholder in known else await tokenizer.encode_prompt(
        rule.placeholder, add_special_tokens=False)
    if len(holder) != 1:
        raise TokenizeError(tokenizer.model, f"the image placeholder {rule.placeholder!r} is {len(holder)} "
                            "tokens, not one: the model takes no images, or its image_placeholder is not "
                            "configured", source=tokenizer.source, bad_request=True)
    known[rule.placeholder] = holder[0]
    ids = await tokenizer.encode_chat(text_only, **chat)
    return expand_placeholders(ids, holder[0], uuids, rule)
