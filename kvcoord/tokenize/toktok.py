"""The sim-engine's toy tokenizer and chat template: the one place text becomes token ids.

The sim-engine has no model, so it cannot have a real tokenizer; what it needs is a tokenizer that is
deterministic, documented and served over ``POST /tokenize``, so that a router tokenizing through the
engine gets exactly the ids the engine hashes into its block pool.

Rules (stable across releases: changing them changes every hash a sim-engine publishes):

- **Special tokens** have fixed ids: ``<pad>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2, ``<|im_start|>`` 3,
  ``<|im_end|>`` 4, ``<image>`` 5 (an image's placeholder); ids below :data:`NUM_SPECIAL` are reserved.
  They are recognised anywhere in the text.
- **Everything else** is split on whitespace; each word becomes ``NUM_SPECIAL + blake2b-64(word) mod
  (VOCAB - NUM_SPECIAL)``. Whitespace itself carries no token (``"a  b"`` and ``"a b"`` are equal).
- ``add_special_tokens`` puts BOS first (vLLM's completions default it on, chat requests off: the
  template brings its own markers).
- **Chat template** (ChatML-like): tools, when given, render first as a ``tools`` turn holding their JSON;
  then each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, where content is a string, or
  the text parts of a list joined by ``"\\n"``, followed by the JSON of any ``tool_calls``;
  ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``; ``continue_final_message`` leaves
  the last message open (no ``<|im_end|>``). A message with image parts is first given string content
  by :mod:`kvcoord.tokenize.media` (an ``<image>`` per image, then the text), by the HTTP server.
- **Generated text** is drawn from :data:`WORDS`, one word per token, so what the engine generates
  re-tokenizes to the same ids.

:class:`ToyTokenizer` is the same tokenizer behind the :class:`~kvcoord.tokenize.base.Tokenizer` protocol,
opened by the tokenizer source :data:`SOURCE` (``tokenizer=sim:toktok``): a coordinator or router in front
of sim-engines then tokenizes in-process, without a ``/tokenize`` round trip. It is for simulation and
tests only; no real model tokenizes this way.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvcoord.tokenize.base import (
    InvalidChat,
    Message,
    NamedTokenizer,
    Tool,
    check_chat_request,
)

__all__ = [
    "BOS",
    "IMAGE",
    "NUM_SPECIAL",
    "SOURCE",
    "SPECIAL_TOKENS",
    "VOCAB",
    "WORDS",
    "ChatTemplateError",
    "ToyTokenizer",
    "detokenize",
    "generate",
    "render_chat",
    "tokenize",
    "tokenize_chat",
    "word_id",
]

SOURCE = "sim:toktok"
"""The tokenizer source (a model's ``tokenizer=``, route's ``--tokenizer``) opening :class:`ToyTokenizer`."""
VOCAB = 32_000
"""Token ids are in ``0 .. VOCAB - 1``."""
NUM_SPECIAL = 8
SPECIAL_TOKENS: dict[str, int] = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4,
                                  "<image>": 5}
BOS = SPECIAL_TOKENS["<s>"]
IMAGE = SPECIAL_TOKENS["<image>"]
"""An image's placeholder token (a chat's image parts: :mod:`kvcoord.tokenize.media`)."""
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_ID_TO_SPECIAL = {v: k for k, v in SPECIAL_TOKENS.items()}

WORDS: tuple[str, ...] = (
    "the", "a", "cache", "block", "prefix", "token", "node", "router", "engine", "request", "lorem",
    "ipsum", "dolor", "sit", "amet", "fast", "slow", "hit", "miss", "kv", "model", "prompt", "reply",
    "stream", "chunk", "batch", "event", "hash", "seed", "pool", "queue", "load", "served", "warm",
    "cold", "page", "layer", "head", "step", "decode", "prefill", "and", "of", "to", "in", "is", "it",
    "that", "on", "with", "as", "for", "was", "at", "by", "this", "from", "or", "be", "an", "are", "we",
    "not", "yes",
)
"""What the sim-engine "generates": one word per token."""


class ChatTemplateError(ValueError):
    """Messages that the template cannot render (not a list of role/content objects)."""


def word_id(word: str) -> int:
    """A non-special word's id: a hash into the non-reserved part of the vocabulary."""
    digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return NUM_SPECIAL + int.from_bytes(digest, "big") % (VOCAB - NUM_SPECIAL)


_ID_CACHE: dict[str, int] = {}
_ID_CACHE_MAX = 1 << 18
"""Words seen, with their ids: a hash per word made a 14k-word prompt cost tens of milliseconds, a dict
lookup per word a few. Emptied when full (a bound on memory for arbitrary text; ids are unchanged)."""


def _word_ids(words: list[str]) -> list[int]:
    try:  # every word seen before (the usual case): one C-level pass
        return list(map(_ID_CACHE.__getitem__, words))
    except KeyError:
        pass
    ids = []
    for w in words:
        i = _ID_CACHE.get(w)
        if i is None:
            if len(_ID_CACHE) >= _ID_CACHE_MAX:
                _ID_CACHE.clear()
            i = _ID_CACHE[w] = word_id(w)
        ids.append(i)
    return ids


_WORD_OF_ID = {word_id(w): w for w in WORDS}



def tokenize(text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``text`` as token ids (BOS first with ``add_special_tokens``)."""
    out = [BOS] if add_special_tokens else []
    for piece in _SPECIAL_RE.split(text):
        special = SPECIAL_TOKENS.get(piece)
        if special is not None:
            out.append(special)
        else:
            out.extend(_word_ids(piece.split()))
    return out


def detokenize(ids: Sequence[int]) -> str:
    """Text for ids the engine generated (each a :data:`WORDS` entry, space-prefixed); other ids render
    as ``<id>`` placeholders (the toy tokenizer is not invertible for arbitrary words)."""
    parts = []
    for i in ids:
        word = _WORD_OF_ID.get(i)
        parts.append(" " + word if word is not None else _ID_TO_SPECIAL.get(i, f" <{i}>"))
    return "".join(parts)


def generate(prompt: Sequence[int], n: int, seed: int | None = None) -> list[int]:
    """``n`` output ids, a function of the prompt (or of ``seed``): a repeated request gets the same reply,
    as greedy decoding would."""
    if seed is None:
        digest = hashlib.blake2b(b",".join(str(t).encode() for t in prompt), digest_size=8).digest()
        seed = int.from_bytes(digest, "big")
    rng = random.Random(seed)
    return [word_id(rng.choice(WORDS)) for _ in range(n)]


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ChatTemplateError(f"{where}.content parts must be objects")
            if part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}.content text part needs a string 'text'")
                texts.append(text)
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string, a list of parts or null")


def render_chat(messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: Any = None) -> str:
    """The ChatML-like text of ``messages`` (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                                "to True.")
    parts = []
    if tools:
        parts.append(f"<|im_start|>tools\n{json.dumps(tools, sort_keys=True)}<|im_end|>\n")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ChatTemplateError(f"{where} must be an object with a string 'role'")
        text = _content_text(msg.get("content"), where)
        if msg.get("tool_calls"):
            text += ("\n" if text else "") + json.dumps(msg["tool_calls"], sort_keys=True)
        end = "" if continue_final_message and i == len(messages) - 1 else "<|im_end|>\n"
        parts.append(f"<|im_start|>{msg['role']}\n{text}{end}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def tokenize_chat(messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                  add_special_tokens: bool = False, tools: Any = None) -> list[int]:
    """Render ``messages`` with the template, then tokenize (chat requests' defaults, as vLLM's)."""
    text = render_chat(messages, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools)
    return tokenize(text, add_special_tokens=add_special_tokens)


class ToyTokenizer(NamedTokenizer):
    """This module's tokenizer and template behind the Tokenizer protocol: the ids a sim-engine's
    ``/tokenize`` answers, computed in-process (simulation and tests only)."""

    def __init__(self, model: str) -> None:
        super().__init__(model, SOURCE)

    async def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """:func:`tokenize`, as the sim-engine's completions and ``/tokenize`` apply it, on the caller's
        thread whatever the prompt's length (as :meth:`encode_chat`): this is Python holding the GIL, so a
        worker thread would run it no sooner than the event loop, only later. A ~100 KB prompt (~14k
        words) takes ~3 ms of work; handed to a worker thread in a busy ``kvcoord serve`` it took ~20 ms
        of wall time, waiting for the GIL and for the loop to take its result back
        (benchmarks/README.md, "Serve's lookup of a long text prompt: where its time goes")."""
        self._check_prompt(prompt)
        return tokenize(prompt, add_special_tokens=add_special_tokens)

    async def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """:func:`tokenize_chat` after the checks every tokenizer applies; the toy template takes no
        ``chat_template_kwargs`` (the sim-engine ignores them too)."""
        try:
            checked = check_chat_request(messages, tools, add_generation_prompt, continue_final_message,
                                         chat_template_kwargs)
            return tokenize_chat(checked, tools=list(tools) if tools is not None else None,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message,
                                 add_special_tokens=add_special_tokens)
        except (InvalidChat, ChatTemplateError) as exc:
            raise self._error(str(exc), bad_request=True) from None

    async def aclose(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"ToyTokenizer(model={self._model!r})"
