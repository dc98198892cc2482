"""The HTTP API's lookups answered in one native call: a whole ``POST /query`` (token ids) or
``POST /query_by_hash`` request in, the whole HTTP answer out (``kvcoord/_native/answer.c``).

Why: below a few hundred blocks the lookup itself (hash, match) is microseconds, and the Python around it
(HTTP callbacks, routing, decoding, per-node liveness, answer objects) cost ~80 us a request; that fixed
cost decided the comparison with Dynamo's indexer service (benchmarks/README.md).

The Python handler (:class:`kvcoord.coordinator.httpapi.HttpApi`) stays the definition. The native path
claims only complete, plain requests it can answer exactly as the handler would, byte for byte
(tests/test_fastpath.py compares the two over random fleets and queries), and hands everything else
back: the handler then answers it, errors included. It answers from a view of each partition
(:class:`AnswerModel`): the index's C table, each live slot's node with its answer entry already
encoded, and the hash profile. A view names the registry's change count
(:data:`kvcoord.coordinator.registry.CHANGES`), the table's layout and a time it is valid until (the
first lease that may run out), so a node that stops being live is never reported from a stale view.

With auth on, a request is claimed only with a token the handler would let look up (the same check, called
from C). Off (every lookup through the handler) without the native extension, with replicas (liveness
there comes from the shared directory, and their index is Redis anyway), and on a backend without a
native table (Redis).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec

from kvcoord.coordinator.lookup import LookupFailed
from kvcoord.coordinator.registry import CHANGES
from kvcoord.hashing import native_keys_plan
from kvcoord.native import native

if TYPE_CHECKING:
    from kvcoord._native import AnswerModel
    from kvcoord.coordinator.httpapi import HttpApi

log = logging.getLogger("kvcoord.http")

__all__ = ["MAX_VIEW_AGE", "NativeAnswers"]

MAX_VIEW_AGE = 0.25
"""Seconds a view is trusted at most, even with nothing seen to change (a backstop, not the rule)."""

_ROUTES = {1: "tokens", 2: "hashes"}
_encode = msgspec.json.Encoder().encode


class NativeAnswers:
    """``answer(data, head)``: the HTTP answer of one request, or None for the Python handler."""

    __slots__ = ("api", "failed", "may_query", "views")

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.views: dict[str, AnswerModel] = {}
        """Per partition, its ``AnswerModel`` (rebuilt when the native call says it is stale)."""
        self.failed = False
        self.may_query = api.may_query if api.auth.enabled else None

    @staticmethod
    def available(api: HttpApi) -> bool:
        """Whether this coordinator's lookups can be answered natively at all."""
        st = api.state
        return native is not None and st.directory is None

    def answer(self, data: bytes, head: bytes) -> bytes | None:
        st = self.api.state
        if not st.index_up or native is None:
            return None
        t0 = time.perf_counter()
        now = time.monotonic()
        try:
            got = native.answer_lookup(data, self.views, CHANGES.count, now, head, self.may_query)
            if isinstance(got, str):
                if not self._build(got, now):
                    return None
                got = native.answer_lookup(data, self.views, CHANGES.count, now, head, self.may_query)
        except Exception:  # a bug or out of memory: this request goes to the handler, once logged
            if not self.failed:
                log.exception("native lookup answer failed; the Python handler answers")
                self.failed = True
            return None
        if not isinstance(got, tuple):
            return None
        resp, route, num_blocks, best = got
        metrics = st.metrics
        metrics.native_answers.inc()
        metrics.lookup_done(_ROUTES[route], time.perf_counter() - t0)
        if num_blocks:
            metrics.matched_fraction.observe(best / num_blocks)
        return resp

    def _build(self, model: str, now: float) -> bool:
        """A fresh view of partition ``model``; False (and none kept) where the handler must answer."""
        assert native is not None
        self.views.pop(model, None)
        api, st = self.api, self.api.state
        if not api.known(model):
            return False
        view = st.index.native_view(model)
        if view is None:
            return False
        table, slot_keys = view
        try:
            profile = api.lookups.hashing_profile(model)
        except LookupFailed:
            profile = None
        chain = native_keys_plan(profile) if profile is not None else None
        generation, layout = CHANGES.count, table.layout()
        valid_until = now + MAX_VIEW_AGE
        lease, now_wall = st.registry.lease, time.time()
        nodes: dict[str, int] = {}
        slots: list[tuple[int, int, bytes, bytes] | None] = []
        for key in slot_keys:
            if key is None:
                slots.append(None)
                continue
            node_id, rank = key
            rec = st.registry.get(node_id)
            if rec is not None and not (rec.expired or rec.resyncing or rec.draining):
                valid_until = min(valid_until, rec.last_heard + lease)  # live until then at most
            info = st.live_node(node_id, model, now, now_wall, rank)
            if info is None:
                slots.append(None)
                continue
            load, url, trust, cause = info
            slots.append((nodes.setdefault(node_id, len(nodes)), rank, _encode(node_id),
                          api.node_tail(node_id, rank, load, url, trust, cause)))
        cfg = st.config
        w0, w1, w2 = cfg.tier_weights
        self.views[model] = native.AnswerModel(
            table, layout, generation, valid_until, chain, api.block_size(model), cfg.limits.max_query_blocks,
            (w0, w1, w2), _encode(model), slots)
        return True
