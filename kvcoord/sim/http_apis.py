"""The sim-engine's Anthropic ``/v1/messages``, OpenAI ``/v1/responses`` and ``/inference/v1/generate``,
shaped like vLLM's.

Prompts are rendered with :mod:`kvcoord.gateway.apis` (vLLM's mapping onto the chat template, the one
the router uses to look prefixes up) and the toy template of :mod:`kvcoord.tokenize.toktok`. Usage carries
what the pool served from its cache: Anthropic's ``cache_read_input_tokens`` (``input_tokens`` is the
rest, as Anthropic counts), Responses' ``input_tokens_details.cached_tokens``. Streams use each API's
event names (``event:`` lines, as vLLM writes them). ``generate`` answers vLLM's ``GenerateResponse``
(token ids, no usage: vLLM reports none there) and does not stream.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvcoord.extra_keys import MultiModalItem
from kvcoord.gateway.apis import anthropic_messages, error_body, generate_prompt, responses_messages
from kvcoord.gateway.requests import BadRequest
from kvcoord.tokenize import toktok

if TYPE_CHECKING:
    from kvcoord.sim.http import SimHttpServer, _Generation

__all__ = ["add_api_routes"]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {_dumps(data)}\n\n".encode()


def _params_body(body: dict[str, Any], max_key: str) -> dict[str, Any]:
    """The OpenAI fields the engine's checks read, from another API's body."""
    out = {"max_tokens": body.get(max_key), "stream": body.get("stream"),
           "cache_salt": body.get("cache_salt"), "seed": body.get("seed")}
    return {k: v for k, v in out.items() if v is not None}


def _anthropic_usage(gen: _Generation) -> dict[str, Any]:
    u = gen.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u["completion_tokens"]}


def _responses_usage(gen: _Generation) -> dict[str, Any]:
    u = gen.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class _Apis:
    """The three endpoints over one :class:`~kvcoord.sim.http.SimHttpServer`."""

    def __init__(self, server: SimHttpServer) -> None:
        self.server = server

    async def _start(self, request: web.Request,
                     api: str) -> tuple[dict[str, Any], _Generation] | web.Response:
        from kvcoord.sim.http import _BadRequest, _chat_prompt, _Generation

        s = self.server
        items: tuple[MultiModalItem, ...] = ()
        try:
            body = await s._body(request)
            if api == "generate":
                prompt = list(generate_prompt(body)["prompt"])
                sampling = body.get("sampling_params") or {}
                pseudo = {k: v for k, v in {"max_tokens": sampling.get("max_tokens"),
                                            "cache_salt": body.get("cache_salt")}.items() if v is not None}
                if body.get("stream"):
                    raise _BadRequest("the sim-engine's generate does not stream", param="stream")
            else:
                chat = (anthropic_messages(body, images=True) if api == "anthropic"
                        else responses_messages(body))
                prompt, items = _chat_prompt(chat, s.media)
                pseudo = _params_body(body, "max_tokens" if api == "anthropic" else "max_output_tokens")
            params = s._params(pseudo, prompt, chat=False, mm_items=items)
        except (_BadRequest, BadRequest, toktok.ChatTemplateError) as exc:
            status = getattr(exc, "status", 400)
            kind = "anthropic" if api == "anthropic" else "openai"
            return web.json_response(error_body(kind, status, str(exc)), status=status)  # type: ignore[arg-type]
        return body, _Generation(s.engine, params, s.token_interval)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        started = await self._start(request, "anthropic")
        if isinstance(started, web.Response):
            return started
        _, gen = started
        mid = f"msg_{uuid.uuid4().hex}"
        head = {"id": mid, "type": "message", "role": "assistant", "model": self.server.model}
        if not gen.params.stream:
            async with gen:
                text = toktok.detokenize([t async for t in gen.tokens()]).lstrip(" ")
                return web.json_response({**head, "content": [{"type": "text", "text": text}],
                                          "stop_reason": _stop(gen), "stop_sequence": None,
                                          "usage": _anthropic_usage(gen)}, dumps=_dumps)

        async def events(send: Callable[[bytes], Awaitable[None]]) -> None:
            usage = _anthropic_usage(gen)
            await send(_sse("message_start", {"type": "message_start", "message": {
                **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}))
            await send(_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}}))
            first = True
            async for tok in gen.tokens():
                text = toktok.detokenize([tok])
                await send(_sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                    "type": "text_delta", "text": text.lstrip(" ") if first else text}}))
                first = False
            await send(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
            await send(_sse("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": _stop(gen), "stop_sequence": None}, "usage": _anthropic_usage(gen)}))
            await send(_sse("message_stop", {"type": "message_stop"}))

        return await _stream(request, gen, events)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        started = await self._start(request, "responses")
        if isinstance(started, web.Response):
            return started
        body, gen = started
        rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        head = {"id": rid, "object": "response", "created_at": int(time.time()), "model": self.server.model,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens")}

        def final(text: str) -> dict[str, Any]:
            length = gen.finish_reason == "length"
            return {**head, "status": "incomplete" if length else "completed",
                    "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                    "output": [_message(mid, text, "completed")], "usage": _responses_usage(gen)}

        if not gen.params.stream:
            async with gen:
                text = toktok.detokenize([t async for t in gen.tokens()]).lstrip(" ")
                return web.json_response(final(text), dumps=_dumps)
        seq = iter(range(1 << 30))

        async def events(send: Callable[[bytes], Awaitable[None]]) -> None:
            async def emit(kind: str, **data: Any) -> None:
                await send(_sse(kind, {"type": kind, "sequence_number": next(seq), **data}))

            start: dict[str, Any] = {**head, "status": "in_progress", "output": [], "usage": None}
            await emit("response.created", response=start)
            await emit("response.in_progress", response=start)
            await emit("response.output_item.added", output_index=0, item=_message(mid, "", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": []}
            await emit("response.content_part.added", item_id=mid, output_index=0, content_index=0, part=part)
            text = ""
            async for tok in gen.tokens():
                piece = toktok.detokenize([tok])
                piece = piece.lstrip(" ") if not text else piece
                text += piece
                await emit("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                           delta=piece, logprobs=[])
            await emit("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text,
                       logprobs=[])
            await emit("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                       part={**part, "text": text})
            await emit("response.output_item.done", output_index=0, item=_message(mid, text, "completed"))
            done = final(text)
            await emit("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                       response=done)

        return await _stream(request, gen, events)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = await self._start(request, "generate")
        if isinstance(started, web.Response):
            return started
        body, gen = started
        async with gen:
            ids = [t async for t in gen.tokens()]
        choice = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason, "token_ids": ids}
        return web.json_response({"request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex}",
                                  "choices": [choice], "prompt_logprobs": None, "kv_transfer_params": None},
                                 dumps=_dumps)


def _stop(gen: _Generation) -> str:
    return "max_tokens" if gen.finish_reason == "length" else "end_turn"


def _message(mid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text else []}


_Events = Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]


async def _stream(request: web.Request, gen: _Generation, events: _Events) -> web.StreamResponse:
    """Headers first (a waiting request is an open stream), then the events while admitted."""
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    try:
        async with gen:
            await events(resp.write)
        await resp.write_eof()
    except ConnectionResetError:  # the client went away: the request ends here (and frees its blocks)
        pass
    return resp


def add_api_routes(app: web.Application, server: SimHttpServer) -> None:
    """Serve ``/v1/messages``, ``/v1/responses`` and ``/inference/v1/generate`` on ``app``."""
    apis = _Apis(server)
    app.router.add_post("/v1/messages", apis.messages)
    app.router.add_post("/v1/responses", apis.responses)
    app.router.add_post("/inference/v1/generate", apis.generate)
