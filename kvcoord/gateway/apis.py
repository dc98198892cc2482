"""The request APIs besides OpenAI's completions and chat, as the chat or token prompt the engine sees.

vLLM serves Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` by turning each request into a
chat completion and rendering that with the chat template; ``/inference/v1/generate`` carries token ids.
So that ``kvcoord route`` looks up the prefix the engine will cache, these functions do the same
mapping (re-implemented from vLLM's ``entrypoints/anthropic/serving.py`` and
``entrypoints/openai/responses/utils.py``, not copied), then the existing chat / token lookup applies.
The sim-engine renders its prompts through the same functions, so the two cannot drift apart.

Only what changes the prompt is read: ``system``, ``messages`` (text, ``tool_use``, ``tool_result``,
``thinking`` blocks; ``image`` blocks for the sim-engine and epp, ``route`` refuses them), ``tools`` for
Anthropic; ``instructions``, ``input`` (a string or items: messages, ``function_call``,
``function_call_output``, ``reasoning``) and function ``tools`` for Responses. Every other field passes
to the engine untouched. Each API answers errors in its own shape
(:func:`error_body`) and reports cached prompt tokens in its own usage fields (:func:`chat_usage`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from .requests import BadRequest, body_query, json_object

__all__ = [
    "API",
    "API_PATHS",
    "ENDPOINT_API",
    "as_lookup_body",
    "chat_usage",
    "endpoint_of_path",
    "error_body",
    "event_usage",
    "query_of_body",
]

API = Literal["openai", "anthropic", "responses"]
ENDPOINT_API: dict[str, API] = {"completions": "openai", "chat": "openai", "generate": "openai",
                                "messages": "anthropic", "responses": "responses"}
"""The error and usage dialect of each ``kvcoord route`` endpoint."""
API_PATHS: dict[str, str] = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                             "/v1/messages": "messages", "/v1/responses": "responses",
                             "/inference/v1/generate": "generate"}
"""Request path -> endpoint (a key of :data:`ENDPOINT_API`), for both front doors."""


def endpoint_of_path(path: str) -> str:
    """The endpoint a request path (its query string aside) names; "" for another path."""
    return API_PATHS.get(path.partition("?")[0], "")

_BILLING_HEADER = "x-anthropic-billing-header"
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     412: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                     503: "overloaded_error"}


def _system_texts(content: object, where: str) -> list[str]:
    """Anthropic system text: a string, or text blocks (Claude Code's per-request billing line dropped, as
    vLLM drops it: it would defeat the prefix cache)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    out = []
    for block in content:
        if not isinstance(block, dict):
            raise BadRequest(f"{where} blocks must be objects")
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and text and \
                not text.startswith(_BILLING_HEADER):
            out.append(text)
    return out


_NO_IMAGES = ("image blocks are not routed by kvcoord route: vLLM's /v1/messages gives the engine no uuid "
              "for them (docs/route.md, Multimodal chats); send images as chat image_url parts")
"""Why an Anthropic image (a message's block, or inside a tool result) is refused."""


def _image_part(block: Mapping[str, Any], images: bool) -> dict[str, Any] | None:
    """An image block as vLLM converts it: a chat ``image_url`` part of the URL alone (a ``base64``
    source as a data URL); None for one without a source. Refused unless ``images``."""
    if not images:
        raise BadRequest(_NO_IMAGES)
    source = block.get("source")
    if not isinstance(source, dict) or not source:
        return None
    if source.get("type") == "url":
        url = source.get("url") or ""
    else:
        url = f"data:{source.get('media_type') or 'image/jpeg'};base64,{source.get('data') or ''}"
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: Mapping[str, Any], out: list[dict[str, Any]], images: bool) -> None:
    """A user's tool result: a tool message of its text, then (as vLLM does) a user message of its images."""
    content = block.get("content")
    pictures: list[dict[str, Any]] = []
    if isinstance(content, list):
        pictures = [p for p in (_image_part(i, images) for i in content
                                if isinstance(i, dict) and i.get("type") == "image") if p is not None]
        content = "\n".join(str(i.get("text", "")) for i in content
                            if isinstance(i, dict) and i.get("type") == "text")
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                "content": content if isinstance(content, str) else ""})
    if pictures:
        out.append({"role": "user", "content": pictures})


def _anthropic_blocks(role: str, blocks: list[Any], out: list[dict[str, Any]],
                      images: bool) -> dict[str, Any] | None:
    """One message's blocks as vLLM maps them: text and image parts, tool calls, reasoning; a user's tool
    results become messages of their own (appended to ``out`` before the message itself)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        if not isinstance(block, dict):
            raise BadRequest("content blocks must be objects")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            part = _image_part(block, images)
            if part is not None:
                parts.append(part)
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "", "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                _tool_result(block, out, images)
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    msg: dict[str, Any] = {"role": role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    return None if role == "user" and "content" not in msg else msg


def anthropic_messages(body: Mapping[str, Any], images: bool = False) -> dict[str, Any]:
    """An Anthropic Messages body as the chat body vLLM renders (``messages``, ``tools``). Image blocks
    become ``image_url`` parts with ``images`` (the sim-engine, serving them as vLLM does), else are a
    :class:`BadRequest` (``kvcoord route``: vLLM's conversion carries no uuid, docs/route.md)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list is required")
    system: list[str] = []
    if body.get("system") is not None:
        system += _system_texts(body["system"], "system")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages.{i}: an object with a role is required")
        role = {"ctx": "user", "msg": "user"}.get(m["role"], m["role"])
        if role not in ("user", "assistant", "system"):
            raise BadRequest(f"messages.{i}.role: unexpected role {m['role']!r}")
        content = m.get("content")
        if role == "system":
            system += _system_texts(content, f"messages.{i}.content")
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            msg = _anthropic_blocks(role, content, out, images)
            if msg is not None:
                out.append(msg)
        else:
            raise BadRequest(f"messages.{i}.content: a string or a list of blocks is required")
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": "".join(system)}] if system else [])
                            + out}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools: a list of tool objects is required")
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": _schema(t.get("input_schema"))}} for t in tools]
    return chat


def _schema(schema: object) -> dict[str, Any]:
    """vLLM's ``AnthropicTool``: a schema without ``type`` gets ``"object"`` (appended, as pydantic does)."""
    out = dict(schema) if isinstance(schema, dict) else {}
    out.setdefault("type", "object")
    return out


def _merge_assistant(out: list[dict[str, Any]], key: str, value: Any) -> bool:
    """vLLM folds a tool call, reasoning or text into the assistant message just before it."""
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    if prev is None:
        return False
    if key == "tool_calls":
        prev.setdefault("tool_calls", []).append(value)
        return True
    if prev.get(key) is None:
        prev[key] = value
        return True
    return False


def _response_item(item: object, out: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise BadRequest("input items must be objects")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        args = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input")})
        call = {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": args},
                "type": "function"}
        if not _merge_assistant(out, "tool_calls", call):
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        content, summary = item.get("content"), item.get("summary")
        texts = content if content else summary
        text = texts[0].get("text", "") if isinstance(texts, list) and texts and isinstance(texts[0], dict) \
            else ""
        if not _merge_assistant(out, "reasoning", text):
            out.append({"role": "assistant", "reasoning": text})
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else (
            content[0].get("text") if isinstance(content, list) and content and isinstance(content[0], dict)
            else None)
        if text is not None and not _merge_assistant(out, "content", text):
            out.append({"role": "assistant", "content": text})
    elif isinstance(item.get("role"), str):
        out.append({k: v for k, v in item.items() if k not in ("type", "id", "status")})
    else:
        raise BadRequest(f"input item of type {kind!r} is not understood")


def responses_messages(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses body as the chat body vLLM renders: ``instructions`` first as the system message,
    then ``input`` (a string is one user message)."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise BadRequest("previous_response_id / conversation: stored responses are not routed by prefix")
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string")
    if instructions:
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for item in given:
            _response_item(item, out)
    else:
        raise BadRequest("input must be a string or a non-empty list of items")
    chat: dict[str, Any] = {"messages": out}
    tools = body.get("tools")
    if tools is not None and body.get("tool_choice") != "none":
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be a list of tool objects")
        fns = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in tools if t.get("type") == "function"]
        if fns:
            chat["tools"] = fns
    return chat


def generate_prompt(body: Mapping[str, Any]) -> dict[str, Any]:
    """``/inference/v1/generate``: the prompt is ``token_ids`` (no tokenizer anywhere)."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < 1 << 32 for t in ids):
        raise BadRequest("token_ids must be a non-empty list of token ids")
    return {"prompt": ids}


def as_lookup_body(endpoint: str, body: Mapping[str, Any],
                   images: bool = False) -> tuple[Mapping[str, Any], bool]:
    """``(an OpenAI completions or chat body, chat?)`` standing for ``body`` of ``endpoint``, for
    :func:`~kvcoord.gateway.requests.body_query`; :class:`BadRequest` when the shape cannot be read.
    ``images``: Anthropic image blocks are read (as :func:`anthropic_messages` says), not refused."""
    salt = {"cache_salt": body["cache_salt"]} if "cache_salt" in body else {}
    if endpoint == "messages":
        chat = anthropic_messages(body, images)
        if isinstance(body.get("chat_template_kwargs"), dict):
            chat["chat_template_kwargs"] = body["chat_template_kwargs"]
        return {**chat, **salt}, True
    if endpoint == "responses":
        return {**responses_messages(body), **salt}, True
    if endpoint == "generate":
        return {**generate_prompt(body), **salt}, False
    if endpoint == "completions" and body.get("prompt") is None and body.get("prompt_token_ids") is not None:
        return {**body, "prompt": body["prompt_token_ids"]}, False  # vLLM's token-id spelling
    return body, endpoint == "chat"


def query_of_body(body: bytes, complete: bool = True, path: str = "") -> tuple[str, dict[str, Any]]:
    """``(model, lookup keywords)`` of a raw JSON body that must name its model, sent to ``path``: an
    Anthropic, Responses or generate body as :func:`as_lookup_body` shapes it; a completions or chat body,
    or one to any other path, by whichever of ``prompt`` and ``messages`` it has. ``complete=False``: the
    proxy sent only part of it (its buffer limit), so a parse failure is 413. For the picker, which never
    rewrites a body: Anthropic images are read as chat images are there (the engine keys them by its own
    digest, so a lookup matches up to an image's first block)."""
    data = json_object(body, complete)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("request body has no model")
    endpoint = endpoint_of_path(path)
    shaped, chat = as_lookup_body(endpoint, data, images=True) if endpoint else (data, False)
    return model, body_query(shaped, chat=chat if endpoint in ("messages", "responses", "generate") else None)


def error_body(api: API, status: int, message: str, kind: str = "") -> dict[str, Any]:
    """An error in the API's own shape: Anthropic's ``{"type":"error","error":{type,message}}``,
    OpenAI's (and Responses') ``{"error":{message,type,param,code}}``."""
    if api == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"),
                                           "message": message}}
    return {"error": {"message": message, "type": kind or "BadRequestError", "param": None, "code": status}}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def chat_usage(usage: object) -> dict[str, Any] | None:
    """Any API's usage as chat's ``{prompt_tokens, prompt_tokens_details.cached_tokens}`` (what the
    decision-quality metrics read). Anthropic's ``input_tokens`` excludes cache reads and writes."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:
        return usage
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # Responses
        return {"prompt_tokens": usage.get("input_tokens"),
                "prompt_tokens_details": {"cached_tokens": details.get("cached_tokens")}}
    read = _int(usage.get("cache_read_input_tokens"))
    if read is None:
        return None
    parts = [_int(usage.get(k)) for k in ("input_tokens", "cache_creation_input_tokens")]
    total = read + sum(p or 0 for p in parts)
    return {"prompt_tokens": total, "prompt_tokens_details": {"cached_tokens": read}}


def event_usage(obj: object) -> dict[str, Any] | None:
    """The usage an SSE event's data carries: chat's top-level ``usage``, Anthropic's (``message_delta``,
    or ``message_start``'s ``message.usage``), Responses' ``response.completed``'s ``response.usage``."""
    if not isinstance(obj, dict):
        return None
    for holder in (obj, obj.get("response"), obj.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]  # type: ignore[no-any-return]
    return None
