"""The tokenizer source ``sim:toktok``: the sim-engine's toy tokenizer opened in-process by serve and route,
so lookups in front of sim-engines need no ``/tokenize`` round trip. Its ids must be the ones a real
sim-engine's ``/tokenize`` answers (the ids the engine hashes), checked here against a running engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcoord.coordinator.config import parse_model_spec
from kvcoord.coordinator.config_values import ConfigError
from kvcoord.tokenize import SIM_SOURCE, TokenizerCache, open_tokenizer, toktok
from kvcoord.tokenize.base import TokenizeError
from kvcoord.tokenize.toktok import ToyTokenizer
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port

MODEL = "sim-model"
PROMPTS = ["w1 w2 w3", "  spaced\tout\nwords  ", "<s>specials <|im_start|>mid<|im_end|> text", "",
           "ünïcode ✓", " ".join(f"w{i % 500}" for i in range(3000))]  # the last one off the event loop
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi there"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"},
                  {"role": "assistant", "content": "because"}], "add_generation_prompt": False,
     "continue_final_message": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "add_special_tokens": True},
]


def test_the_source_opens_the_toy_tokenizer() -> None:
    tok = open_tokenizer(MODEL, SIM_SOURCE)
    assert isinstance(tok, ToyTokenizer)
    assert (tok.model, tok.source) == (MODEL, "sim:toktok")
    with pytest.raises(TokenizeError, match="local tokenizer directory only"):
        open_tokenizer(MODEL, SIM_SOURCE, chat_template="{{ x }}")


async def test_ids_are_the_sim_engines(tmp_path: Path) -> None:
    """Prompts (with and without BOS) and chats: the same ids as a running sim-engine's /tokenize."""
    http, pub = free_port(), free_port_pair()
    cmd = kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--replay-bind",
                      f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, "--algo", "sha256_cbor", "--hash-seed",
                      "0", "--block-size", "4", "--http-listen", f"127.0.0.1:{http}", "--rate", "0",
                      "--requests", "0")
    tok = TokenizerCache({MODEL: SIM_SOURCE})
    with running(cmd, log=tmp_path / "engine.log"):
        wait_for_port(http, timeout=30)
        async with aiohttp.ClientSession() as s:
            async def engine(body: dict[str, Any]) -> list[int]:
                async with s.post(f"http://127.0.0.1:{http}/tokenize", json={"model": MODEL, **body}) as r:
                    assert r.status == 200, await r.text()
                    tokens: list[int] = (await r.json())["tokens"]
                    return tokens

            for prompt in PROMPTS:
                for special in (True, False):
                    assert await tok.encode_prompt(MODEL, prompt, add_special_tokens=special) == await engine(
                        {"prompt": prompt, "add_special_tokens": special})
            for chat in CHATS:
                options = {k: v for k, v in chat.items() if k != "messages"}
                assert await tok.encode_chat(MODEL, chat["messages"], **options) == await engine(chat)


async def test_bad_chats_are_bad_requests() -> None:
    tok = open_tokenizer(MODEL, SIM_SOURCE)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    for messages, kwargs, match in (([{"content": "no role"}], {}, "role"),
                                    ([image], {}, "multimodal input is not supported"),
                                    ([{"role": "user", "content": "x"}], {"tools": []}, "empty array")):
        with pytest.raises(TokenizeError, match=match) as err:
            await tok.encode_chat(messages, **kwargs)
        assert err.value.bad_request and err.value.source == SIM_SOURCE


def test_a_model_spec_names_it_without_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenizer=sim:toktok`` is neither checked as a directory nor made relative to the working one."""
    monkeypatch.chdir(tmp_path)
    model = parse_model_spec(f"{MODEL},algo=sha256_cbor,block_size=16,seed=0,tokenizer={SIM_SOURCE}", None)
    assert model.tokenizer is not None and model.tokenizer.source == SIM_SOURCE
    assert not (tmp_path / SIM_SOURCE).exists()
    with pytest.raises(ConfigError, match="tokenizer"):  # a directory that does not exist still is one
        parse_model_spec(f"{MODEL},algo=sha256_cbor,block_size=16,seed=0,tokenizer=sim:other", None)


def test_word_ids_are_the_hash_whatever_the_cache_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Word ids are memoised; a full memo is emptied, and ids stay the hash's."""
    monkeypatch.setattr(toktok, "_ID_CACHE_MAX", 7)
    words = [f"x{i % 11}" for i in range(40)]
    for _ in range(2):
        assert toktok.tokenize(" ".join(words)) == [toktok.BOS, *map(toktok.word_id, words)]
        assert len(toktok._ID_CACHE) <= 7
