"""Lookups, whatever the transport: hash the query with the model's profile, match it in the index, keep
the live nodes, order them. The gRPC servicer and the HTTP API both answer from here, so the two cannot
disagree on what a query means, which nodes count, or which error a bad query gets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.pools import POOL_PREFIX, PullHint, pull_hints
from kvcoord.extra_keys import MultiModalItem, RequestKeys
from kvcoord.hashing import BlockHash64, HashProfile, block_hashes64
from kvcoord.index.base import IndexReset, NodeKey, NodeMatch
from kvcoord.load import NodeLoad
from kvcoord.tokenize.base import TokenizeError
from kvcoord.validate import shown

__all__ = ["INTERNAL", "INVALID", "KINDS", "NOT_FOUND", "NO_PROFILE", "TOKENIZER_DOWN", "UNAVAILABLE",
           "UNIMPLEMENTED", "LiveMatch", "LookupFailed", "Lookups"]

INVALID = "invalid"
NOT_FOUND = "not_found"
NO_PROFILE = "no_profile"
UNAVAILABLE = "unavailable"
UNIMPLEMENTED = "unimplemented"
INTERNAL = "internal"
TOKENIZER_DOWN = "tokenizer_down"
"""The model's tokenizer is broken or unreachable (its engine down): the lookup cannot be answered."""
KINDS = (INVALID, NOT_FOUND, NO_PROFILE, UNAVAILABLE, UNIMPLEMENTED, INTERNAL, TOKENIZER_DOWN)
"""Every kind of :class:`LookupFailed` (``kvcoord_lookup_errors_total{kind}``)."""

log = logging.getLogger("kvcoord.coordinator")



def prompt_keys(mm_items: tuple[MultiModalItem, ...], lora_name: str | None,
                cache_salt: str | None) -> RequestKeys | None:
    """The extra keys of a lookup by prompt or chat: its images' items, LoRA and salt (None: none)."""
    if not (mm_items or lora_name or cache_salt):
        return None
    return RequestKeys(lora_name=lora_name or None, cache_salt=cache_salt or None, mm_items=mm_items)

class LookupFailed(Exception):
    """A refused lookup: ``kind`` (one of the constants above) picks the status, ``message`` is one line."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class LiveMatch(NamedTuple):
    """One live ``(node, dp_rank)`` in an answer, best first."""

    node_id: str
    dp_rank: int
    matched_blocks: int
    tiers: tuple[int, ...]
    load: NodeLoad
    serving_url: str
    trust: str
    """The node's trust state (``NodeRecord.trust``): ``exact``, ``degraded`` or ``approximate``
    (resyncing nodes are in no answer)."""
    trust_cause: str
    """Why degraded (``Trust.cause``: ``hash_mismatch`` or ``history_lost``); empty when exact."""
    pool: str = ""
    """The shared pool whose blocks ``tiers[3]`` counts (kvcoord.coordinator.pools); empty: none."""
    pull: PullHint | None = None
    """A live peer holding a longer prefix than this node (its own blocks), for a peer pull."""


def with_hints(matches: list[LiveMatch]) -> list[LiveMatch]:
    """``matches`` with each one's peer-pull hint (:func:`kvcoord.coordinator.pools.pull_hints`): only peers
    whose matches are exact are named as sources."""
    if len(matches) < 2 or not matches[0].matched_blocks:
        return matches
    hints = pull_hints([(m.node_id, m.matched_blocks, m.tiers, m.serving_url if m.trust == "exact" else "")
                        for m in matches])
    return [m if h is None else m._replace(pull=h) for m, h in zip(matches, hints, strict=True)]


class Lookups:
    """The lookup path over one coordinator's state."""

    __slots__ = ("state",)

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        for kind in KINDS:  # kvcoord_lookup_errors_total's series exist from the start, at 0
            state.metrics.lookup_errors.setdefault(kind, 0)

    def profile(self, model: str) -> HashProfile | None:
        """The model's hash profile; None when it has none (hash queries still work). Raises
        ``NOT_FOUND`` for a model the configuration does not name under ``strict_models``."""
        if not model:
            raise LookupFailed(INVALID, "model is required")
        cfg = self.state.config
        profile = cfg.profile(model)
        if profile is None and cfg.strict_models and model not in cfg.models:
            raise LookupFailed(NOT_FOUND, f"unknown model {shown(model)} (strict_models; configured: "
                                          f"{', '.join(sorted(cfg.models))})")
        return profile

    def hashing_profile(self, model: str) -> HashProfile:
        """The profile token ids of ``model`` are hashed with; ``NO_PROFILE`` when it has none."""
        profile = self.profile(model)
        if profile is None:
            raise LookupFailed(NO_PROFILE, f"model {shown(model)} has no hash profile configured, so token "
                                           "ids cannot be hashed: query by block hashes, or configure "
                                           "it in [models]")
        return profile

    def check_blocks(self, num_blocks: int, what: str) -> None:
        limit = self.state.config.limits.max_query_blocks
        if num_blocks > limit:
            raise LookupFailed(INVALID, f"query has {num_blocks} blocks{what}; max_query_blocks is {limit}")

    def hash_tokens(self, model: str, tokens: Sequence[int] | array[int],
                    keys: RequestKeys | None = None) -> tuple[HashProfile, list[BlockHash64]]:
        """The engine's block hashes of ``tokens``' full blocks, by the model's profile."""
        profile = self.hashing_profile(model)
        n = len(tokens)
        self.check_blocks(n // profile.block_size, f" ({n} tokens)")
        try:
            return profile, block_hashes64(profile, tokens, None if keys is None or keys.empty else keys)
        except (ValueError, TypeError) as exc:
            raise LookupFailed(INVALID, f"cannot hash the query: {exc}") from None

    async def tokens_of(self, model: str, *, prompt: str | None = None, messages: Sequence[Any] | None = None,
                        tools: Sequence[Any] | None = None, add_special_tokens: bool | None = None,
                        add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                        chat_template_kwargs: Mapping[str, Any] | None = None
                        ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """The token ids the engine's OpenAI server makes of a completion ``prompt`` or chat ``messages``
        (its defaults: special tokens added to a prompt, not to a rendered chat), and the chat's images
        as multimodal items (:mod:`kvcoord.tokenize.media`). A tokenizer that cannot answer fails the
        lookup, naming the model: it never becomes a lookup of nothing."""
        if (prompt is None) == (messages is None):
            raise LookupFailed(INVALID, "give exactly one of a prompt or chat messages")
        self.hashing_profile(model)  # before spending milliseconds on tokens that could not be hashed
        cache = self.state.tokenizers
        if cache.spec(model) is None:
            raise LookupFailed(NO_PROFILE, f"model {shown(model)} has no tokenizer configured, so prompts "
                                           "cannot be tokenized: set its tokenizer in [models], or query "
                                           "by token ids")
        try:
            if prompt is not None:
                return await cache.encode_prompt(model, prompt, add_special_tokens=add_special_tokens
                                                 if add_special_tokens is not None else True), ()
            assert messages is not None
            return await cache.encode_chat_items(
                model, messages, tools=tools,
                add_generation_prompt=add_generation_prompt if add_generation_prompt is not None else True,
                continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=bool(add_special_tokens))
        except TokenizeError as exc:
            self.state.log_once(f"tokenize:{shown(model)}:{exc.bad_request}", logging.WARNING, "%s", exc)
            raise LookupFailed(INVALID if exc.bad_request else TOKENIZER_DOWN, str(exc)) from None

    def serves(self, model: str) -> bool:
        """Some live node (of this replica or, with replicas, any) serves ``model``."""
        st = self.state
        return st.registry.has_live(model) if st.replicas.directory is None else st.replicas.has_live(model)

    async def match(self, model: str, hashes: Sequence[BlockHash64],
                    candidates: Collection[NodeKey] | None = None,
                    include_unmatched: bool = False) -> list[LiveMatch]:
        """The live nodes holding a leading run of ``hashes``, best first by the tier weights (with
        ``include_unmatched``, then the other live nodes of the model, or of ``candidates``)."""
        st = self.state
        live_node = st.replicas.live_node
        matches: list[Any] = []
        walked = bool(hashes) and self.serves(model)
        if walked:
            pooled = candidates and st.pools.active
            matches = await self._index_match(model, hashes, {*candidates, *st.pools.publisher_keys()}
                                              if pooled and candidates else candidates)
        # Liveness is judged after the walk: a node live now had not expired when its entries were read,
        # and an owner removes an expired node's entries only after every replica stopped answering it.
        now, now_wall = time.monotonic(), time.time()
        if walked and (st.pools.active or any(m[0].startswith(POOL_PREFIX) for m in matches)):
            matches = await self._pooled(model, hashes, matches, candidates, now, now_wall)  # (another
            # replica's pool rows, when this one has none)
        w0, w1, w2 = weights = st.config.tier_weights
        tier_of = st.pools.tier
        scored: list[tuple[float, int, str, int, tuple[int, ...], str, NodeLoad, str, str, str]] = []
        for node_id, rank, matched, tiers, *pool in matches:
            if matched <= 0:
                continue
            info = live_node(node_id, model, now, now_wall, rank)
            if info is None:
                continue
            t = (*tiers, 0, 0, 0) if len(tiers) < 3 else tiers
            score = t[0] * w0 + t[1] * w1 + t[2] * w2
            if pool and pool[0]:
                score += t[3] * weights[tier_of(pool[0])]
            scored.append((-score, -matched, node_id, rank, tiers, pool[0] if pool else "", *info))
        scored.sort()  # (node, rank) is unique: the first four fields decide, the rest is never compared
        out = [LiveMatch(node_id, rank, -neg, tiers, load, url, trust, cause, pool)
               for _, neg, node_id, rank, tiers, pool, load, url, trust, cause in scored]
        if include_unmatched:
            seen = {(m.node_id, m.dp_rank) for m in out}
            out.extend(self._unmatched(model, seen, candidates, now, now_wall))
        return with_hints(out)

    async def _pooled(self, model: str, hashes: Sequence[BlockHash64], matches: list[NodeMatch],
                      candidates: Collection[NodeKey] | None, now: float, now_wall: float) -> list[Any]:
        """The index's rows with shared pools expanded (:meth:`Pools.expand`)."""
        st = self.state

        def live(node_id: str) -> bool:
            return st.replicas.live_node(node_id, model, now, now_wall) is not None

        def ranks(node_id: str) -> tuple[int, ...]:
            rec = st.registry.get(node_id)
            if rec is not None and rec.model == model:
                return rec.dp_ranks
            other = st.replicas.shared.get(node_id)  # another replica's node (its record's pools)
            return other.dp_ranks if other is not None and other.model == model else ()

        async def cont(rest: Sequence[BlockHash64], keys: Collection[NodeKey]) -> list[NodeMatch]:
            return await self._index_match(model, rest, keys)

        return list(await st.pools.expand(hashes, matches, live, ranks, candidates, cont))

    async def _index_match(self, model: str, hashes: Sequence[BlockHash64],
                           candidates: Collection[NodeKey] | None) -> list[Any]:
        """``index.match``, with the backend's failures as ``LookupFailed``. A backend that lost its
        contents (``IndexReset``: it answered nothing) makes the generation be re-read at once (its nodes
        become resyncing, out of answers) and the lookup is retried once, in the new lifetime."""
        st = self.state
        for attempt in (1, 2):
            if not st.health.up:
                raise LookupFailed(UNAVAILABLE, self.unavailable(st.health.down_reason))
            try:
                return list(await self._bounded_match(model, hashes, candidates or None))
            except LookupFailed:
                raise
            except IndexReset as exc:
                if attempt == 2:
                    reason = f"it lost its contents again: {exc}"
                    raise LookupFailed(UNAVAILABLE, self.unavailable(reason)) from None
                await st.health.index_reset(exc, "lookup")
            except (ConnectionError, TimeoutError, OSError) as exc:
                # The backend is unreachable: NOT_SERVING until a probe finds it back.
                reason = f"{type(exc).__name__}: {exc}"
                st.log_once(f"match:{type(exc).__name__}", logging.WARNING, "index match failed: %s", reason)
                await st.health.down(reason)
                raise LookupFailed(UNAVAILABLE, self.unavailable(reason)) from None
            except Exception as exc:
                # A bug or a bad answer, not an outage: this request fails, health stays as it is.
                name = type(exc).__name__
                st.log_once(f"match-error:{name}", logging.ERROR, "index match raised %s: %s", name, exc)
                raise LookupFailed(INTERNAL, f"index match failed: {name}: {exc}") from None
        raise AssertionError("unreachable")

    def _unmatched(self, model: str, seen: set[NodeKey], candidates: Collection[NodeKey] | None,
                   now: float, now_wall: float) -> list[LiveMatch]:
        st = self.state
        keys: set[NodeKey] = set()
        for rec in st.registry:
            if rec.model == model:
                keys.update((rec.node_id, r) for r in rec.dp_ranks)
        for other in st.replicas.remote_nodes():
            if other.model == model:
                keys.update((other.node_id, r) for r in other.dp_ranks)
        if candidates:
            keys &= set(candidates)
        out = []
        for key in sorted(keys - seen):
            if st.pools.pool_of(key[0]) is not None:  # a pool's publisher: never routable
                continue
            info = st.replicas.live_node(key[0], model, now, now_wall, key[1])
            if info is not None:
                out.append(LiveMatch(key[0], key[1], 0, (), *info))
        return out

    async def _bounded_match(self, model: str, hashes: Sequence[BlockHash64],
                             candidates: Collection[NodeKey] | None) -> list[NodeMatch]:
        """The index's match, a remote index's bounded by ``lookup_deadline``: when the backend stalls (a
        failover, a paused Redis) the lookup answers UNAVAILABLE then. Health is left to the connection's
        own timeout and the pings (one slow call is no outage). The cancelled call leaves its connection
        usable: the fast path skips the late reply, redis-py drops the connection."""
        st = self.state
        remote = st.index.remote
        mirror = remote.metrics.mirror if remote is not None else None
        # In-process (it may be driven outside a task, run_inline) or from a loaded mirror: never waits,
        # so no timer (~5 us) on those hot paths.
        if st.index.inline or (mirror is not None and mirror.current()):
            return await st.index.match(model, hashes, candidates)
        deadline = st.config.lookup_deadline
        bound = asyncio.timeout(deadline)
        try:
            async with bound:
                return await st.index.match(model, hashes, candidates)
        except TimeoutError:
            if not bound.expired():
                raise
        st.metrics.lookup_deadline_exceeded.inc()
        st.log_once("match:deadline", logging.WARNING, "index match exceeded the lookup deadline (%gs); "
                    "answering UNAVAILABLE (logged once)", deadline)
        raise LookupFailed(UNAVAILABLE, f"index backend {st.index.backend} did not answer within the lookup "
                                        f"deadline ({deadline:g}s): retry shortly or ask another replica")

    def index_down(self) -> str | None:
        """While the index is down, the one-line reason every route reading it answers (HTTP 503, gRPC
        UNAVAILABLE) rather than a stale answer; None while it serves."""
        health = self.state.health
        return None if health.up else self.unavailable(health.down_reason)

    def unavailable(self, reason: str) -> str:
        backend = self.state.index.backend
        return (f"index backend {backend} is unavailable ({reason or 'not answering'}); this coordinator "
                "reports NOT_SERVING until it is back: retry shortly or ask another replica")
