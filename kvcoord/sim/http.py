"""The sim-engine's OpenAI-compatible HTTP server, shaped like vLLM's (``--http-listen``).

So that routers, benchmarks and end-to-end tests run real HTTP against an engine whose cache is real:
``POST /v1/completions`` and ``/v1/chat/completions`` (streaming as SSE, one chunk per generated token),
Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses`` and vLLM's ``/inference/v1/generate``
(:mod:`kvcoord.sim.http_apis`), ``POST /tokenize``, ``GET /v1/models``, ``/health`` and ``/metrics``
with vLLM's names and labels. Field
names follow vLLM's ``vllm/entrypoints/openai`` protocol; ``usage.prompt_tokens_details.cached_tokens``
(which vLLM reports with ``--enable-prompt-tokens-details``) is always there and is what the pool
served from its cache. Text becomes tokens with :mod:`kvcoord.tokenize.toktok`.

Deliberate differences from vLLM: one choice per request (``n`` and batched prompts are refused);
generation always runs to ``max_tokens`` (no EOS, ``stop`` is ignored) and defaults to the engine's
``--output-len`` when absent; no logprobs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcoord.extra_keys import MultiModalItem, RequestKeys
from kvcoord.router.answer import KV_SOURCE_HEADER
from kvcoord.sim import pd
from kvcoord.sim.http_apis import add_api_routes
from kvcoord.sim.pull import PEER_PATH, PeerPuller, peer_handler
from kvcoord.tokenize import toktok
from kvcoord.tokenize.base import InvalidChat
from kvcoord.tokenize.media import (
    DEFAULT_IMAGE_TOKENS,
    MediaRule,
    assign_uuids,
    expand_placeholders,
    has_media,
    with_placeholders,
)
from kvcoord.transport import ListenError, split_hostport

if TYPE_CHECKING:
    from kvcoord.agent.requests import Admission
    from kvcoord.sim.engine import SimEngine

log = logging.getLogger(__name__)

__all__ = ["SimHttpServer"]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _BadRequest(Exception):
    """A request vLLM would refuse: becomes its ``{"error": {...}}`` body."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class _Params:
    """What a completion or chat request asks for, validated."""

    prompt: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    keys: RequestKeys | None
    seed: int | None
    kv: pd.Transfer | None = None
    """The request's ``kv_transfer_params`` (with ``--kv-role``; :mod:`kvcoord.sim.pd`)."""


class _EngineCollector(Collector):
    """vLLM's metric names, read from the pool at scrape time (on the engine's loop)."""

    def __init__(self, engine: SimEngine, model: str, dp_rank: int) -> None:
        self.engine = engine
        self.labels = [model, str(dp_rank)]

    def collect(self) -> Iterable[Metric]:
        e, names = self.engine, ["model_name", "engine"]
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             e.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.pool.usage),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.labels, value)
            yield g
        counters = (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", e.generation_tokens),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             e.prompt_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             e.hit_tokens),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(self.labels, value)
            yield c


class _Generation:
    """One HTTP request in the pool: admitted on enter (maybe after waiting), finished on exit."""

    def __init__(self, engine: SimEngine, params: _Params, interval: float) -> None:
        self.engine = engine
        self.params = params
        self.interval = interval
        self.rid = engine.new_request_id("http")
        self.admission: Admission | None = None
        self.completion_tokens = 0
        self.finish_reason = "length"

    async def __aenter__(self) -> _Generation:
        self.admission = adm = await self.engine.admit(self.rid, self.params.prompt, self.params.keys)
        try:  # in line for compute: only the uncached tokens cost prefill time
            await self.engine.clock.prefill(adm.num_tokens - adm.num_cached_tokens)
        except BaseException:
            self.engine.finish(self.rid)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.finish(self.rid)

    async def tokens(self) -> AsyncIterator[int]:
        """One token per ``interval``, each appended to the pool (and its KV events published)."""
        p, clock = self.params, self.engine.clock
        for i, tok in enumerate(toktok.generate(p.prompt, p.max_tokens, p.seed)):
            if i or not clock.costs.enabled:  # with a cost model the prefill's step makes the first token
                await clock.decode(self.interval)
            if self.engine.closing:
                self.finish_reason = "abort"
                return
            if not self.engine.extend_one(self.rid, tok):
                return  # the pool is full of other requests: stop here, at "length"
            self.completion_tokens += 1
            yield tok

    def usage(self) -> dict[str, Any]:
        n = len(self.params.prompt)
        cached = self.admission.num_cached_tokens if self.admission is not None else 0
        cached = pd.cached_tokens(self.params.kv, cached, n, self.engine.pool.block_size)
        return {"prompt_tokens": n, "total_tokens": n + self.completion_tokens,
                "completion_tokens": self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _int_field(body: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}", param=name)
    return value


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        bad = next((t for t in value if not 0 <= t < toktok.VOCAB), None)
        if bad is not None:
            raise _BadRequest(f"Token id {bad} is out of vocabulary", param="prompt")
        return list(value)
    return None


def _completion_prompt(body: dict[str, Any]) -> list[int]:
    """``prompt`` as a string or token ids (or a list of exactly one of those)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise _BadRequest("add_special_tokens must be a boolean", param="add_special_tokens")
    if isinstance(prompt, str):
        return toktok.tokenize(prompt, add_special_tokens=add_special)
    ids = _token_ids(prompt)
    if ids is None:
        raise _BadRequest("prompt must be a string or a list of token ids (batched prompts are not "
                          "supported by the sim-engine)", param="prompt")
    return ids


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _BadRequest(f"{name} must be a boolean", param=name)
    return value


def _own_ids(messages: list[Any]) -> list[Any]:
    """Image parts without a ``uuid`` get the engine's own identifier. vLLM's is a BLAKE3 digest of the
    decoded pixels, which no router reproduces; the sim-engine's is a digest of the router's one, so that
    here too only a forwarded uuid keys the blocks as the router hashed them."""
    given = [[isinstance(p, dict) and p.get("uuid") is not None for p in m["content"]]
             if isinstance(m, dict) and isinstance(m.get("content"), list) else [] for m in messages]
    out = assign_uuids(messages)
    for msg, had in zip(out, given, strict=True):
        for j, part_had in enumerate(had):
            part = msg["content"][j]
            if not part_had and isinstance(part, dict) and "uuid" in part:
                digest = hashlib.blake2b(part["uuid"].encode(), digest_size=16).hexdigest()
                msg["content"][j] = {**part, "uuid": f"sim-{digest}"}
    return out


def _chat_prompt(body: dict[str, Any], media: MediaRule) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """``messages`` rendered with the toy template and tokenized (vLLM's chat defaults), and its images:
    each an ``<image>`` expanded to ``media.tokens``, identified by the part's ``uuid`` (vLLM's
    ``multi_modal_uuids``) or else by the engine's own digest of its URL (:mod:`kvcoord.tokenize.media`)."""
    messages = body.get("messages")
    try:
        options: dict[str, Any] = {
            "add_generation_prompt": _bool_field(body, "add_generation_prompt", True),
            "continue_final_message": _bool_field(body, "continue_final_message", False),
            "add_special_tokens": _bool_field(body, "add_special_tokens", False), "tools": body.get("tools")}
        if not has_media(messages):
            return toktok.tokenize_chat(messages, **options), ()
        assert isinstance(messages, list)
        text_only, uuids = with_placeholders(_own_ids(messages), media)
        return expand_placeholders(toktok.tokenize_chat(text_only, **options), toktok.IMAGE, uuids, media)
    except (toktok.ChatTemplateError, InvalidChat) as exc:
        raise _BadRequest(str(exc), param="messages") from None


class SimHttpServer:
    """aiohttp on the engine's own loop: every handler touches the pool from that loop only."""

    def __init__(self, engine: SimEngine, *, model: str, token_interval: float, default_max_tokens: int,
                 dp_rank: int = 0, pull_us_per_block: float | None = None,
                 kv_role: str | None = None, image_tokens: int = DEFAULT_IMAGE_TOKENS) -> None:
        self.engine = engine
        self.media = MediaRule("<image>", image_tokens)
        self.puller = PeerPuller(engine, pull_us_per_block / 1e6) if pull_us_per_block is not None else None
        """Honours llm-d's peer-pull header (kvcoord.sim.pull); None: ignores it."""
        self.kv = pd.KvConnector(kv_role) if kv_role else None
        """vLLM's disaggregated prefill/decode protocol (None: ``kv_transfer_params`` is ignored)."""
        self.model = model
        self.token_interval = token_interval
        self.default_max_tokens = max(1, default_max_tokens)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model, dp_rank))
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        add_api_routes(app, self)
        app.router.add_post(PEER_PATH, lambda request: peer_handler(self.engine, request))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self, listen: str) -> None:
        """Listen on ``HOST:PORT``; :class:`ListenError` (one line) when it cannot."""
        host, port = split_hostport(listen)
        # A client going away aborts its request, as in vLLM: waiting or prefilling, it leaves the line.
        runner = web.AppRunner(self.app(), shutdown_timeout=1.0, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host or None, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ListenError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1]) if runner.addresses else port
        if self.kv is not None:
            self.kv.host, self.kv.port = host or "127.0.0.1", self.port
        log.info("sim-engine: OpenAI-compatible API on http://%s:%d (model %s)", host or "0.0.0.0",
                 self.port, self.model)

    async def close(self) -> None:
        """Stop listening; requests in flight end within the runner's short shutdown timeout."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ parsing

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise _BadRequest(f"The model `{model}` does not exist.", status=404, kind="NotFoundError",
                              param="model")
        return body

    def _params(self, body: dict[str, Any], prompt: list[int], *, chat: bool,
                mm_items: tuple[MultiModalItem, ...] = ()) -> _Params:
        if not prompt:
            raise _BadRequest("the prompt is empty", param="prompt")
        max_tokens = _int_field(body, "max_completion_tokens", minimum=1) if chat else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", minimum=1) or self.default_max_tokens
        if (_int_field(body, "n", minimum=1) or 1) != 1:
            raise _BadRequest("the sim-engine serves one choice per request (n must be 1)", param="n")
        limit = self.engine.max_model_len
        if len(prompt) + max_tokens > limit:
            raise _BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.", param="max_tokens")
        stream = _bool_field(body, "stream", False)
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise _BadRequest("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise _BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.",
                              param="cache_salt")
        keys = RequestKeys(cache_salt=salt) if salt is not None else self.engine.keys
        if mm_items:
            keys = dataclasses.replace(keys or RequestKeys(), mm_items=mm_items)
        include_usage = bool(options is not None and options.get("include_usage", True))
        try:
            kv = self.kv.parse(body) if self.kv is not None else None
        except ValueError as exc:
            raise _BadRequest(str(exc), param="kv_transfer_params") from None
        return _Params(prompt, max_tokens, stream, include_usage, keys, _int_field(body, "seed", minimum=0),
                       kv)

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            params = self._params(body, _completion_prompt(body), chat=False)
        except _BadRequest as exc:
            return exc.response()
        return await self._serve(request, params, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt, items = _chat_prompt(body, self.media)
            params = self._params(body, prompt, chat=True, mm_items=items)
        except _BadRequest as exc:
            return exc.response()
        return await self._serve(request, params, chat=True)

    async def _serve(self, request: web.Request, params: _Params, *, chat: bool) -> web.StreamResponse:
        source = request.headers.get(KV_SOURCE_HEADER)
        if source and self.puller is not None:
            await self.puller.pull(source, params.prompt, params.keys)
        gen = _Generation(self.engine, params, self.token_interval)
        if params.stream:
            return await self._stream(request, gen, chat=chat)
        async with gen:
            ids = [tok async for tok in gen.tokens()]
            text = toktok.detokenize(ids)
            head = self._head(chat, stream=False)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0, "logprobs": None, "finish_reason": gen.finish_reason, "stop_reason": None,
                    "message": {"role": "assistant", "content": text.lstrip(" "), "refusal": None,
                                "tool_calls": [], "reasoning_content": None}}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason,
                          "stop_reason": None, "prompt_logprobs": None}
            out = {**head, "choices": [choice], "usage": gen.usage()}
            if self.kv is not None and gen.admission is not None:
                out["kv_transfer_params"] = self.kv.answer(params.kv, gen.rid, gen.admission.block_ids,
                                                           len(params.prompt), self.engine.pool.block_size)
            return web.json_response(out, dumps=_dumps)

    def _head(self, chat: bool, *, stream: bool, rid: str | None = None) -> dict[str, Any]:
        if chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
            return {"id": rid or f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                    "model": self.model}
        return {"id": rid or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model}

    async def _stream(self, request: web.Request, gen: _Generation, *, chat: bool) -> web.StreamResponse:
        """SSE: a chunk per token as it is generated, the finish, the usage if asked, ``[DONE]``. The
        headers go out before admission, as vLLM's do: a waiting request is an open stream, not a stall."""
        head = self._head(chat, stream=True)
        extra = {"usage": None} if gen.params.include_usage else {}
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)

        async def send(choices: list[dict[str, Any]], **more: Any) -> None:
            payload = {**head, "choices": choices, **extra, **more}
            await resp.write(f"data: {_dumps(payload)}\n\n".encode())

        def choice(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish,
                        "stop_reason": None}
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                    "stop_reason": None}

        try:
            async with gen:  # admitted (perhaps after waiting in line) until the last chunk
                if chat:
                    await send([choice(None, role=True)])
                first = True
                async for tok in gen.tokens():
                    text = toktok.detokenize([tok])
                    await send([choice(text.lstrip(" ") if chat and first else text)])
                    first = False
                await send([choice("" if not chat else None, gen.finish_reason)])
                if gen.params.include_usage:
                    await send([], usage=gen.usage())
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client went away: the request ends here (and frees its blocks)
            log.debug("sim-engine: client closed stream %s", gen.rid)
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``prompt`` (completion defaults) or ``messages`` (chat defaults)."""
        try:
            body = await self._body(request)
            if "messages" in body:
                tokens = _chat_prompt(body, self.media)[0]
            elif isinstance(body.get("prompt"), str):
                tokens = _completion_prompt(body)
            else:
                raise _BadRequest("give a string 'prompt' or a 'messages' list", param="prompt")
        except _BadRequest as exc:
            return exc.response()
        return web.json_response({"count": len(tokens), "max_model_len": self.engine.max_model_len,
                                  "tokens": tokens, "token_strs": None}, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.engine.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.closing else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
