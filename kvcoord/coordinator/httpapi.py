"""The HTTP API: NVIDIA Dynamo's standalone KV indexer API (``python -m dynamo.indexer``), served by the
coordinator, so Dynamo's indexer clients can use kvcoord as it is.

Routes, request and answer JSON, status codes and error texts follow Dynamo 1.6.1's indexer
(``lib/kv-router/src/services/indexer/server.rs``; tested against the real service in
``tests/coordinator/test_http_dynamo_compat.py``). kvcoord adds fields where it knows more and never changes
the
meaning of Dynamo's. The deliberate differences (docs/http-api.md):

- ``/query_by_hash`` takes the *engine's* block hashes (vLLM's ``block_hashes``, as uint64 or as their
  int64 reinterpretation), because kvcoord indexes the engines' own chained hashes; Dynamo takes its own
  block-local xxh3 hashes.
- Errors are ``{"error": "..."}`` JSON everywhere, with Dynamo's status codes (Dynamo answers body
  extractor failures, 400/413/415/422, in ``text/plain``).
- ``/query`` also takes ``prompt`` or ``messages`` (OpenAI chat) instead of ``token_ids``, tokenized
  with the model's tokenizer; answers add ``model``, ``block_size``, ``num_blocks``, ``num_tokens`` and
  ``nodes`` (kvcoord's answer, best first, with per-tier counts, load and the engine URL).
- ``/register`` takes ``tcp://`` endpoints only, or ``grpc_endpoint`` (an engine's ``SubscribeKvEvents``),
  and ``serving_url`` (the engine's HTTP URL) and ``metrics_url`` (its ``/metrics``, scraped for its load)
  besides; past ``max_streams`` registered engines it answers 429 (Dynamo has no such limit).
- ``/workers`` says ``active`` only of an engine that answered within the lease (events or a replay probe):
  else ``connecting``, ``unreachable`` (in no answer) or ``failed`` (Dynamo: ``active`` of any registration).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, cast
from urllib.parse import parse_qs

import msgspec

from kvcoord.coordinator.answers import lookup_answer, match_hits, with_reserved
from kvcoord.coordinator.auth import ADMIN, AGENT, OPEN, Authenticator, AuthError
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.engines import (
    DEFAULT_GROUP,
    PENDING,
    Engines,
    RegistrationError,
    overall,
    partition_model,
)
from kvcoord.coordinator.httpbody import BadBody, check_u64, decode_body, decode_fast
from kvcoord.coordinator.httpd import JSON, Request, Response, Route, json_error
from kvcoord.coordinator.lookup import (
    INVALID,
    NO_PROFILE,
    NOT_FOUND,
    TOKENIZER_DOWN,
    LiveMatch,
    LookupFailed,
    Lookups,
    prompt_keys,
)
from kvcoord.coordinator.nodeinfo import profile_json
from kvcoord.coordinator.pools import check_pool_hello
from kvcoord.coordinator.reservations import lookup_view
from kvcoord.events import Tier
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import UINT64_MASK, BlockHash64
from kvcoord.index.base import run_inline
from kvcoord.roles import check_role
from kvcoord.transport import CAUSE_METADATA, TOKENIZER_CAUSE
from kvcoord.validate import shown

if TYPE_CHECKING:
    from kvcoord.coordinator.fastpath import FastAnswers
    from kvcoord.coordinator.metrics import Metrics

log = logging.getLogger("kvcoord.http")

__all__ = ["QUERY_BODY_LIMIT", "HttpApi"]

QUERY_BODY_LIMIT = 8 * 1024 * 1024
"""Dynamo's body limit of ``/query`` and ``/query_by_hash`` (8 MiB); the other routes have 2 MiB."""

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""At most 2**64-1 as well: checked after decoding (msgspec's bounds stop at int64)."""


class QueryBody(msgspec.Struct):
    model_name: str
    token_ids: list[U32] | None = None
    """With :data:`FastQueryBody` first, this typed form decodes only what the fast path leaves."""
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    lora_name: str | None = None
    cache_salt: str | None = None
    # kvcoord's own:
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_unmatched: bool = False
    # a router's (as gRPC LookupRequest's; kvcoord route --coordinator-http):
    want_block_hashes: bool = False
    router_id: str = ""
    reserve_id: str = ""
    """With ``router_id``: the request id this router's reservation of the pick will carry; the lookup holds
    the query's new prefix for it (:func:`kvcoord.coordinator.reservations.lookup_view`)."""
    wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """How long this lookup may wait for another router's hold on its new prefix (gRPC: the deadline)."""

    def ask(self) -> _Ask | None:
        """A router's extras, or None for a plain lookup."""
        if not (self.want_block_hashes or self.router_id):
            return None
        return _Ask(self.want_block_hashes, self.router_id, self.reserve_id, self.wait_ms / 1000.0)


class _Ask(NamedTuple):
    """What a router asks of a lookup beyond Dynamo's: the query's block hashes, its hold."""

    want_block_hashes: bool = False
    router_id: str = ""
    reserve_id: str = ""
    wait: float = 0.0


_PLAIN = _Ask()


class FastQueryBody(QueryBody):
    """``/query`` once :func:`decode_fast` has taken ``token_ids`` out (the 8k-id list is most of the
    decoding time); every other field is :class:`QueryBody`'s."""

    token_ids: None = None
    """Taken out (null) or absent."""


class QueryByHashBody(msgspec.Struct):
    block_hashes: list[int]
    model_name: str
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    cache_salt: str | None = None
    include_unmatched: bool = False


class FastQueryByHashBody(msgspec.Struct):
    """``/query_by_hash`` once :func:`decode_fast` has taken ``block_hashes`` out (a subclass cannot
    narrow the required ``list[int]`` to ``None``, so the five other fields are repeated here)."""

    model_name: str
    block_hashes: None = None
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    cache_salt: str | None = None
    include_unmatched: bool = False


class RegisterBody(msgspec.Struct):
    instance_id: U64
    model_name: str
    block_size: U32
    endpoint: str | None = None  # ZMQ, or grpc_endpoint: one of them (kvcoord.coordinator.engines.Engines)
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    dp_rank: U32 | None = None
    replay_endpoint: str | None = None
    additional_salt: str | None = None
    additionalsalt: str | None = None
    serving_url: str = ""
    metrics_url: str = ""
    engine: str | None = None
    grpc_endpoint: str = ""
    pools: list[str] = []
    """Shared pools the engine can load blocks from (kvcoord.coordinator.pools)."""
    pool_publisher: str = ""
    """Set: the engine is that pool's storage daemon, not routable (its events feed the pool)."""
    role: str = ""
    """Its P/D role: prefill, decode or both (llm-d's ``llm-d.ai/role``); "" none."""


class UnregisterBody(msgspec.Struct):
    instance_id: U64
    model_name: str
    routing_group: str | None = None
    tenant_id: str | None = None
    dp_rank: U32 | None = None


_encode = msgspec.json.Encoder().encode
_OK = Response(200, b'{"status":"ok"}', JSON)
_CREATED = Response(201, b'{"status":"ok"}', JSON)
_STORAGE_TIERS = {Tier.GPU: "device", Tier.CPU: "host_pinned", Tier.STORAGE: "disk"}


def _worker_id(node_id: str) -> int | str:
    """Dynamo's ``worker_id`` is a number: a registered engine's node id is its instance id."""
    if node_id.isascii() and node_id.isdigit() and int(node_id) <= UINT64_MASK:
        return int(node_id)
    return node_id


def _json(status: int, data: object) -> Response:
    return Response(status, _encode(data), JSON)


_LOOKUP_HTTP = {INVALID: 400, NOT_FOUND: 404, NO_PROFILE: 400, "unavailable": 503, "unimplemented": 501,
                "internal": 500, "tokenizer_down": 503}


def _failed(exc: LookupFailed, metrics: Metrics) -> Response:
    """A failed lookup's answer, counted; a failed tokenizer says so in ``kvcoord-cause`` (gRPC: the
    trailer), so a router tells it from a coordinator outage."""
    metrics.lookup_errors[exc.kind] += 1
    resp = json_error(_LOOKUP_HTTP[exc.kind], exc.message)
    if exc.kind == TOKENIZER_DOWN:
        resp.headers.append((CAUSE_METADATA, TOKENIZER_CAUSE))
    return resp


def _registration_failed(exc: BadBody | RegistrationError | ConnectionError) -> Response:
    """A failed (un)registration's answer: the body's own error, the registry's refusal, or 503 while the
    registrations' store is unreachable."""
    if isinstance(exc, BadBody):
        return exc.response
    if isinstance(exc, RegistrationError):
        return json_error(exc.status, exc.message)
    return json_error(503, f"registrations unavailable: {exc}")


class HttpApi:
    """The routes over one coordinator's state."""

    def __init__(self, state: CoordinatorState, engines: Engines | None, auth: Authenticator) -> None:
        self.state = state
        self.lookups = Lookups(state)
        self.engines = engines
        self.auth = auth
        self.fast: FastAnswers | None = None
        """Plain lookups' fast path (``kvcoord.coordinator.fastpath``), where the server set one."""

    def routes(self) -> dict[str, Route]:
        return {
            "/query": Route({"POST": self.query}, QUERY_BODY_LIMIT),
            "/query_by_hash": Route({"POST": self.query_by_hash}, QUERY_BODY_LIMIT),
            "/register": Route({"POST": self.register}),
            "/unregister": Route({"POST": self.unregister}),
            "/workers": Route({"GET": self.workers}),
            "/dump": Route({"GET": self.dump}),
            "/health": Route({"GET": self.health}),
        }

    # --- auth ------------------------------------------------------------------------------
    def authorize(self, req: Request) -> Response | None:
        """The gRPC API's tokens: any known token may query; registering needs an admin token.
        ``/health`` is open (probes carry no secrets)."""
        if not self.auth.enabled or req.path == "/health":
            return None
        header = req.headers.get("authorization")
        try:
            principal = self.auth.principal([("authorization", header)] if header is not None else [])
        except AuthError as exc:
            return Response(401, _encode({"error": exc.message}), JSON, [("www-authenticate", "Bearer")])
        if req.path in ("/register", "/unregister") and principal.role not in (ADMIN, OPEN) and not (
            principal.role == AGENT and "*" in principal.nodes
        ):
            return json_error(403, f"a {principal.role} token may not {req.path[1:]} engines (admin only)")
        return None

    def may_query(self, header: str) -> bool:
        """Whether an ``authorization`` header's token may look up: :meth:`authorize`'s rule for the
        lookup routes (any known token), for the native answers (``kvcoord.coordinator.fastpath``)."""
        try:
            self.auth.principal([("authorization", header)])
        except AuthError:
            return False
        return True

    # --- lookups ---------------------------------------------------------------------------
    def known(self, model: str) -> bool:
        """A partition Dynamo would have: configured, registered, or served by some node."""
        st = self.state
        if st.config.profile(model) is not None:
            return True
        if self.engines is not None and self.engines.has_model(model):
            return True
        if any(r.model == model for r in st.registry):
            return True
        return any(n.model == model for n in st.replicas.shared.values())

    def _partition(self, model_name: str, routing_group: str) -> str:
        model = partition_model(model_name, routing_group)
        if not self.known(model):
            raise LookupFailed(NOT_FOUND, f"no indexer for model={shown(model_name, quote=False)} "
                                          f"routing_group={shown(routing_group, quote=False)}")
        return model

    def block_size(self, model: str) -> int:
        profile = self.state.config.profile(model)
        if profile is not None:
            return profile.block_size
        if self.engines is not None:
            registered = self.engines.block_size(model)
            if registered is not None:
                return registered
        for rec in self.state.registry:
            if rec.model == model and rec.announced is not None and rec.announced.block_size:
                return rec.announced.block_size
        return 0

    def query(self, req: Request) -> Response | Awaitable[Response]:
        t0 = time.perf_counter()
        try:
            fast = decode_fast(req, FastQueryBody, "token_ids", "I")
            body: FastQueryBody | QueryBody
            tokens: memoryview | array[int] | None
            if fast is not None:
                body, tokens = fast
            else:
                body = decode_body(req, QueryBody)
                tokens = array("I", body.token_ids) if body.token_ids is not None else None
            if tokens is None and body.prompt is None and body.messages is None:  # 422 before 404, as Dynamo
                raise BadBody(json_error(422, "Failed to deserialize the JSON body into the target "
                                              "type: missing field `token_ids`"))
            model = self._partition(body.model_name, body.routing_group)
            if tokens is None:
                return self._query_text(model, body, t0)
            keys = None
            if body.lora_name or body.cache_salt:
                keys = RequestKeys(lora_name=body.lora_name or None, cache_salt=body.cache_salt or None)
            elif self._fast(body.include_unmatched) and body.ask() is None:
                assert self.fast is not None
                answered = self.fast.tokens(model, tokens, len(tokens), t0)
                if answered is not None:
                    return answered
            profile, hashes = self.lookups.hash_tokens(model, tokens, keys)
            return self._answer(model, profile.block_size, hashes, len(tokens), body.include_unmatched,
                                "tokens", t0, body.ask())
        except BadBody as exc:
            return exc.response
        except LookupFailed as exc:
            return _failed(exc, self.state.metrics)

    async def _query_text(self, model: str, body: FastQueryBody | QueryBody, t0: float) -> Response:
        """A lookup by ``prompt`` or chat ``messages``: tokenized as the engine does, then by tokens."""
        try:
            ids, mm_items = await self.lookups.tokens_of(
                model, prompt=body.prompt, messages=body.messages, tools=body.tools,
                add_special_tokens=body.add_special_tokens, add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs)
            keys = prompt_keys(mm_items, body.lora_name, body.cache_salt)
            tokens = array("I", ids)
            profile, hashes = self.lookups.hash_tokens(model, tokens, keys)
            answer = self._answer(model, profile.block_size, hashes, len(tokens), body.include_unmatched,
                                  "prompt", t0, body.ask())
        except LookupFailed as exc:
            return _failed(exc, self.state.metrics)
        return answer if isinstance(answer, Response) else await answer

    def query_by_hash(self, req: Request) -> Response | Awaitable[Response]:
        t0 = time.perf_counter()
        try:
            fast = decode_fast(req, FastQueryByHashBody, "block_hashes", "Q")
            body: FastQueryByHashBody | QueryByHashBody
            hashes: Sequence[BlockHash64]
            keys = None
            if fast is not None:
                body, keys = fast
                if keys is None:  # absent: the typed decode says so, as Dynamo would
                    fast = None
            if fast is None or keys is None:
                typed: QueryByHashBody = decode_body(req, QueryByHashBody)
                body, raw = typed, typed.block_hashes
                if raw and (min(raw) < -(1 << 63) or max(raw) > UINT64_MASK):
                    bad = next(h for h in raw if not -(1 << 63) <= h <= UINT64_MASK)
                    raise BadBody(json_error(422, "Failed to deserialize the JSON body into the target type: "
                                                  f"block_hashes: {bad} is neither an int64 nor a uint64"))
                hashes = [BlockHash64(h & UINT64_MASK) for h in raw]
            else:
                hashes = cast(Sequence[BlockHash64], keys)
            if body.cache_salt is not None:  # before the partition's 404, as Dynamo
                return json_error(400, "cache_salt is not accepted by /query_by_hash; block_hashes must "
                                       "already include the intended cache salt")
            model = self._partition(body.model_name, body.routing_group)
            self.lookups.check_blocks(len(hashes), "")
            if self._fast(body.include_unmatched) and isinstance(hashes, memoryview):
                assert self.fast is not None
                answered = self.fast.hashes(model, hashes, t0)
                if answered is not None:
                    return answered
            return self._answer(model, self.block_size(model), hashes, 0, body.include_unmatched,
                                "hashes", t0)
        except BadBody as exc:
            return exc.response
        except LookupFailed as exc:
            return _failed(exc, self.state.metrics)

    def _fast(self, include_unmatched: bool) -> bool:
        """Whether a plain lookup may take the fast path (its views know no reservations)."""
        return self.fast is not None and not include_unmatched and not self.state.reservations.any()

    def _answer(self, model: str, block_size: int, hashes: Sequence[BlockHash64], num_tokens: int,
                include_unmatched: bool, query: str, t0: float,
                ask: _Ask | None = None) -> Response | Awaitable[Response]:
        """Match, then answer: at once on an in-process index (no task), else when the backend answers;
        with the routers' reservations (and this router's hold) when there are any or it asks."""
        coro = self.lookups.match(model, hashes, None, include_unmatched)
        if ask is not None or self.state.reservations.any():
            return self._reserving(model, block_size, hashes, num_tokens, coro, query, t0, ask or _PLAIN)
        if self.state.index.inline:
            try:
                matches = run_inline(coro)
            except LookupFailed as exc:
                return _failed(exc, self.state.metrics)
            return self._scores(model, block_size, len(hashes), num_tokens, matches, query, t0)

        async def later() -> Response:
            try:
                matches = await coro
            except LookupFailed as exc:
                return _failed(exc, self.state.metrics)
            return self._scores(model, block_size, len(hashes), num_tokens, matches, query, t0)

        return later()

    async def _reserving(self, model: str, block_size: int, hashes: Sequence[BlockHash64], num_tokens: int,
                         coro: Awaitable[list[LiveMatch]], query: str, t0: float, ask: _Ask) -> Response:
        """The general path's answer with the reservations' view (:func:`lookup_view`), as gRPC's Lookup."""
        st = self.state
        try:
            matches = await coro
        except LookupFailed as exc:
            return _failed(exc, self.state.metrics)
        hits = match_hits(matches, lambda pool: st.pools.tier(pool).name)
        start = max((h[2] for h in hits), default=0)
        with_reserved(hits, await lookup_view(st.reservations, ask.router_id, ask.reserve_id, model, hashes,
                                              start, ask.wait))
        return lookup_answer(st, model, block_size, len(hashes), num_tokens, hits, query, t0, "handler",
                             [int(h) for h in hashes] if ask.want_block_hashes else None)

    def _scores(self, model: str, block_size: int, num_blocks: int, num_tokens: int,
                matches: list[LiveMatch], query: str, t0: float) -> Response:
        """The general path's answer."""
        st = self.state
        hits = match_hits(matches, lambda pool: st.pools.tier(pool).name)
        return lookup_answer(st, model, block_size, num_blocks, num_tokens, hits, query, t0, "handler")

    # --- registration ----------------------------------------------------------------------
    async def register(self, req: Request) -> Response:
        if self.engines is None:
            return json_error(501, "engine registration is off on this coordinator")
        try:
            b: RegisterBody = decode_body(req, RegisterBody)
            check_u64("instance_id", b.instance_id)
            try:
                check_pool_hello(str(b.instance_id), b.pool_publisher, b.pools)
                role = check_role(b.role, publisher=b.pool_publisher)
            except ValueError as exc:
                return json_error(400, str(exc))
            await self.engines.register(b.instance_id, b.model_name, b.routing_group, b.block_size, b.dp_rank,
                                        b.endpoint, b.replay_endpoint, b.serving_url, b.metrics_url, b.engine,
                                        b.grpc_endpoint, b.pools, b.pool_publisher, role)
        except (BadBody, RegistrationError, ConnectionError) as exc:
            return _registration_failed(exc)
        return _CREATED

    async def unregister(self, req: Request) -> Response:
        if self.engines is None:
            return json_error(501, "engine registration is off on this coordinator")
        try:
            b: UnregisterBody = decode_body(req, UnregisterBody)
            check_u64("instance_id", b.instance_id)
            await self.engines.unregister(b.instance_id, b.model_name, b.routing_group, b.dp_rank)
        except (BadBody, RegistrationError, ConnectionError) as exc:
            return _registration_failed(exc)
        return _OK

    async def workers(self, req: Request) -> Response:
        params = parse_qs(req.query, keep_blank_values=True)
        for name in ("model_name", "routing_group", "tenant_id"):  # Dynamo's (serde) query fields
            if len(params.get(name, ())) > 1:
                return json_error(400, f"Failed to deserialize query string: duplicate field `{name}`")
        if self.engines is None:
            return _json(200, [])
        if (down := self.lookups.index_down()) is not None:
            return json_error(503, down)  # index contents: never from a stale copy
        model_name, group = params.get("model_name", [None])[-1], params.get("routing_group", [None])[-1]
        try:
            listed = await self.engines.workers()
        except ConnectionError as exc:
            return _registration_failed(exc)
        out = []
        for engine, status, relayed_by in listed:
            if (model_name is not None and engine.model_name != model_name) or (
                group is not None and engine.routing_group != group
            ):
                continue
            listeners: dict[str, dict[str, str]] = {}
            for x in engine.listeners:
                st, err = status.get(x.dp_rank, (PENDING, ""))
                info = {"endpoint": x.endpoint, "status": st}
                if err:
                    info["last_error"] = err
                listeners[str(x.dp_rank)] = info
            hp = profile_json(self.state.config, partition_model(engine.model_name, engine.routing_group))
            out.append({"instance_id": engine.instance_id, "source": engine.source,
                        "status": overall(v["status"] for v in listeners.values()),
                        "model_name": engine.model_name, "routing_group": engine.routing_group,
                        "block_size": engine.block_size, "engine": engine.kind, "hash_profile": hp,
                        "endpoints": {str(x.dp_rank): x.endpoint for x in engine.listeners},
                        "listeners": listeners, "serving_url": engine.serving_url, "relayed_by": relayed_by,
                        **({"metrics_url": engine.metrics_url} if engine.metrics_url else {}),
                        **({"role": engine.role} if engine.role else {})})
        return _json(200, out)

    async def dump(self, req: Request) -> Response:
        """Dynamo's dump shape, kvcoord's content: per partition, one ``stored`` event per node, rank and
        tier listing its blocks (``block_hash`` = ``tokens_hash`` = the engine's hash; no chains)."""
        st = self.state
        if (down := self.lookups.index_down()) is not None:
            return json_error(503, down)  # index contents: never from a stale copy
        out: dict[str, dict[str, Any]] = {}
        now, now_wall = time.monotonic(), time.time()
        for rec in list(st.registry):
            if st.replicas.live_node(rec.node_id, rec.model, now, now_wall) is None:
                continue
            name, _, group = rec.model.partition("@")
            part = out.setdefault(f"{name}:{group or DEFAULT_GROUP}",
                                  {"block_size": self.block_size(rec.model), "events": []})
            for rank in rec.dp_ranks:
                try:
                    entries = await st.index.export_node(rec.model, rec.node_id, rank)
                except (ConnectionError, OSError) as exc:
                    await st.health.down(f"{type(exc).__name__}: {exc}")
                    return json_error(503, self.lookups.unavailable(st.health.down_reason))
                except Exception as exc:
                    part["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                by_tier: dict[int, list[int]] = {}
                for h, held in entries:
                    by_tier.setdefault(int(held), []).append(int(h))
                for tier, hs in sorted(by_tier.items()):
                    blocks = [{"block_hash": h, "tokens_hash": h, "mm_extra_info": None} for h in hs]
                    part["events"].append({
                        "worker_id": _worker_id(rec.node_id),
                        "storage_tier": _STORAGE_TIERS.get(Tier(tier), "disk"), "residency_domain": "worker",
                        "event": {"event_id": len(part["events"]), "dp_rank": rank, "data": {"stored": {
                            "parent_hash": None, "start_position": None, "blocks": blocks}}}})
        return _json(200, out)

    def health(self, req: Request) -> Response:
        """200 while the index serves, 503 while it is down (the readiness a load balancer wants)."""
        down = self.lookups.index_down()
        return Response(200) if down is None else json_error(503, down)
