"""The request APIs' prompts as vLLM maps them onto a chat (kvcoord/gateway/apis.py), field by field,
and their usage read back as chat's."""

from __future__ import annotations

import json

import pytest

from kvcoord.gateway.apis import as_lookup_body, chat_usage, error_body, event_usage
from kvcoord.gateway.requests import BadRequest, body_query


def test_anthropic_system_blocks_tools_and_tool_results() -> None:
    body = {"model": "m", "max_tokens": 5, "temperature": 0.2,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                       {"type": "text", "text": "Be brief. "}],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"properties": {}}}],
            "messages": [
                {"role": "system", "content": "Extra."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"p": "."}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
                {"role": "ctx", "content": [{"type": "text", "text": "go on"}]}]}
    chat, is_chat = as_lookup_body("messages", body)
    assert is_chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief. Extra."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "hmm", "content": "looking", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": '{"p": "."}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
        {"role": "user", "content": "go on"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "ls", "description": "list", "parameters": {"properties": {}, "type": "object"}}}]
    assert "temperature" not in chat
    assert body_query(chat, chat=True)["messages"] == chat["messages"]


def test_responses_instructions_items_and_merges() -> None:
    body = {"model": "m", "instructions": "Sys", "tool_choice": "auto",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                      {"type": "web_search"}],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                      {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text",
                                                                                   "text": "think"}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "42"},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]}
    chat, is_chat = as_lookup_body("responses", body)
    assert is_chat
    assert chat["messages"] == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "reasoning": "think", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done"}]
    function = {"name": "f", "parameters": {"type": "object"}}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert as_lookup_body("responses", {"input": "hello"})[0] == {"messages": [{"role": "user",
                                                                                "content": "hello"}]}


def test_token_ids() -> None:
    assert as_lookup_body("generate", {"token_ids": [1, 2], "cache_salt": "s"}) == (
        {"prompt": [1, 2], "cache_salt": "s"}, False)
    shaped, _ = as_lookup_body("completions", {"prompt_token_ids": [3, 4]})
    assert body_query(shaped, chat=False) == {"tokens": [3, 4]}


@pytest.mark.parametrize(("endpoint", "body"), [
    ("messages", {"messages": "hi"}),
    ("messages", {"messages": [{"role": "bot", "content": "x"}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                             "content": [{"type": "image", "source": {
                                                                 "type": "url", "url": "https://x/y.png"}}]}]}]}),
    ("responses", {"input": 3}),
    ("responses", {"input": "x", "previous_response_id": "resp_1"}),
    ("generate", {"token_ids": [-1]}),
])
def test_unreadable_bodies(endpoint: str, body: dict[str, object]) -> None:
    with pytest.raises(BadRequest) as err:
        as_lookup_body(endpoint, body)
    if "image" in json.dumps(body):  # an Anthropic image, in a message or a tool result: the reason given
        assert "no uuid" in str(err.value) and "image_url" in str(err.value)


def test_usage_and_errors() -> None:
    read = {"input_tokens": 10, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0,
            "output_tokens": 1}
    assert chat_usage(read) == {"prompt_tokens": 42, "prompt_tokens_details": {"cached_tokens": 32}}
    assert chat_usage({"input_tokens": 42, "input_tokens_details": {"cached_tokens": 32}}) == {
        "prompt_tokens": 42, "prompt_tokens_details": {"cached_tokens": 32}}
    assert chat_usage({"input_tokens": 3, "output_tokens": 1}) is None
    assert event_usage({"type": "response.completed", "response": {"usage": {"input_tokens": 1}}}) == {
        "input_tokens": 1}
    assert event_usage({"type": "message_start", "message": {"usage": {"input_tokens": 2}}}) == {
        "input_tokens": 2}
    assert error_body("anthropic", 400, "bad") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                              "message": "bad"}}
    assert error_body("responses", 412, "no")["error"]["code"] == 412
