"""kvcoord.tokenize: prompt text and chat messages to the token ids vLLM 0.33's OpenAI server feeds its
engine.

The oracle is transformers itself on the same locally built tokenizer directory (tests/tokenizers.py):
``apply_chat_template(conversation, tools=..., tokenize=True)`` over the conversation vLLM's normalisation
produces, written out independently here from vLLM's rules, and ``tok(text, add_special_tokens=...)`` (the
path vLLM takes). The engine path runs against a real aiohttp server implementing vLLM's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvcoord.tokenize import TokenizerCache, TokenizerSpec, open_tokenizer
from kvcoord.tokenize.base import TokenizeError
from kvcoord.tokenize.chat import dump_tools, normalize_messages
from kvcoord.tokenize.local import LocalTokenizer
from kvcoord.tokenize.remote import RemoteTokenizer, tokenize_url
from kvcoord.tokenize.template import detect_content_format
from tests.procs import REPO, free_port
from tests.tokenizers import BOS_TEMPLATE, CHATML_TEMPLATE, PARTS_TEMPLATE, build_tokenizer

MODEL = "test-model"


# --- fixtures ------------------------------------------------------------------------------------
@dataclass
class Pair:
    """Our tokenizer and an independently loaded transformers tokenizer for the same directory."""

    ours: LocalTokenizer
    hf: Any
    path: Path
    content_format: str


def _pair(path: Path, content_format: str) -> Pair:
    from transformers import AutoTokenizer

    ours = open_tokenizer(MODEL, str(path))
    assert isinstance(ours, LocalTokenizer)
    return Pair(ours, AutoTokenizer.from_pretrained(str(path)), path, content_format)


@pytest.fixture(scope="session")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(build_tokenizer(tmp_path_factory.mktemp("chatml")), "string")


@pytest.fixture(scope="session")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(build_tokenizer(tmp_path_factory.mktemp("parts"), template=PARTS_TEMPLATE), "openai")


@pytest.fixture(scope="session")
def bos(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(build_tokenizer(tmp_path_factory.mktemp("bos"), template=BOS_TEMPLATE, bos=True), "string")


@pytest.fixture(params=["chatml", "parts", "bos"])
def pair(request: pytest.FixtureRequest) -> Pair:
    value = request.getfixturevalue(request.param)
    assert isinstance(value, Pair)
    return value


# --- random requests, and the conversation vLLM makes of them -----------------------------------
ALPHABET = [*"abc XYZ 012 \n\t.,;:!?{}[]\"'\\/<>|_-", "中", "文", "🙂", "é", "<|im_start|>", "<|im_end|>",
            "<|endoftext|>", "  ", "\r\n", "Paris", " the", "weather"]


@dataclass
class Case:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    expected: dict[str, list[dict[str, Any]]]  # content format -> conversation the template must get
    expected_tools: list[dict[str, Any]] | None
    add_generation_prompt: bool


class Gen:
    """Seeded random chats: the request a client sends, and what vLLM hands the template for it."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, n: int = 40, *, nonempty: bool = False) -> str:
        s = "".join(self.rng.choice(ALPHABET) for _ in range(self.rng.randint(0, n)))
        return s or ("x" if nonempty else s)

    def content(self) -> tuple[Any, list[str]]:
        """Request content (a string or a list of parts) and its texts in order."""
        if self.rng.random() < 0.6:
            s = self.text(60)
            return s, [s]
        texts = [self.text(20) for _ in range(self.rng.randint(1, 3))]
        parts: list[Any] = []
        for t in texts:
            r = self.rng.random()
            parts.append(t if r < 0.3 else {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}
                         if r < 0.45 else {"type": "text", "text": t})
        return parts, texts

    def tools(self) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        if self.rng.random() < 0.5:
            return None, None
        req, exp = [], []
        for i in range(self.rng.randint(1, 3)):
            fn: dict[str, Any] = {"name": f"tool_{i}"}
            if self.rng.random() < 0.7:
                fn["description"] = self.text(20)
            if self.rng.random() < 0.7:
                fn["parameters"] = {"type": "object", "properties": {"q": {"type": "string"}},
                                    "required": ["q"]}
            if self.rng.random() < 0.2:
                fn["strict"] = True
            tool: dict[str, Any] = {"type": "function", "function": fn, "x-extra": 1}
            if self.rng.random() < 0.2:
                del tool["type"]  # defaults to "function"
            req.append(tool)
            dumped = {"name": fn["name"], "description": fn.get("description"),
                      "parameters": fn.get("parameters")}
            if "strict" in fn:
                dumped["strict"] = True
            exp.append({"type": "function", "function": dumped})
        return req, exp

    def case(self) -> Case:
        msgs: list[dict[str, Any]] = []
        # each: (request message, string-format message, openai-format message)
        triples: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []

        def add(req: dict[str, Any], s: dict[str, Any], o: dict[str, Any]) -> None:
            msgs.append(req)
            triples.append((req, s, o))

        def plain(role: str, content: Any, texts: list[str]) -> None:
            # The string format joins the non-empty texts; the openai format keeps every part.
            joined = "\n".join(t for t in texts if t)
            add({"role": role, "content": content}, {"role": role, "content": joined},
                {"role": role, "content": [{"type": "text", "text": t, **_extra(content, i)}
                                           for i, t in enumerate(texts)]})

        if self.rng.random() < 0.6:
            plain("system", *self.content())
        for turn in range(self.rng.randint(1, 5)):
            if self.rng.random() < 0.15:
                s = self.text(30)
                add({"role": "developer", "content": s}, {"role": "developer", "content": s},
                    {"role": "developer", "content": [{"type": "text", "text": s}], "tools": None})
            plain("user", *self.content())
            r = self.rng.random()
            if r < 0.3:
                self.tool_turn(add)
            elif r < 0.45:
                content, reasoning = self.text(40), self.text(30, nonempty=True)
                key = self.rng.choice(["reasoning", "reasoning_content"])
                add({"role": "assistant", "content": content, key: reasoning},
                    {"role": "assistant", "content": content, "reasoning": reasoning,
                     "reasoning_content": reasoning},
                    {"role": "assistant", "content": [{"type": "text", "text": content}],
                     "reasoning": reasoning, "reasoning_content": reasoning})
            elif r < 0.85 or turn == 0:
                plain("assistant", *self.content())
        tools, expected_tools = self.tools()
        string = _consolidate([s for _, s, _ in triples])
        return Case(msgs, tools, {"string": string, "openai": [o for _, _, o in triples]}, expected_tools,
                    self.rng.random() < 0.8)

    def tool_turn(self, add: Any) -> None:
        args = {"city": self.text(8), "n": self.rng.randint(0, 9), "nested": {"k": [1, self.text(4)]}}
        raw = json.dumps(args, ensure_ascii=self.rng.random() < 0.5)
        bad = self.rng.random() < 0.1
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments":
                                                                 "{not json" if bad else raw}}
        exp_call = {"id": "call_1", "function": {"arguments": {} if bad else args, "name": "get_weather"},
                    "type": "function"}
        content = self.rng.choice([None, "", self.text(10)])
        add({"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "assistant", "content": content or "", "tool_calls": [exp_call]},
            {"role": "assistant", "content": [{"type": "text", "text": content}] if content else [],
             "tool_calls": [exp_call]})
        result, texts = self.content()
        add({"role": "tool", "tool_call_id": "call_1", "content": result},
            {"role": "tool", "content": "\n".join(t for t in texts if t), "tool_call_id": "call_1"},
            {"role": "tool", "content": "\n".join(texts), "tool_call_id": "call_1"})


def _extra(content: Any, i: int) -> dict[str, Any]:
    """The extra keys an "openai"-format text part keeps (here: cache_control)."""
    if isinstance(content, list) and isinstance(content[i], dict) and "cache_control" in content[i]:
        return {"cache_control": content[i]["cache_control"]}
    return {}


def _consolidate(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM, for a template without the developer role: developer -> system; then, if a system turn is not
    first or there are several, all system texts merged at the front with a blank line between them."""
    if not any(m["role"] == "developer" for m in conv):
        return conv
    conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if systems == [0]:
        return conv
    merged = "\n\n".join(m["content"] for m in conv if m["role"] == "system" and m["content"])
    return [{"role": "system", "content": merged}, *[m for m in conv if m["role"] != "system"]]


def _oracle_ids(pair: Pair, conv: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' own tokenization of the template, and vLLM's render-then-encode: they must agree."""
    ids = pair.hf.apply_chat_template(conv, tokenize=True, return_dict=False, **kwargs)
    text = pair.hf.apply_chat_template(conv, tokenize=False, **kwargs)
    assert ids == pair.hf(text, add_special_tokens=False)["input_ids"]
    return list(ids)


# --- completions ---------------------------------------------------------------------------------
def test_prompt_ids_match_transformers(pair: Pair) -> None:
    assert pair.ours.hf_tokenizer.truncation_side == "left"  # as vLLM loads a generative model's tokenizer
    gen = Gen(1)
    prompts = ["", "hello", "The quick brown fox", "<|im_start|>user\nhi<|im_end|>", "中文 🙂 é\r\n\t"]
    prompts += [gen.text(200) for _ in range(200)]
    for p in prompts:
        for special in (True, False):
            assert pair.ours.encode_prompt_sync(p, add_special_tokens=special) == \
                pair.hf(p, add_special_tokens=special)["input_ids"], (p, special)


def test_concurrent_encodes_from_threads(chatml: Pair) -> None:
    gen = Gen(5)
    prompts = [gen.text(400) for _ in range(64)]
    expected = [chatml.hf(p)["input_ids"] for p in prompts]
    results: dict[int, list[int]] = {}

    def work(start: int) -> None:
        for i in range(start, len(prompts), 8):
            results[i] = chatml.ours.encode_prompt_sync(prompts[i])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == expected


async def test_prompt_special_tokens_default_and_bos(bos: Pair, chatml: Pair) -> None:
    bos_id = bos.hf.convert_tokens_to_ids("<|endoftext|>")
    with_bos = await bos.ours.encode_prompt("hello world")  # vLLM's CompletionRequest default: True
    without = await bos.ours.encode_prompt("hello world", add_special_tokens=False)
    assert with_bos == [bos_id, *without]
    assert await chatml.ours.encode_prompt("hello") == await chatml.ours.encode_prompt(
        "hello", add_special_tokens=False)  # no post-processor special tokens
    # Chat: the template writes BOS; vLLM's chat default (False) keeps it single, True doubles it.
    msgs = [{"role": "user", "content": "hi"}]
    assert (await bos.ours.encode_chat(msgs))[:2] == [bos_id, bos.hf.convert_tokens_to_ids("<|im_start|>")]
    assert (await bos.ours.encode_chat(msgs, add_special_tokens=True))[:2] == [bos_id, bos_id]


# --- chats ---------------------------------------------------------------------------------------
def test_chat_ids_match_apply_chat_template(pair: Pair) -> None:
    gen = Gen(42)
    seen_tools = seen_dev = 0
    for _ in range(300):
        case = gen.case()
        seen_tools += case.tools is not None
        seen_dev += any(m["role"] == "developer" for m in case.messages)
        snapshot = json.dumps(case.messages)
        ours = pair.ours.encode_chat_sync(case.messages, tools=case.tools,
                                          add_generation_prompt=case.add_generation_prompt)
        expected = _oracle_ids(pair, case.expected[pair.content_format], tools=case.expected_tools,
                               add_generation_prompt=case.add_generation_prompt)
        assert ours == expected, case
        assert json.dumps(case.messages) == snapshot  # the caller's messages are never modified
    assert seen_tools > 50 and seen_dev > 20


def test_render_matches_transformers(chatml: Pair) -> None:
    gen = Gen(7)
    for _ in range(50):
        case = gen.case()
        assert chatml.ours.render_chat(case.messages, tools=case.tools) == chatml.hf.apply_chat_template(
            case.expected["string"], tools=case.expected_tools, add_generation_prompt=True, tokenize=False)


async def test_continue_final_message(pair: Pair) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "The weather is"}]
    ours = await pair.ours.encode_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    conv = normalize_messages(msgs, "openai" if pair.content_format == "openai" else "string")
    assert ours == _oracle_ids(pair, conv, add_generation_prompt=False, continue_final_message=True)
    text = pair.hf.decode(ours)
    assert text.endswith("The weather is") and not text.endswith("<|im_end|>\n")


async def test_chat_template_kwargs_precedence(tmp_path: Path) -> None:
    path = build_tokenizer(tmp_path / "tok")
    think_off = "<think>\n\n</think>\n\n"
    plain = open_tokenizer(MODEL, str(path))
    defaults = open_tokenizer(MODEL, str(path), default_chat_template_kwargs={"enable_thinking": False})
    assert isinstance(plain, LocalTokenizer) and isinstance(defaults, LocalTokenizer)
    msgs = [{"role": "user", "content": "hi"}]
    assert not plain.render_chat(msgs).endswith(think_off)
    assert plain.render_chat(msgs, chat_template_kwargs={"enable_thinking": False}).endswith(think_off)
    assert defaults.render_chat(msgs).endswith(think_off)  # --default-chat-template-kwargs
    assert not defaults.render_chat(msgs, chat_template_kwargs={"enable_thinking": True}).endswith(think_off)
    # None and "auto" in the request's kwargs are unset: the server default stays.
    assert defaults.render_chat(msgs, chat_template_kwargs={"enable_thinking": None}).endswith(think_off)
    # The request's own add_generation_prompt wins over the same key in chat_template_kwargs.
    text = plain.render_chat(msgs, chat_template_kwargs={"add_generation_prompt": False})
    assert text.endswith("<|im_start|>assistant\n")
    # Variables the template never reads are dropped (vLLM's kwargs filter), not an error.
    assert plain.render_chat(msgs, chat_template_kwargs={"unused_flag": 1}) == plain.render_chat(msgs)


async def test_tokenize_flag_in_kwargs_lets_transformers_encode(bos: Pair) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    # tokenize=True in chat_template_kwargs: transformers encodes (without special tokens), as in vLLM.
    ids = await bos.ours.encode_chat(msgs, chat_template_kwargs={"tokenize": True}, add_special_tokens=True)
    assert ids == await bos.ours.encode_chat(msgs)


def test_normalisation_details() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nkeep"},
                                       {"type": "text", "text": "x-anthropic-billing-header: only"}]},
        {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"t": 1}}, "b",
                                     {"type": "text", "text": None}, {"type": "refusal", "refusal": "r"}],
         "name": "bob", "task": "t", "weird": 1},
        {"role": "assistant", "content": None, "reasoning": "why", "tool_calls": [
            {"type": "function", "index": 0, "function": {"name": "f", "arguments": "[1]"}, "id": "c"},
            {"id": "d", "type": "function", "function": {"arguments": "", "name": "g"}}]},
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "1"}, "2"]},
        {"role": "developer", "content": "d",
         "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
        {"role": "developer", "content": "e", "tools": [{"function": {"name": "f"}}]},  # not valid: kept raw
    ]
    string = normalize_messages(msgs, "string")
    assert string[0] == {"role": "system", "content": "keep"}
    assert string[1] == {"role": "user", "content": "a\nb\nr", "name": "bob", "task": "t"}
    calls = string[2]["tool_calls"]
    assert [list(c) for c in calls] == [["id", "function", "type", "index"], ["id", "function", "type"]]
    assert [list(c["function"]) for c in calls] == [["arguments", "name"], ["arguments", "name"]]
    assert [c["function"]["arguments"] for c in calls] == [{}, {}]  # a JSON array and "" both become {}
    assert string[2]["content"] == "" and string[2]["reasoning_content"] == "why"
    assert "tool_calls" not in string[3]
    assert string[4] == {"role": "tool", "content": "1\n2", "tool_call_id": "c"}
    assert string[5]["tools"] == [{"function": {"name": "f", "x": 1}, "type": "function"}]
    assert string[6]["tools"] == [{"function": {"name": "f"}}]
    openai = normalize_messages(msgs, "openai")
    assert openai[1]["content"] == [{"type": "text", "text": "a", "cache_control": {"t": 1}},
                                    {"type": "text", "text": "b"}, {"type": "text", "text": "r"}]
    assert openai[2]["content"] == [] and openai[4]["content"] == "1\n2"
    tool = {"function": {"name": "n", "strict": "true", "defer_loading": None}, "defer_loading": 1, "x": 2}
    assert dump_tools([tool]) == [{"type": "function", "function": {
        "name": "n", "description": None, "parameters": None, "strict": True, "defer_loading": True},
        "defer_loading": True}]


@pytest.mark.parametrize(("template", "expected"), [
    (CHATML_TEMPLATE, "string"),
    (PARTS_TEMPLATE, "openai"),  # via a macro parameter fed message.content
    ("{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content | list %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for c in m.content %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{% set content = m.content %}{% for c in content %}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% for t in tools %}{% endfor %}", "string"),
    ("{% for k, v in messages %}{% endfor %}", "string"),  # a loop vLLM's search cannot follow
    ("{% for m in messages %", "string"),  # does not parse
])
def test_content_format_detection(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


# --- refusals ------------------------------------------------------------------------------------
MEDIA_PARTS = [
    {"type": "image_url", "image_url": {"url": "http://example.invalid/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "http://example.invalid/v.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "http://example.invalid/a.wav"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "prompt_embeds", "data": "AAAA"},
    {"type": "file", "file": {"file_id": "f"}},
    {"image_url": "http://example.invalid/cat.png", "uuid": "u"},
]


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=lambda p: str(p.get("type", "untyped")))
async def test_refuses_multimodal_content(chatml: Pair, part: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    with pytest.raises(TokenizeError, match="multimodal") as info:
        await chatml.ours.encode_chat(msgs)
    assert info.value.bad_request and MODEL in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "Cannot set both"),
    ({"tools": []}, "empty array"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "trust-request-chat-template"),
    ({"messages": [{"role": "user", "content": [{"type": "foo", "text": "x"}]}]}, "Unsupported"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "Missing 'type'"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
    ({"messages": [{"role": "user", "content": None}]}, "must not be null"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "name must be a string"),
    ({"messages": [{"content": "x"}]}, "role must be a string"),
    ({"messages": ["hello"]}, "not an object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]},
     "type 'function'"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "arguments must be a string"),
    ({"messages": [{"role": "assistant", "content": "a",
                    "reasoning": {"type": "prompt_embeds", "data": "x"}}]},
     "prompt embeddings"),
    ({"tools": [{"type": "retrieval"}]}, "type must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "description"),
])
async def test_refuses_what_vllm_refuses(chatml: Pair, kwargs: dict[str, Any], match: str) -> None:
    messages = kwargs.pop("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizeError, match=match) as info:
        await chatml.ours.encode_chat(messages, **kwargs)
    assert info.value.bad_request and info.value.model == MODEL and "\n" not in str(info.value)


async def test_template_errors_are_tokenize_errors(tmp_path: Path) -> None:
    raising = "{{ raise_exception('only user turns, please') }}"
    tok = open_tokenizer(MODEL, str(build_tokenizer(tmp_path / "r", template=raising)))
    with pytest.raises(TokenizeError, match="only user turns, please") as info:
        await tok.encode_chat([{"role": "user", "content": "x"}])
    assert info.value.bad_request
    broken = open_tokenizer(MODEL, str(build_tokenizer(tmp_path / "b", template="{% for m in messages %}")))
    with pytest.raises(TokenizeError, match=MODEL):
        await broken.encode_chat([{"role": "user", "content": "x"}])
    assert await broken.encode_prompt("still fine") == await tok.encode_prompt("still fine")


async def test_no_chat_template_and_the_chat_template_option(tmp_path: Path) -> None:
    path = build_tokenizer(tmp_path / "t", template=None)
    bare = open_tokenizer(MODEL, str(path))
    with pytest.raises(TokenizeError, match="no chat template") as info:
        await bare.encode_chat([{"role": "user", "content": "x"}])
    assert not info.value.bad_request
    literal = open_tokenizer(MODEL, str(path), chat_template=CHATML_TEMPLATE)
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(CHATML_TEMPLATE, encoding="utf-8")
    from_file = open_tokenizer(MODEL, str(path), chat_template=str(template_file))
    msgs = [{"role": "user", "content": "x"}]
    assert await literal.encode_chat(msgs) == await from_file.encode_chat(msgs) != []
    with pytest.raises(TokenizeError, match="cannot be read"):
        open_tokenizer(MODEL, str(path), chat_template="no_such_template_name")


def _assert_one_line_naming_model(exc: TokenizeError, *needles: str) -> None:
    text = str(exc)
    assert "\n" not in text and repr(MODEL) in text, text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize("damage", ["garbage-json", "garbage-config", "missing", "empty", "a-file"])
def test_corrupt_tokenizer_directory(tmp_path: Path, damage: str) -> None:
    path = build_tokenizer(tmp_path / "tok")
    if damage == "garbage-json":
        (path / "tokenizer.json").write_text("{ this is not json", encoding="utf-8")
    elif damage == "garbage-config":
        (path / "tokenizer_config.json").write_text("[[[", encoding="utf-8")
        (path / "tokenizer.json").write_bytes(b"\x00\x01")
    elif damage == "missing":
        path = tmp_path / "nowhere"
    elif damage == "empty":
        path = tmp_path / "empty"
        path.mkdir()
    else:
        path = path / "tokenizer.json"
    with pytest.raises(TokenizeError) as info:
        open_tokenizer(MODEL, str(path))
    _assert_one_line_naming_model(info.value, str(path))
    assert not info.value.bad_request


@pytest.mark.parametrize(("files", "match"), [
    ({"tekken.json": "{}"}, "Mistral"),
    ({"config.json": json.dumps({"model_type": "gpt_oss"})}, "gpt_oss"),
    ({"config.json": json.dumps({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"})},
     "own renderer"),
    ({"preprocessor_config.json": "{}"}, "processor"),
])
def test_refuses_directories_vllm_renders_otherwise(
    tmp_path: Path, files: dict[str, str], match: str
) -> None:
    path = build_tokenizer(tmp_path / "tok")
    for name, text in files.items():
        (path / name).write_text(text, encoding="utf-8")
    with pytest.raises(TokenizeError, match=match) as info:
        open_tokenizer(MODEL, str(path))
    _assert_one_line_naming_model(info.value)
    if "preprocessor_config.json" in files:  # fine once the template is named explicitly
        assert isinstance(open_tokenizer(MODEL, str(path), chat_template=CHATML_TEMPLATE), LocalTokenizer)


def test_missing_transformers_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_tokenizer(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(TokenizeError, match=r"pip install 'kvcoord\[tokenize\]'") as info:
        open_tokenizer(MODEL, str(path))
    _assert_one_line_naming_model(info.value)


def test_import_does_not_load_transformers() -> None:
    code = (
        "import sys, kvcoord.tokenize as t\n"
        "assert 'transformers' not in sys.modules and 'aiohttp' not in sys.modules, 'eager import'\n"
        "tok = t.open_tokenizer('m', 'http://127.0.0.1:9')\n"
        "assert 'transformers' not in sys.modules, 'the engine path needs no transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# --- the cache -----------------------------------------------------------------------------------
def test_cache_opens_each_model_once_lazily_and_thread_safely(
    chatml: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real_open = TokenizerSpec.open

    def counting_open(self: TokenizerSpec, model: str) -> Any:
        opened.append(model)
        return real_open(self, model)

    monkeypatch.setattr(TokenizerSpec, "open", counting_open)
    cache = TokenizerCache({"a": str(chatml.path), "b": TokenizerSpec(str(chatml.path))})
    assert opened == [] and cache.models() == ["a", "b"]
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("a"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == ["a"] and len({id(t) for t in got}) == 1
    assert cache.get("a") is got[0] and opened == ["a"]
    with pytest.raises(TokenizeError, match="no tokenizer is configured") as info:
        cache.get("unknown")
    assert info.value.bad_request


async def test_cache_remembers_failures_then_retries(tmp_path: Path) -> None:
    path = tmp_path / "later"
    cache = TokenizerCache({MODEL: str(path)}, retry_after=0.2)
    with pytest.raises(TokenizeError, match="not a directory"):
        await cache.aget(MODEL)
    build_tokenizer(path)
    with pytest.raises(TokenizeError, match="not a directory"):  # remembered, not reloaded
        await cache.aget(MODEL)
    await asyncio.sleep(0.25)
    assert await cache.encode_prompt(MODEL, "hello") != []
    assert await cache.encode_chat(MODEL, [{"role": "user", "content": "hi"}]) != []
    await cache.aclose()


# --- the engine path (a real HTTP server implementing vLLM's /tokenize) ---------------------------
@dataclass
class Engine:
    base: str
    received: list[dict[str, Any]]


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _engine_app(local: LocalTokenizer, received: list[dict[str, Any]]) -> web.Application:
    """vLLM's /tokenize: TokenizeCompletionRequest | TokenizeChatRequest in, TokenizeResponse out."""

    async def tokenize(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "Invalid JSON body", "BadRequestError")
        received.append(body)
        if body.get("model") not in (None, local.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        try:
            if "messages" in body:
                tokens = local.encode_chat_sync(
                    body["messages"], tools=body.get("tools"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                    continue_final_message=body.get("continue_final_message", False),
                    chat_template_kwargs=body.get("chat_template_kwargs"),
                    add_special_tokens=body.get("add_special_tokens", False))
            else:
                tokens = local.encode_prompt_sync(body["prompt"],
                                                  add_special_tokens=body.get("add_special_tokens", True))
        except TokenizeError as exc:
            return _error(400, exc.reason, "BadRequestError")
        return web.json_response({"count": len(tokens), "max_model_len": 32768, "tokens": tokens,
                                  "token_strs": None})

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="<html>definitely not json", content_type="text/html")

    async def no_tokens(request: web.Request) -> web.Response:
        return web.json_response({"count": 3})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.json_response({"tokens": []})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/garbage/tokenize", garbage)
    app.router.add_post("/notokens/tokenize", no_tokens)
    app.router.add_post("/slow/tokenize", slow)
    return app


@pytest.fixture
async def engine(chatml: Pair) -> AsyncIterator[Engine]:
    received: list[dict[str, Any]] = []
    runner = web.AppRunner(_engine_app(chatml.ours, received))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Engine(f"http://{host}:{port}", received)
    finally:
        await runner.cleanup()


@pytest.fixture
async def remote(engine: Engine) -> AsyncIterator[RemoteTokenizer]:
    tok = open_tokenizer(MODEL, engine.base + "/v1/", timeout=1.0)
    assert isinstance(tok, RemoteTokenizer)
    try:
        yield tok
    finally:
        await tok.aclose()


def test_tokenize_url() -> None:
    assert tokenize_url("http://h:8000") == "http://h:8000/tokenize"
    assert tokenize_url("http://h:8000/v1/") == "http://h:8000/tokenize"
    assert tokenize_url("https://h/prefix") == "https://h/prefix/tokenize"


async def test_remote_equals_local(remote: RemoteTokenizer, engine: Engine, chatml: Pair) -> None:
    gen = Gen(3)
    for _ in range(40):
        p = gen.text(300)
        for special in (True, False):
            assert await remote.encode_prompt(p, add_special_tokens=special) == \
                chatml.ours.encode_prompt_sync(p, add_special_tokens=special)
    for _ in range(60):
        case = gen.case()
        assert await remote.encode_chat(case.messages, tools=case.tools,
                                        add_generation_prompt=case.add_generation_prompt) == \
            chatml.ours.encode_chat_sync(case.messages, tools=case.tools,
                                         add_generation_prompt=case.add_generation_prompt)
    assert engine.received[0] == {"model": MODEL, "prompt": engine.received[0]["prompt"],
                                  "add_special_tokens": True}


async def test_remote_request_body_is_vllms(remote: RemoteTokenizer, engine: Engine) -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    await remote.encode_chat(msgs, tools=tools, add_generation_prompt=False, continue_final_message=True,
                             chat_template_kwargs={"enable_thinking": False})
    assert engine.received[-1] == {
        "model": MODEL, "add_generation_prompt": False, "continue_final_message": True,
        "add_special_tokens": False,
        "tools": tools, "chat_template_kwargs": {"enable_thinking": False},
        # /tokenize ignores reasoning_content; the chat route renames it, so the client does.
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "a", "reasoning": "r"}],
    }
    assert msgs[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}  # caller's left alone


async def test_remote_engine_400_is_a_bad_request(remote: RemoteTokenizer) -> None:
    with pytest.raises(TokenizeError, match=r"answered 400: .*Unsupported chat content part type") as info:
        await remote.encode_chat([{"role": "user", "content": [{"type": "foo", "text": "x"}]}])
    assert info.value.bad_request and info.value.source == remote.url
    _assert_one_line_naming_model(info.value, remote.url)


async def test_remote_refusals_happen_before_sending(remote: RemoteTokenizer, engine: Engine) -> None:
    for part in MEDIA_PARTS:
        with pytest.raises(TokenizeError, match="multimodal"):
            await remote.encode_chat([{"role": "user", "content": [part]}])
    with pytest.raises(TokenizeError, match="empty array"):
        await remote.encode_chat([{"role": "user", "content": "x"}], tools=[])
    assert engine.received == []


async def test_remote_unknown_model_is_not_a_bad_request(engine: Engine) -> None:
    tok = open_tokenizer("other-model", engine.base)
    try:
        with pytest.raises(TokenizeError, match="answered 404: The model `other-model` does not") as info:
            await tok.encode_prompt("hi")
        assert not info.value.bad_request and "'other-model'" in str(info.value)
    finally:
        await tok.aclose()


async def test_remote_connection_refused() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tok = open_tokenizer(MODEL, url)
    try:
        with pytest.raises(TokenizeError, match="cannot connect") as info:
            await tok.encode_prompt("hi")
        _assert_one_line_naming_model(info.value, url)
        assert not info.value.bad_request
    finally:
        await tok.aclose()


@pytest.mark.parametrize(("path", "match"), [
    ("/garbage", "bad answer .*definitely not json"),
    ("/notokens", "bad answer"),
    ("/slow", r"no answer within 0\.3 s"),
])
async def test_remote_bad_answers(engine: Engine, path: str, match: str) -> None:
    tok = open_tokenizer(MODEL, engine.base + path, timeout=0.3)
    try:
        with pytest.raises(TokenizeError, match=match) as info:
            await tok.encode_prompt("hi")
        _assert_one_line_naming_model(info.value)
    finally:
        await tok.aclose()


def test_remote_refuses_local_only_options() -> None:
    with pytest.raises(TokenizeError, match="local tokenizer directory only"):
        open_tokenizer(MODEL, "http://127.0.0.1:9", chat_template="{{ x }}")


async def test_cache_with_an_engine_source(engine: Engine, chatml: Pair) -> None:
    cache = TokenizerCache({MODEL: TokenizerSpec(engine.base, timeout=2.0)})
    try:
        assert await cache.encode_prompt(MODEL, "hello") == chatml.ours.encode_prompt_sync("hello")
    finally:
        await cache.aclose()

