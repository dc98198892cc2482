"""OpenAI chat messages and tools into the conversation and tool dicts vLLM 0.33 hands to the chat template.

Re-implemented from vLLM 0.33's behaviour (not copied): request validation (pydantic over the OpenAI
message TypedDicts, with ``extra="allow"``), ``parse_chat_message_content`` / ``_postprocess_messages``
(``vllm/renderers/chat_utils/chat_message.py``), the developer-role fallback (``vllm/renderers/hf.py``) and
the tool dump of ``ChatCompletionToolsParam.model_dump()``. Templates see exactly these keys in this
order, so a template that serialises a whole message or tool call renders what the engine renders.

Pure Python: no transformers, so the engine path can share the checks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvcoord.tokenize.base import InvalidChat, Message, Tool

__all__ = ["consolidate_developer", "dump_tools", "normalize_messages"]

# Every key of every content-part TypedDict vLLM validates against: in the "openai" format, text parts keep
# the part's other keys (e.g. ``cache_control``) and drop these.
_KNOWN_PART_FIELDS = frozenset({
    "type", "text", "image_url", "input_audio", "file", "refusal", "audio_url", "video_url", "image_pil",
    "uuid", "image_embeds", "audio_embeds", "video_embeds", "data", "name", "thinking", "closed",
})
_TEXT_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
_SKIP_IF_NONE = frozenset({"text", "refusal"})
_BILLING_HEADER = "x-anthropic-billing-header"
# Roles whose TypedDict allows ``content: null`` (the others require a string or a list when present).
_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})


def _reordered(d: Mapping[str, Any], declared: Sequence[str]) -> dict[str, Any]:
    """``d`` with its declared keys first, in declaration order, as pydantic returns a validated TypedDict."""
    out = {k: d[k] for k in declared if k in d}
    out.update((k, v) for k, v in d.items() if k not in out)
    return out


def _check_str(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidChat(f"{where} must be a string")
    return value


def _validated_tool_call(where: str, item: object) -> dict[str, Any]:
    """One assistant tool call as pydantic validates ``ChatCompletionMessageFunctionToolCallParam``."""
    if not isinstance(item, Mapping):
        raise InvalidChat(f"{where}: assistant tool_calls entries must be objects")
    if item.get("type") != "function" or not isinstance(item.get("function"), Mapping):
        raise InvalidChat(f"{where}: chat completions only support assistant tool_calls of type 'function'")
    _check_str(f"{where}.id", item.get("id"))
    function = item["function"]
    _check_str(f"{where}.function.name", function.get("name"))
    _check_str(f"{where}.function.arguments", function.get("arguments"))
    call = _reordered(item, ("id", "function", "type"))
    call["function"] = _reordered(function, ("arguments", "name"))
    return call


def _parsed_arguments(arguments: str) -> dict[str, Any]:
    """``_postprocess_messages``: templates get the arguments as a dict; anything unusable becomes ``{}``."""
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(where: str, tool_calls: object) -> list[dict[str, Any]]:
    if isinstance(tool_calls, (str, bytes, Mapping)) or not isinstance(tool_calls, Sequence):
        raise InvalidChat(f"{where}.tool_calls must be a list")
    calls = [_validated_tool_call(f"{where}.tool_calls[{j}]", item) for j, item in enumerate(tool_calls)]
    for call in calls:
        call["function"]["arguments"] = _parsed_arguments(call["function"]["arguments"])
    return calls


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """System text parts lose Claude Code's per-request attribution line (it defeats the prefix cache)."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _part(where: str, part: object, openai: bool) -> str | dict[str, Any] | None:
    """One content part: its text (string format) or the dict the template sees (openai format)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else (part or None)
    if not isinstance(part, Mapping):
        raise InvalidChat(f"{where} must be a string or an object")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        if "tool_reference" in part:
            kind = "tool_reference"
        else:
            raise InvalidChat(f"{where}: Missing 'type' field in multimodal part")
    if not isinstance(kind, str):
        raise InvalidChat(f"{where}: Invalid 'type' field in multimodal part")
    if kind == "tool_reference":
        name = part.get("name")
        if openai:
            return {"type": "tool_reference", "name": name}
        return _check_str(f"{where}.name", name) if name else None
    field = _TEXT_FIELD.get(kind)
    if field is None:
        raise InvalidChat(f"{where}: Unsupported chat content part type: {kind!r}")
    text = part.get(field)
    if text is None and kind in _SKIP_IF_NONE:
        return None
    text = _check_str(f"{where}.{field}", text)
    if openai:
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        return {"type": "text", "text": text, **extra}
    return text or None  # the string format joins the non-empty texts (vLLM drops falsy parts)


def _content(where: str, role: str, content: object, openai: bool) -> str | list[dict[str, Any]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise InvalidChat(f"{where}.content must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    parsed = [p for j, part in enumerate(parts)
              if (p := _part(f"{where}.content[{j}]", part, openai)) is not None]
    if openai:
        return [p for p in parsed if isinstance(p, dict)]
    return "\n".join(p for p in parsed if isinstance(p, str))


def _tool_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Tool results sent as all-text parts become one string (most templates only handle strings)."""
    if not isinstance(content, list) or any(item.get("type") != "text" for item in content):
        return content
    return "\n".join(str(item.get("text", "")) for item in content)


def _developer_tool(tool: object) -> dict[str, Any] | None:
    """A developer-message tool as ``ChatCompletionFunctionToolParam`` validates it; None if it does not."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return None
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return None
    if ("description" in function and not isinstance(function["description"], str)) or (
            "parameters" in function and not isinstance(function["parameters"], Mapping)) or (
            function.get("strict") is not None and _as_bool(function["strict"]) is None):
        return None
    t = _reordered(tool, ("function", "type"))
    t["function"] = _reordered(function, ("name", "description", "parameters", "strict"))
    if function.get("strict") is not None:
        t["function"]["strict"] = _as_bool(function["strict"])
    return t


def _fits_custom_message(msg: Message) -> bool:
    """Whether ``msg`` validates as vLLM's ``CustomChatCompletionMessageParam`` (its typed fields all fit).

    Only then are a developer message's ``tools`` validated (and their keys reordered); otherwise pydantic
    picks OpenAI's developer message, which keeps ``tools`` as an untyped extra.
    """
    content = msg.get("content", "")
    return (isinstance(content, str) or (isinstance(content, list)
                                         and all(isinstance(p, (str, Mapping)) for p in content))) and all(
        msg.get(key) is None or isinstance(msg[key], str) for key in ("tool_call_id", "task")) and (
        "name" not in msg or isinstance(msg["name"], str)) and (
        msg.get("reasoning") is None or isinstance(msg["reasoning"], (str, Mapping)))


def _developer_tools(msg: Message) -> object:
    """A developer message's ``tools``: validated (keys reordered) when the message fits vLLM's custom
    message type and they fit ``ChatCompletionFunctionToolParam``; otherwise the value as it is.
    """
    tools = msg.get("tools")
    if tools is None or isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        return tools
    validated = [_developer_tool(t) for t in tools]
    if any(t is None for t in validated) or not _fits_custom_message(msg):
        return tools
    return validated


def _message(i: int, msg: Message, openai: bool) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = msg.get("role")
    if not isinstance(role, str):
        raise InvalidChat(f"{where}.role must be a string")
    if "content" in msg and msg["content"] is None and role not in _NULL_CONTENT_ROLES:
        raise InvalidChat(f"{where}.content must not be null for role {role!r}")
    if "name" in msg and not isinstance(msg["name"], str) and role != "tool":  # OpenAI's tool type: no name
        raise InvalidChat(f"{where}.name must be a string")
    if role == "tool" and msg.get("tool_call_id") is not None and not isinstance(msg["tool_call_id"], str):
        raise InvalidChat(f"{where}.tool_call_id must be a string")
    out: dict[str, Any] = {"role": role, "content": _content(where, role, msg.get("content"), openai)}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            calls = _tool_calls(where, msg["tool_calls"])
            if calls:  # an empty list is dropped, keeping templates on the plain assistant path
                out["tool_calls"] = calls
        reasoning = msg.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        out["content"] = _tool_content(out["content"])
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if isinstance(msg.get("task"), str):
        out["task"] = msg["task"]
    if role == "developer":
        out["tools"] = _developer_tools(msg)
    return out


def normalize_messages(
    messages: Sequence[Message], content_format: Literal["string", "openai"]
) -> list[dict[str, Any]]:
    """The conversation the template receives, built from already-checked request messages."""
    openai = content_format == "openai"
    return [_message(i, msg, openai) for i, msg in enumerate(messages)]


def _system_text(content: object) -> str:
    if not isinstance(content, list):
        return content if isinstance(content, str) else ""
    texts = [p["text"] if isinstance(p, dict) else p for p in content
             if isinstance(p, str) or (isinstance(p, dict) and "text" in p)]
    return "\n".join(texts)


def consolidate_developer(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that never names the ``developer`` role: developer turns become system turns (their
    ``tools`` dropped), and several or late system turns merge into one at the front, joined by a blank line.
    """
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m["role"] == "developer" else m for m in conversation]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            rest.append(msg)
            continue
        merge = merge or i > 0 or bool(texts)
        if text := _system_text(msg.get("content", "")):
            texts.append(text)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _as_bool(value: object) -> bool | None:
    """pydantic's lax bool: True/False, 0/1 and the usual strings; None where pydantic would refuse it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else None
    return None


def _opt_bool(where: str, value: object) -> bool | None:
    if value is None:
        return None
    b = _as_bool(value)
    if b is None:
        raise InvalidChat(f"{where} must be a boolean or null")
    return b


def dump_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The request's tools as ``[ChatCompletionToolsParam.model_dump()]``: model fields only, ``description``
    and ``parameters`` kept even when null, ``strict``/``defer_loading`` only when set (a tool-level
    ``defer_loading`` also fills the function's).
    """
    out: list[dict[str, Any]] = []
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        if not isinstance(tool, Mapping):
            raise InvalidChat(f"{where} must be an object")
        if tool.get("type", "function") != "function":
            raise InvalidChat(f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidChat(f"{where}.function must be an object")
        fn: dict[str, Any] = {"name": _check_str(f"{where}.function.name", function.get("name"))}
        description, parameters = function.get("description"), function.get("parameters")
        if description is not None and not isinstance(description, str):
            raise InvalidChat(f"{where}.function.description must be a string or null")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidChat(f"{where}.function.parameters must be an object or null")
        fn["description"] = description
        fn["parameters"] = None if parameters is None else dict(parameters)
        strict = _opt_bool(f"{where}.function.strict", function.get("strict"))
        defer = _opt_bool(f"{where}.function.defer_loading", function.get("defer_loading"))
        tool_defer = _opt_bool(f"{where}.defer_loading", tool.get("defer_loading"))
        if defer is None:
            defer = tool_defer
        if strict is not None:
            fn["strict"] = strict
        if defer is not None:
            fn["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": "function", "function": fn}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        out.append(dumped)
    return out
