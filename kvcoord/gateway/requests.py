"""An OpenAI completions or chat request body as lookup keywords, for both front doors (``kvcoord route``
and ``kvcoord epp``): one reading of ``prompt`` / ``messages`` and the fields that change what the engine
tokenizes, so both place a request by the same prefix.

The keywords are those of :meth:`~kvcoord.router.client.AsyncCoordinatorClient.lookup` (the coordinator
tokenizes as the engine will), with one extra key, ``continue_final_message``, present only when true:
the lookup has no such switch (vLLM renders the chat differently), so callers either place such a
request without the index or tokenize it themselves (:func:`tokenize`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvcoord.extra_keys import MultiModalItem
from kvcoord.tokenize.base import Tokenizer
from kvcoord.tokenize.media import MediaRule, encode_media_chat, has_media
from kvcoord.validate import MAX_JSON_DEPTH, json_too_deep

__all__ = ["BadRequest", "NotAskable", "body_query", "json_object", "tokenize"]

_TOO_DEEP = f"request body is nested deeper than {MAX_JSON_DEPTH} levels"

_CHAT_FIELDS = (("tools", list), ("chat_template_kwargs", dict), ("add_generation_prompt", bool),
                ("add_special_tokens", bool))


class BadRequest(Exception):
    """The body cannot be read as a request: ``status`` (400, or 413 for a body cut short) and ``reason``
    (a short token for metrics) say how to answer, ``message`` what is wrong."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.reason = "bad_request" if status == 400 else "body_too_large"
        self.message = message


class NotAskable(Exception):
    """A well-formed request one lookup cannot stand for (see ``batches`` of :func:`body_query`)."""


def _prompt_query(data: Mapping[str, Any], batches: bool) -> dict[str, Any]:
    """OpenAI's ``prompt``: a string, token ids, or a batch of either (placed by its first item)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1 and not batches:
            raise NotAskable(f"a batch of {len(prompt)} prompts")
        prompt = prompt[0]
    if isinstance(prompt, str):
        out: dict[str, Any] = {"prompt": prompt}
        special = data.get("add_special_tokens")
        if special is not None:
            if not isinstance(special, bool):
                raise BadRequest("add_special_tokens must be a JSON bool")
            out["add_special_tokens"] = special
        return out
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 32 for t in prompt):
        return {"tokens": prompt}
    raise BadRequest("prompt must be a string, a list of token ids, or a batch of them")


def _chat_query(data: Mapping[str, Any]) -> dict[str, Any]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of message objects")
    out: dict[str, Any] = {"messages": messages}
    for key, kind in _CHAT_FIELDS:
        if data.get(key) is not None:
            if not isinstance(data[key], kind):
                raise BadRequest(f"{key} must be a JSON {kind.__name__}")
            out[key] = data[key]
    if data.get("continue_final_message"):
        out["continue_final_message"] = True
    return out


def body_query(data: Mapping[str, Any], *, chat: bool | None = None, batches: bool = True) -> dict[str, Any]:
    """Lookup keywords of a parsed body: its ``messages`` when ``chat`` (the chat endpoint), its ``prompt``
    when not, whichever it has when ``None``; :class:`BadRequest` names what is malformed. A batch of
    several prompts is looked up by its first unless ``batches`` is false (:class:`NotAskable`: the
    router's predicted-hit figures must describe the whole request)."""
    if chat is None:
        if data.get("messages") is not None:
            chat = True
        elif data.get("prompt") is not None:
            chat = False
        else:
            raise BadRequest("request body has neither prompt nor messages")
    query = _chat_query(data) if chat else _prompt_query(data, batches)
    salt = data.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise BadRequest("cache_salt must be a string")
        if salt:
            query["cache_salt"] = salt
    return query


def json_object(body: bytes, complete: bool = True) -> dict[str, Any]:
    """The JSON object a request body holds, or :class:`BadRequest` (400; 413 when ``complete`` is false
    and it does not parse: the proxy sent only part of it). A body nested deeper than
    :data:`~kvcoord.validate.MAX_JSON_DEPTH` is refused before anything encodes it again."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError) as exc:
        if not complete:
            raise BadRequest("request body incomplete: larger than the proxy's buffer", 413) from None
        raise BadRequest(f"request body is not JSON ({exc})") from None
    if json_too_deep(body, data):
        raise BadRequest(_TOO_DEEP)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


async def tokenize(tokenizer: Tokenizer, query: Mapping[str, Any],
                   media: MediaRule | None = None) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """The prompt ids of :func:`body_query` keywords, with the engine's defaults (the front door's own
    tokenizer: ``continue_final_message`` is rendered too), and the chat's images as multimodal items
    (placed by ``media``, :mod:`kvcoord.tokenize.media`)."""
    if "tokens" in query:
        return list(query["tokens"]), ()
    if "prompt" in query:
        return await tokenizer.encode_prompt(query["prompt"],
                                             add_special_tokens=query.get("add_special_tokens", True)), ()
    chat = {"tools": query.get("tools"), "add_generation_prompt": query.get("add_generation_prompt", True),
            "continue_final_message": query.get("continue_final_message", False),
            "chat_template_kwargs": query.get("chat_template_kwargs"),
            "add_special_tokens": query.get("add_special_tokens", False)}
    if has_media(query["messages"]):
        return await encode_media_chat(tokenizer, query["messages"], media or MediaRule(), **chat)
    return await tokenizer.encode_chat(query["messages"], **chat), ()
