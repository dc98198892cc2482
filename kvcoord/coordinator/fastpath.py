"""The HTTP API's lookups answered in one native call: a whole ``POST /query`` (token ids) or
``POST /query_by_hash`` request in, the whole HTTP answer out (``kvcoord/_native/answer.c``), with its
metrics, called by the server as it is (an ``Answerer``, ``kvcoord/_native/answerer.c``): no Python runs
for a request unless a view must be brought up to date.

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
first lease that may run out), so a node that stops being live is never reported from a stale view; a
stale view is brought up to date from the change log, slot by slot for the nodes changed since.

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
    from kvcoord._native import Answerer, AnswerModel, Table
    from kvcoord._native import Tally as NativeTally
    from kvcoord.coordinator.httpapi import HttpApi
    from kvcoord.coordinator.metrics import Tally

log = logging.getLogger("kvcoord.http")

__all__ = ["MAX_VIEW_AGE", "NativeAnswers"]

MAX_VIEW_AGE = 0.25
"""Seconds a view is trusted at most, even with nothing seen to change (a backstop, not the rule)."""

_encode = msgspec.json.Encoder().encode


class NativeAnswers:
    """``answer(data)``: the HTTP answer of one request, or None for the Python handler; a native
    ``Answerer`` (answerer.c), which calls back here only to bring a stale view up to date."""

    __slots__ = ("_kept", "answer", "api", "failed", "max_view_age", "views")

    def __init__(self, api: HttpApi, extra_headers: bytes = b"", max_view_age: float = MAX_VIEW_AGE) -> None:
        assert native is not None
        self.api = api
        self.max_view_age = max_view_age
        """Seconds a view is trusted without a change (a lease may run out meanwhile)."""
        self.views: dict[str, AnswerModel] = {}
        """Per partition, its ``AnswerModel`` (refreshed when the native call says it is stale)."""
        self._kept: dict[str, _Kept] = {}
        self.failed = False
        st = api.state
        metrics = st.metrics
        self.answer: Answerer = native.Answerer(
            self.views, CHANGES, self._refresh, st, api.may_query if api.auth.enabled else None,
            self._failed, extra_headers, _native(metrics.lookup_tally("tokens")),
            _native(metrics.lookup_tally("hashes")), _native(metrics.matched_fraction))
        """The call itself; its answers carry ``extra_headers``, the lines the server sends with every
        answer (``HttpServer.extra_headers``), and feed the lookup metrics' tallies."""
        metrics.answerers.append(self.answer)

    @staticmethod
    def available(api: HttpApi) -> bool:
        """Whether this coordinator's lookups can be answered natively at all."""
        st = api.state
        return native is not None and st.directory is None

    def _failed(self, exc: BaseException) -> None:
        """A bug or out of memory on the way: this request goes to the handler, the first one logged."""
        if not self.failed:
            log.error("native lookup answer failed; the Python handler answers", exc_info=exc)
            self.failed = True

    def _refresh(self, model: str, now: float) -> bool:
        """Bring partition ``model``'s view up to date: the slots of the nodes changed since it was
        taken, or (table layout moved, a lease may have run out, something else changed, or no view yet)
        a view built anew. False (and no view kept) where the handler must answer."""
        kept = self._kept.get(model)
        changed = CHANGES.since(kept.generation) if kept is not None else None
        if (kept is None or changed is None or None in changed or now > kept.valid_until
                or kept.table.layout() != kept.layout or self.views.get(model) is not kept.view
                or self.api.block_size(model) != kept.block_size):
            return self._build(model, now)
        view = kept.view
        assert view is not None
        registry = self.api.state.registry
        now_wall, generation = time.time(), CHANGES.count
        changed |= kept.lapsed  # asked again at every lookup while lapsed (below)
        kept.lapsed = set()
        for node_id in changed:
            assert node_id is not None
            rec = registry.get(node_id)
            if rec is not None and rec.model == model:
                kept.members.add(node_id)
            elif node_id in kept.members:  # a node left the partition, which may be unknown now
                return self._build(model, now)
            for slot, rank in kept.by_node.get(node_id, ()):
                view.set_slot(slot, self._slot(kept, model, node_id, rank, now, now_wall))
        kept.generation = generation
        view.renew(generation, now if kept.lapsed else kept.valid_until)
        return True

    def _slot(self, kept: _Kept, model: str, node_id: str, rank: int, now: float,
              now_wall: float) -> tuple[int, int, bytes, bytes] | None:
        """One (node, rank)'s entry of a view: None unless lookups may report it now."""
        st, api = self.api.state, self.api
        rec = st.registry.get(node_id)
        lease = st.registry.lease
        if rec is not None and not (rec.expired or rec.resyncing or rec.draining):
            if now - rec.last_heard <= lease:  # NodeRecord.live's test; stale a microsecond early
                kept.valid_until = min(kept.valid_until, rec.last_heard + lease - 1e-6)
            elif rec.model == model:  # lapsed, not expired yet: live again at its next heartbeat,
                kept.lapsed.add(node_id)  # which changes no watched field
        info = st.live_node(node_id, model, now, now_wall, rank)
        if info is None:
            return None
        load, url, trust, cause = info
        node = kept.nodes.setdefault(node_id, len(kept.nodes))
        return node, rank, _encode(node_id), api.node_tail(node_id, rank, load, url, trust, cause)

    def _build(self, model: str, now: float) -> bool:
        """A fresh view of partition ``model``; False (and none kept) where the handler must answer."""
        assert native is not None
        self.views.pop(model, None)
        self._kept.pop(model, None)
        api, st = self.api, self.api.state
        if not api.known(model):
            return False
        view = st.index.native.native_view(model) if st.index.native is not None else None
        if view is None:
            return False
        table, slot_keys = view
        try:
            profile = api.lookups.hashing_profile(model)
        except LookupFailed:
            profile = None
        chain = native_keys_plan(profile) if profile is not None else None
        kept = _Kept(table, CHANGES.count, now + self.max_view_age, api.block_size(model))
        kept.members = {rec.node_id for rec in st.registry if rec.model == model}
        now_wall = time.time()
        slots: list[tuple[int, int, bytes, bytes] | None] = []
        for slot, key in enumerate(slot_keys):
            if key is None:
                slots.append(None)
                continue
            node_id, rank = key
            kept.by_node.setdefault(node_id, []).append((slot, rank))
            slots.append(self._slot(kept, model, node_id, rank, now, now_wall))
        cfg = st.config
        w0, w1, w2 = cfg.tier_weights
        kept.view = native.AnswerModel(
            table, kept.layout, kept.generation, now if kept.lapsed else kept.valid_until, chain,
            kept.block_size, cfg.limits.max_query_blocks, (w0, w1, w2), _encode(model), slots)
        self.views[model] = kept.view
        self._kept[model] = kept
        return True


def _native(tally: Tally) -> NativeTally:
    """A tally the metrics made native (they do wherever the extension is built)."""
    assert native is not None and isinstance(tally, native.Tally)
    return tally


class _Kept:
    """What the Python side keeps of one view: what it was taken at, and where each node's slots are."""

    __slots__ = ("block_size", "by_node", "generation", "lapsed", "layout", "members", "nodes", "table",
                 "valid_until", "view")

    def __init__(self, table: Table, generation: int, valid_until: float, block_size: int) -> None:
        self.table = table
        self.block_size = block_size
        """The partition's block size as :meth:`HttpApi.block_size` gave it (/query_by_hash answers)."""
        self.layout = table.layout()
        self.generation = generation
        self.valid_until = valid_until
        self.by_node: dict[str, list[tuple[int, int]]] = {}
        """node id -> its (slot, dp rank)s in the table, as of the layout."""
        self.nodes: dict[str, int] = {}
        """node id -> its index in the view (groups its ranks in the answer)."""
        self.lapsed: set[str] = set()
        """Nodes past their lease, not yet expired: their slots are looked at again at every lookup."""
        self.members: set[str] = set()
        """The nodes whose records are of this partition (the last one leaving may make it unknown)."""
        self.view: AnswerModel | None = None
