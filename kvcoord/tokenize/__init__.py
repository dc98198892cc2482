"""Prompt text and OpenAI chat messages to the exact token ids vLLM's OpenAI server feeds its engine.

Lookups by prompt or chat hash these ids (``kvcoord.hashing``), so they must be the engine's own: the same
tokenizer, the same chat template, the same message normalisation and the same ``add_special_tokens``
defaults (True for completions, False for chats). Two sources per model:

* a local Hugging Face tokenizer directory (:class:`~kvcoord.tokenize.local.LocalTokenizer`, through
  transformers as vLLM 0.33 uses it; the ``tokenize`` extra, imported only when one is opened);
* an engine's ``http(s)://`` base URL (:class:`~kvcoord.tokenize.remote.RemoteTokenizer`, through vLLM's
  ``/tokenize``).

For simulation and tests, the source ``sim:toktok`` opens the sim-engine's toy tokenizer in-process
(:class:`~kvcoord.tokenize.toktok.ToyTokenizer`): the ids its ``/tokenize`` answers, without the round trip.

:func:`open_tokenizer` opens one; :class:`TokenizerCache` keeps one per model, loaded on first use.
Every failure is a one-line :class:`TokenizeError` naming the model: a lookup never degrades to zero blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Unpack

from kvcoord.extra_keys import MultiModalItem
from kvcoord.tokenize.base import ChatOptions, ChatTemplateContentFormat, Message, TokenizeError, Tokenizer
from kvcoord.tokenize.media import MediaRule, encode_media_chat, has_media
from kvcoord.tokenize.toktok import SOURCE as SIM_SOURCE
from kvcoord.tokenize.toktok import ToyTokenizer

if TYPE_CHECKING:
    from kvcoord.tokenize.local import LocalTokenizer
    from kvcoord.tokenize.remote import RemoteTokenizer

__all__ = ["SIM_SOURCE", "TokenizerCache", "TokenizerSpec", "is_local_directory", "open_tokenizer"]


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def is_local_directory(source: str) -> bool:
    """Whether ``source`` names a tokenizer directory (not an engine URL, not the sim-engine's toy one)."""
    return not _is_url(source) and source != SIM_SOURCE


def open_tokenizer(
    model: str,
    source: str,
    *,
    timeout: float = 5.0,
    chat_template: str | None = None,
    chat_template_content_format: ChatTemplateContentFormat = "auto",
    default_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Tokenizer:
    """Open the tokenizer of ``model``: ``source`` is a local tokenizer directory, an engine's base URL, or
    ``sim:toktok`` (the sim-engine's toy tokenizer, in-process; simulation and tests only).

    A directory is loaded now (seconds: run it off the event loop); a URL opens lazily on the first call
    and ``timeout`` bounds each request. The chat options mirror the engine's ``--chat-template``,
    ``--chat-template-content-format`` and ``--default-chat-template-kwargs`` and apply to directories
    only: an engine already applies its own.
    """
    if not model:
        raise ValueError("model must be a non-empty name")
    if not is_local_directory(source):
        local_only = (chat_template, chat_template_content_format != "auto", default_chat_template_kwargs)
        if any(local_only):
            raise TokenizeError(model, "chat template options apply to a local tokenizer directory only; "
                                "the engine applies its own", source=source)
        if source == SIM_SOURCE:
            return ToyTokenizer(model)
        from kvcoord.tokenize.remote import RemoteTokenizer

        remote: RemoteTokenizer = RemoteTokenizer(model, source, timeout=timeout)
        return remote
    from kvcoord.tokenize.local import LocalTokenizer

    local: LocalTokenizer = LocalTokenizer.load(
        model, source, chat_template=chat_template, chat_template_content_format=chat_template_content_format,
        default_chat_template_kwargs=default_chat_template_kwargs)
    return local


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Where a model's tokenizer comes from and how the engine renders its chats (:func:`open_tokenizer`)."""

    source: str
    timeout: float = 5.0
    chat_template: str | None = None
    chat_template_content_format: ChatTemplateContentFormat = "auto"
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    media: MediaRule = field(default_factory=MediaRule)
    """How the model's processor lays images into the prompt (:mod:`kvcoord.tokenize.media`)."""

    def open(self, model: str) -> Tokenizer:
        return open_tokenizer(
            model, self.source, timeout=self.timeout, chat_template=self.chat_template,
            chat_template_content_format=self.chat_template_content_format,
            default_chat_template_kwargs=self.default_chat_template_kwargs or None)


class TokenizerCache:
    """One tokenizer per model, opened on first use and then shared; safe to use from several threads.

    Opening a local tokenizer takes seconds, so each model is opened once (concurrent first callers wait for
    the same load; other models are not blocked). A failed open is remembered for ``retry_after`` seconds,
    so a broken directory does not cost a reload per request, and then tried again.
    """

    def __init__(
        self, specs: Mapping[str, TokenizerSpec | str] | None = None, *, retry_after: float = 10.0
    ) -> None:
        self._lock = threading.Lock()
        self._specs: dict[str, TokenizerSpec] = {}
        self._loaded: dict[str, Tokenizer] = {}
        self._failed: dict[str, tuple[float, TokenizeError]] = {}
        self._loading: dict[str, threading.Lock] = {}
        self._retry_after = retry_after
        for model, spec in (specs or {}).items():
            self.configure(model, spec)

    def configure(self, model: str, spec: TokenizerSpec | str) -> None:
        """Set (or replace) where ``model``'s tokenizer comes from; a replaced one is reopened on next use."""
        if not model:
            raise ValueError("model must be a non-empty name")
        spec = TokenizerSpec(spec) if isinstance(spec, str) else spec
        with self._lock:
            self._specs[model] = spec
            self._loaded.pop(model, None)
            self._failed.pop(model, None)

    def models(self) -> list[str]:
        """The configured model names, sorted."""
        with self._lock:
            return sorted(self._specs)

    def spec(self, model: str) -> TokenizerSpec | None:
        with self._lock:
            return self._specs.get(model)

    def _cached(self, model: str) -> Tokenizer | None:
        """The loaded tokenizer, or None to load it; raises for unknown models and remembered failures."""
        with self._lock:
            if (tok := self._loaded.get(model)) is not None:
                return tok
            if model not in self._specs:
                raise TokenizeError(model, "no tokenizer is configured for this model", bad_request=True)
            failed = self._failed.get(model)
            if failed is not None and time.monotonic() - failed[0] < self._retry_after:
                raise failed[1]
            return None

    def get(self, model: str) -> Tokenizer:
        """``model``'s tokenizer, opening it now if needed (blocking: on an event loop use :meth:`aget`)."""
        if (tok := self._cached(model)) is not None:
            return tok
        with self._lock:
            gate = self._loading.setdefault(model, threading.Lock())
        with gate:
            if (tok := self._cached(model)) is not None:
                return tok
            with self._lock:
                spec = self._specs[model]
            try:
                tok = spec.open(model)
            except TokenizeError as exc:
                with self._lock:
                    self._failed[model] = (time.monotonic(), exc)
                raise
            except Exception as exc:
                err = TokenizeError(model, f"cannot open the tokenizer: {type(exc).__name__}: {exc}",
                                    source=spec.source)
                with self._lock:
                    self._failed[model] = (time.monotonic(), err)
                raise err from exc
            with self._lock:
                if self._specs.get(model) is spec:  # not reconfigured meanwhile
                    self._loaded[model] = tok
                    self._failed.pop(model, None)
            return tok

    async def aget(self, model: str) -> Tokenizer:
        """``model``'s tokenizer; a first open runs in a worker thread, off the event loop."""
        if (tok := self._cached(model)) is not None:
            return tok
        return await asyncio.to_thread(self.get, model)

    async def encode_prompt(self, model: str, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """:meth:`Tokenizer.encode_prompt` of ``model``'s tokenizer."""
        tok = await self.aget(model)
        return await tok.encode_prompt(prompt, add_special_tokens=add_special_tokens)

    async def encode_chat(
        self, model: str, messages: Sequence[Message], **chat: Unpack[ChatOptions]
    ) -> list[int]:
        """:meth:`Tokenizer.encode_chat` of ``model``'s tokenizer (its defaults for what ``chat`` omits)."""
        tok = await self.aget(model)
        return await tok.encode_chat(messages, **chat)

    async def encode_chat_items(
        self, model: str, messages: Sequence[Message], **chat: Any
    ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """:meth:`encode_chat`, and the chat's multimodal items: a chat with image parts is rendered with
        the model's placeholder rule (:func:`~kvcoord.tokenize.media.encode_media_chat`)."""
        if not has_media(messages):
            return await self.encode_chat(model, messages, **chat), ()
        tok = await self.aget(model)
        spec = self.spec(model)
        try:
            return await encode_media_chat(tok, messages, spec.media if spec else MediaRule(), **chat)
        except ValueError as exc:  # InvalidChat: a malformed image part
            if isinstance(exc, TokenizeError):
                raise
            raise TokenizeError(model, str(exc), source=tok.source, bad_request=True) from None

    async def warm(self, model: str) -> float:
        """Open ``model``'s tokenizer and tokenize a short prompt, so that the first lookup pays neither for
        loading a directory nor for the HTTP client's first connection (a router's deadline is tens of
        milliseconds); returns the seconds it took. Raises :class:`TokenizeError` as a lookup would."""
        t0 = time.perf_counter()
        await self.encode_prompt(model, "kvcoord warm-up")
        return time.perf_counter() - t0

    async def aclose(self) -> None:
        """Close every opened tokenizer (their connections); they reopen on next use."""
        with self._lock:
            opened, self._loaded = list(self._loaded.values()), {}
        for tok in opened:
            await tok.aclose()
