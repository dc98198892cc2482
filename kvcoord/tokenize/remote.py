"""The engine's own tokenizer: vLLM's ``POST /tokenize`` (``vllm/entrypoints/serve/tokenize/``).

The engine renders and encodes with its own tokenizer, template and flags, so this path needs no local
files; it costs one HTTP round trip per lookup. Requests are ``TokenizeCompletionRequest``
(``{model, prompt, add_special_tokens}``) and ``TokenizeChatRequest`` (``{model, messages,
add_generation_prompt, continue_final_message, add_special_tokens, tools?, chat_template_kwargs?}``); the
answer's ``tokens`` are the ids.

``/tokenize`` differs from ``/v1/chat/completions`` in two places, both handled here: it ignores the
deprecated ``reasoning_content`` (the chat route renames it to ``reasoning``; done before sending), and it
accepts ``tools: []`` (the chat route refuses it; refused here). Media parts are refused as on the local path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcoord.tokenize.base import InvalidChat, Message, NamedTokenizer, Tool, check_chat_request

if TYPE_CHECKING:
    import aiohttp

__all__ = ["RemoteTokenizer", "tokenize_url"]

_MAX_ERROR_CHARS = 300


def tokenize_url(base_url: str) -> str:
    """``{base}/tokenize``; a trailing ``/v1`` (as OpenAI base URLs have) is dropped: it lives at the root."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return f"{base}/tokenize"


def _engine_message(body: str) -> str:
    """The message of vLLM's ErrorResponse (``{"error": {"message": …}}`` or older forms), else the body."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
        if isinstance(data.get("detail"), (str, list)):
            return json.dumps(data["detail"]) if isinstance(data["detail"], list) else str(data["detail"])
    text = " ".join(body.split())
    return text[:_MAX_ERROR_CHARS] + ("…" if len(text) > _MAX_ERROR_CHARS else "") or "(empty body)"


class RemoteTokenizer(NamedTokenizer):
    """Tokenizes through an engine's OpenAI server: one aiohttp session per event loop, reused by calls."""

    def __init__(self, model: str, base_url: str, *, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._url = tokenize_url(base_url)
        super().__init__(model, base_url, error_source=self._url)
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return self._url

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
            self._loop = loop
        return self._session

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        import aiohttp

        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise self._error(f"the request is not JSON: {exc}", bad_request=True) from exc
        try:
            async with self._client().post(
                    self._url, data=payload.encode("utf-8"),
                    headers={"Content-Type": "application/json", "Accept": "application/json"}) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        except TimeoutError as exc:
            raise self._error(f"no answer within {self._timeout:g} s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise self._error(f"cannot connect: {exc.os_error or exc}") from exc
        except aiohttp.ClientError as exc:
            raise self._error(f"request failed: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            # 400/422: the engine refused the request itself; anything else is the engine's or URL's fault.
            raise self._error(f"the engine answered {status}: {_engine_message(text)}",
                              bad_request=status in (400, 422))
        try:
            tokens = json.loads(text)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise self._error(f"bad answer (not a JSON object with tokens): {_engine_message(text)}") from exc
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise self._error("bad answer: tokens is not a list of token ids")
        return tokens

    async def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """``TokenizeCompletionRequest``: the engine's ``tok(prompt, add_special_tokens=...)``."""
        self._check_prompt(prompt)
        return await self._tokenize({"model": self._model, "prompt": prompt,
                                     "add_special_tokens": add_special_tokens})

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
        """``TokenizeChatRequest``: the engine renders its template and encodes, as its chat route would."""
        try:
            checked = check_chat_request(messages, tools, add_generation_prompt, continue_final_message,
                                         chat_template_kwargs)
        except InvalidChat as exc:
            raise self._error(str(exc), bad_request=True) from exc
        body: dict[str, Any] = {
            "model": self._model,
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": add_special_tokens,
        }
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template_kwargs is not None:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        return await self._tokenize(body)

    async def aclose(self) -> None:
        """Close the session (if it belongs to the running loop; a session of a finished loop is dropped)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                await session.close()
        self._loop = None

    def __repr__(self) -> str:
        return f"RemoteTokenizer(model={self._model!r}, url={self._url!r})"
