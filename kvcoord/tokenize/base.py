"""The contract every tokenizer keeps (the :class:`Tokenizer` protocol, :class:`TokenizeError`) and the
request checks that both the local and the engine path apply before tokenizing.

The checks are the ones vLLM 0.33's ``/v1/chat/completions`` applies before rendering, plus refusals of what
token ids alone cannot describe (media, prompt embeddings): a lookup must hash the ids the engine hashes,
and for those inputs the engine's block keys also carry multimodal hashes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, TypedDict

__all__ = [
    "INLINE_CHARS",
    "ChatOptions",
    "ChatTemplateContentFormat",
    "InvalidChat",
    "NamedTokenizer",
    "TokenizeError",
    "Tokenizer",
    "check_chat_request",
    "encode_by_size",
]

INLINE_CHARS = 2048
"""Prompts shorter than this are encoded on the caller's thread (well under a millisecond); longer ones in a
worker thread, so the event loop keeps serving meanwhile."""

ChatTemplateContentFormat: TypeAlias = Literal["auto", "string", "openai"]
"""vLLM's ``--chat-template-content-format``: how message content reaches the template."""

Message: TypeAlias = Mapping[str, Any]
"""One OpenAI-format chat message (JSON object)."""

Tool: TypeAlias = Mapping[str, Any]
"""One OpenAI-format tool (``{"type": "function", "function": {...}}``)."""

# Content-part types (and keys) whose data vLLM hands to its multimodal processor: the ids then hold
# expanded placeholders and the block hashes carry media hashes, so token ids cannot stand for them.
MEDIA_PART_KEYS = frozenset({
    "image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
    "video_url", "video_embeds", "prompt_embeds", "file",
})


class ChatOptions(TypedDict, total=False):
    """:meth:`Tokenizer.encode_chat`'s keywords, for callers passing them on (its defaults hold)."""

    tools: Sequence[Tool] | None
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: Mapping[str, Any] | None
    add_special_tokens: bool


class TokenizeError(ValueError):
    """Tokenizing failed for ``model``; the message is one line naming the model and what failed.

    ``bad_request`` is True when the input is at fault (vLLM would answer 400 for it, or kvcoord cannot
    reproduce vLLM's ids for it), False when the tokenizer itself is unavailable or broken.
    """

    def __init__(
        self, model: str, reason: str, *, source: str | None = None, bad_request: bool = False
    ) -> None:
        self.model = model
        self.source = source
        self.reason = " ".join(reason.split())
        self.bad_request = bad_request
        where = f" ({source})" if source else ""
        super().__init__(f"tokenizer for model {model!r}{where}: {self.reason}")


class InvalidChat(ValueError):
    """A chat request vLLM would refuse, or one whose ids kvcoord cannot reproduce (no model attached yet)."""


class Tokenizer(Protocol):
    """Turns prompt text or chat messages into the token ids vLLM's OpenAI server feeds its engine.

    Defaults are vLLM's: completions add special tokens (BOS via the post-processor), chats do not (the
    template writes them). Every failure is a :class:`TokenizeError` naming the model.
    """

    @property
    def model(self) -> str: ...

    @property
    def source(self) -> str: ...

    async def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of a ``/v1/completions`` string prompt."""
        ...

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
        """The ids of a ``/v1/chat/completions`` request: template rendered, then the text encoded."""
        ...

    async def aclose(self) -> None:
        """Release connections (the engine path); a no-op for a local tokenizer."""
        ...


class NamedTokenizer:
    """What every tokenizer here shares: its model and source, and the one-line errors that name them
    (``error_source``, when given, is what errors name instead of ``source``: the engine path's URL)."""

    def __init__(self, model: str, source: str, *, error_source: str | None = None) -> None:
        self._model = model
        self._source = source
        self._error_source = source if error_source is None else error_source

    @property
    def model(self) -> str:
        return self._model

    @property
    def source(self) -> str:
        return self._source

    def _error(self, reason: str, *, bad_request: bool = False) -> TokenizeError:
        return TokenizeError(self._model, reason, source=self._error_source, bad_request=bad_request)

    def _check_prompt(self, prompt: object) -> None:
        if not isinstance(prompt, str):
            raise self._error("the prompt must be a string", bad_request=True)


class _TextEncoder(Protocol):
    def __call__(self, text: str, /, *, add_special_tokens: bool) -> list[int]: ...


async def encode_by_size(encode: _TextEncoder, prompt: str, add_special_tokens: bool) -> list[int]:
    """``encode(prompt)`` on the caller's thread when it is short (under :data:`INLINE_CHARS` characters),
    else in a worker thread: the rule for a local Hugging Face tokenizer, whose encoding runs in native
    code (the toy tokenizer, pure Python holding the GIL, gains nothing from a thread and encodes on the
    caller's thread)."""
    if len(prompt) < INLINE_CHARS:
        return encode(prompt, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(encode, prompt, add_special_tokens=add_special_tokens)


def _check_parts(where: str, content: object) -> None:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        media = kind if isinstance(kind, str) and kind in MEDIA_PART_KEYS else next(
            (k for k in part if k in MEDIA_PART_KEYS), None)
        if media is not None:
            raise InvalidChat(
                f"{where}.content[{j}] is a {media!r} part: multimodal input is not supported (vLLM expands "
                "media placeholders and hashes the media into the block keys)")


def check_chat_request(
    messages: Sequence[Message],
    tools: Sequence[Tool] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """Refuse what vLLM's chat route refuses up front, and media; return the messages as vLLM's request
    validator leaves them (``reasoning_content`` renamed to ``reasoning``), as fresh shallow copies.
    """
    if add_generation_prompt and continue_final_message:
        raise InvalidChat("Cannot set both `continue_final_message` and `add_generation_prompt` to True")
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise InvalidChat("`tools` must be a list of tool objects")
        if len(tools) == 0:
            raise InvalidChat("`tools` must not be an empty array (vLLM's chat route refuses it): omit it")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InvalidChat("`chat_template_kwargs` must be an object")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidChat("`messages` must be a list of message objects")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidChat(f"messages[{i}] is not an object")
        copy = dict(msg)
        # ChatCompletionRequest._normalize_messages_before: the deprecated name gives way to `reasoning`.
        reasoning_content = copy.pop("reasoning_content", None)
        if reasoning_content is not None and copy.get("reasoning") is None:
            copy["reasoning"] = reasoning_content
        reasoning = copy.get("reasoning")
        if isinstance(reasoning, Mapping) and reasoning.get("type") == "prompt_embeds":
            raise InvalidChat(f"messages[{i}].reasoning holds prompt embeddings: not supported")
        _check_parts(f"messages[{i}]", copy.get("content"))
        out.append(copy)
    return out
