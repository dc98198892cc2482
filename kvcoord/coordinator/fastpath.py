"""The HTTP API's fast path: a plain lookup (``POST /query`` by token ids, ``POST /query_by_hash``; no
extra keys, ``include_unmatched`` false) answered from a view of its partition, with no Python object per
node.

Why: below a few hundred blocks the lookup itself (hash chain, match) is microseconds; the general path
around it (liveness per node, an answer object per node) costs as much again. Here the chain is hashed
in C, the index's C table gives the matched rows packed (``Table.rows``), and each live (node, rank) of
the view carries its parts of an answer as templates, every string in them encoded already
(:func:`~kvcoord.coordinator.answers.hit_templates`); a table row's parts are formatted once, and an answer
is joined from its rows'. Prompts share prefixes, so the same rows come back: their answer is kept whole
(bar the query's sizes) while the slots it names stay as they were. A node's change (a new load, every
heartbeat on a busy fleet) drops only its own rows and the answers naming it.

The handler (:class:`kvcoord.coordinator.httpapi.HttpApi`) frames (``httptools``) and decodes (msgspec)
every request alike, answers errors itself, and asks this path first for a plain lookup. Both paths
encode with :func:`kvcoord.coordinator.answers.answer_json`, and their answers are byte-identical
(``tests/coordinator/test_fastpath.py`` compares them over random fleets, queries and changes).

A view names the registry's change count (:data:`kvcoord.coordinator.registry.CHANGES`), the table's
layout and a time it is valid until (the first lease that may run out), so a node that stops being live
is never reported from a stale view; a stale view is brought up to date from the change log, slot by
slot for the nodes changed since. Off without the native extension (``KVCOORD_NATIVE=0``: the general
path is the twin), with replicas (liveness comes from the shared directory there), and on a backend
without a native table (Redis).
"""

from __future__ import annotations

import struct
import time
from array import array
from operator import itemgetter
from typing import TYPE_CHECKING, cast

from kvcoord.coordinator.answers import (
    SIZES,
    Hit,
    answer_json,
    answered,
    fast_hit,
    hit_templates,
    with_pull,
)
from kvcoord.coordinator.httpd import Response
from kvcoord.coordinator.lookup import LookupFailed
from kvcoord.coordinator.pools import pull_hints
from kvcoord.coordinator.registry import CHANGES
from kvcoord.hashing import native_keys_plan
from kvcoord.native import native

if TYPE_CHECKING:
    from kvcoord._native import Table
    from kvcoord.coordinator.httpapi import HttpApi

__all__ = ["MAX_VIEW_AGE", "FastAnswers"]

MAX_VIEW_AGE = 0.25
"""Seconds a view is trusted at most, even with nothing seen to change (a backstop, not the rule)."""

_CBOR_NULL = b"\xf6"
"""The CBOR tail of a block without extra keys."""

_Slot = tuple[str, int, tuple[bytes, bytes, bytes], str]
"""A live (node, rank) of a view: node id, dp rank, its answer entries' templates
(:func:`~kvcoord.coordinator.answers.hit_templates`), and its serving URL when it may be a peer-pull source
(exact trust; else "")."""
_Scored = tuple[float, Hit, str]
"""A table row as an answer's hit (:func:`_hit`)."""
_HitCache = dict[tuple[int, ...], "_Scored | tuple[()]"]
_MAX_HITS = 4096
_MAX_ANSWERS = 1024
"""Answers kept per view (a few KB each)."""


class FastAnswers:
    """:meth:`tokens` and :meth:`hashes`: a plain lookup's answer, or None where the handler's general
    path must answer it. Views are kept per partition and brought up to date when found stale."""

    __slots__ = ("_kept", "api", "max_view_age")

    def __init__(self, api: HttpApi, max_view_age: float = MAX_VIEW_AGE) -> None:
        assert native is not None
        self.api = api
        self.max_view_age = max_view_age
        """Seconds a view is trusted without a change (a lease may run out meanwhile)."""
        self._kept: dict[str, _Kept] = {}

    @staticmethod
    def available(api: HttpApi) -> bool:
        """Whether this coordinator's lookups can take the fast path at all."""
        return native is not None and api.state.replicas.directory is None

    def tokens(self, model: str, tokens: memoryview | array[int], ntokens: int, t0: float) -> Response | None:
        """``/query`` by ``ntokens`` token ids (uint32, packed in ``tokens``) of known partition ``model``."""
        kept = self._fresh(model)
        if kept is None or kept.chain is None:
            return None
        assert native is not None
        kind, code, parent, bs = kept.chain
        count = ntokens // bs
        self.api.lookups.check_blocks(count, f" ({ntokens} tokens)")
        keys: list[bytes] | bytes = b""
        try:
            if count and kind == "cbor":
                keys = native.cbor_chain(code, False, parent, tokens, bs, count, _CBOR_NULL, True)
            elif count:
                keys = native.pickle_chain(code, False, parent, tokens, bs, count, True)
        except (TypeError, ValueError):  # the general path words the error
            return None
        assert isinstance(keys, bytes)  # keys_only: the packed uint64 keys
        return self._answer(model, kept, keys, count, ntokens, bs, "tokens", t0)

    def hashes(self, model: str, keys: memoryview, t0: float) -> Response | None:
        """``/query_by_hash`` of known partition ``model``, its uint64 keys packed in ``keys``."""
        kept = self._fresh(model)
        if kept is None:
            return None
        return self._answer(model, kept, keys, len(keys), 0, kept.block_size, "hashes", t0)

    def _answer(self, model: str, kept: _Kept, keys: bytes | memoryview, nblocks: int, ntokens: int,
                block_size: int, query: str, t0: float) -> Response | None:
        packed = kept.table.rows(keys)
        if kept.table.layout() != kept.layout:  # hashing allocated: a collection may have moved a slot
            return None
        sizes = SIZES % (nblocks, ntokens)
        known = kept.answers.get((block_size, packed))
        if known is None:
            rows = list(_ROW.iter_unpack(packed))
            body, best = self._encoded(model, kept, rows, nblocks, ntokens, block_size)
            at = body.index(sizes)
            if len(kept.answers) >= _MAX_ANSWERS:
                kept.answers.clear()
                kept.answers_of.clear()
            key = (block_size, packed)
            slots = tuple({row[0] for row in rows})  # every slot decides it, reported or not
            kept.answers[key] = (body[:at], body[at + len(sizes):], best, slots)
            for slot in slots:
                kept.answers_of.setdefault(slot, set()).add(key)
        else:
            head, tail, best, _ = known
            body = b"".join((head, sizes, tail))
        return answered(self.api.state, body, best, nblocks, query, t0, "fast")

    @staticmethod
    def _encoded(model: str, kept: _Kept, rows: list[tuple[int, ...]], nblocks: int, ntokens: int,
                 block_size: int) -> tuple[bytes, int]:
        """The answer to the table's ``rows`` (:func:`answer_json`), from the view's entries."""
        cache = kept.hits.get(block_size)
        if cache is None or len(cache) > _MAX_HITS:
            if cache is not None:  # every size's rows go: rows_of then names only rows kept
                kept.hits.clear()
                kept.rows_of.clear()
            cache = kept.hits[block_size] = {}
        seen = list(map(cache.get, rows))  # None where not seen yet
        if None in seen:
            for i, row in enumerate(rows):
                if seen[i] is None:
                    seen[i] = cache[row] = _hit(kept, block_size, *row)
                    kept.rows_of.setdefault(row[0], []).append((block_size, row))
        scored = cast("list[_Scored]", list(filter(None, seen)))  # () where the view does not report the slot
        scored.sort(key=_SORT_KEY)  # stable: the table's order (longest, then node and rank) breaks ties,
        hits = list(map(_HIT_OF, scored))  # as the handler's sort
        # the peer-pull hints, as the handler's (kvcoord.coordinator.pools.pull_hints): none without a source
        if len(hits) > 1 and any(map(_SOURCE_OF, scored)):
            pulls = pull_hints([(h[0], h[2], (h[3], h[4], h[5]), src) for _, h, src in scored])
            hits = [h if p is None else (*h[:6], with_pull(h[6], p), h[7])
                    for h, p in zip(hits, pulls, strict=True)]
        return answer_json(model, block_size, nblocks, ntokens, hits)

    def _fresh(self, model: str) -> _Kept | None:
        """Partition ``model``'s view, up to date; None where the handler's general path must answer."""
        if not self.api.state.health.up or self.api.state.pools.active:  # pools: expanded by the handler
            return None
        kept = self._kept.get(model)
        now = time.monotonic()
        if (kept is None or kept.generation != CHANGES.count or now > kept.fresh_until
                or kept.table.layout() != kept.layout) and not self._refresh(model, now):
            return None
        return self._kept[model]

    def _refresh(self, model: str, now: float) -> bool:
        """Bring partition ``model``'s view up to date: the slots of the nodes changed since it was
        taken, or (table layout moved, a lease may have run out, something else changed, or no view yet)
        a view built anew. False (and no view kept) where the handler must answer."""
        kept = self._kept.get(model)
        changed = CHANGES.since(kept.generation) if kept is not None else None
        if (kept is None or changed is None or None in changed or now > kept.valid_until
                or kept.table.layout() != kept.layout or self.api.block_size(model) != kept.block_size):
            return self._build(model, now)
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
                entry = self._slot(kept, model, node_id, rank, now, now_wall)
                if entry != kept.slots[slot]:  # its rows and the answers naming it go; the rest stay
                    kept.slots[slot] = entry
                    kept.forget(slot)
        kept.generation = generation
        kept.fresh_until = now if kept.lapsed else kept.valid_until
        return True

    def _slot(self, kept: _Kept, model: str, node_id: str, rank: int, now: float,
              now_wall: float) -> _Slot | None:
        """One (node, rank)'s entry of a view: None unless lookups may report it now."""
        st = self.api.state
        rec = st.registry.get(node_id)
        lease = st.registry.lease
        if rec is not None and not (rec.expired or rec.resyncing or rec.draining):
            if now - rec.last_heard <= lease:  # NodeRecord.live's test; stale a microsecond early
                kept.valid_until = min(kept.valid_until, rec.last_heard + lease - 1e-6)
            elif rec.model == model:  # lapsed, not expired yet: live again at its next heartbeat,
                kept.lapsed.add(node_id)  # which changes no watched field
        info = st.replicas.live_node(node_id, model, now, now_wall, rank)
        if info is None:
            return None
        load, url, trust, cause = info
        return (node_id, rank, hit_templates(node_id, rank, load, url, trust, cause),
                url if trust == "exact" else "")

    def _build(self, model: str, now: float) -> bool:
        """A fresh view of partition ``model``; False (and none kept) where the handler must answer."""
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
        w0, w1, w2 = st.config.tier_weights
        kept = _Kept(table, CHANGES.count, now + self.max_view_age, api.block_size(model), chain,
                     (w0, w1, w2))
        kept.members = {rec.node_id for rec in st.registry if rec.model == model}
        now_wall = time.time()
        for slot, key in enumerate(slot_keys):
            if key is None:
                kept.slots.append(None)
                continue
            node_id, rank = key
            kept.by_node.setdefault(node_id, []).append((slot, rank))
            kept.slots.append(self._slot(kept, model, node_id, rank, now, now_wall))
        kept.fresh_until = now if kept.lapsed else kept.valid_until
        self._kept[model] = kept
        return True


def _hit(kept: _Kept, block_size: int, slot: int, matched: int, cpu: int, sto: int) -> _Scored | tuple[()]:
    """A table row as an answer's hit, with its sort key (minus its weighted score) and its pull-source
    URL; () unless the view reports its slot."""
    entry = kept.slots[slot] if slot < len(kept.slots) else None
    if entry is None or not matched:
        return ()
    node_id, rank, templates, source = entry
    gpu = matched - cpu - sto
    w0, w1, w2 = kept.weights
    hit = fast_hit(node_id, rank, templates, matched, gpu, cpu, sto, block_size)
    return -(gpu * w0 + cpu * w1 + sto * w2), hit, source


_SORT_KEY, _HIT_OF, _SOURCE_OF = itemgetter(0), itemgetter(1), itemgetter(2)
_ROW = struct.Struct("=4I")
"""A row of ``Table.rows``: slot, matched blocks, of which on CPU, on storage."""


class _Kept:
    """One partition's view: what it was taken at, each slot's entry, and where each node's slots are."""

    __slots__ = ("answers", "answers_of", "block_size", "by_node", "chain", "fresh_until", "generation",
                 "hits", "lapsed", "layout", "members", "rows_of", "slots", "table", "valid_until", "weights")

    def __init__(self, table: Table, generation: int, valid_until: float, block_size: int,
                 chain: tuple[str, int, bytes, int] | None, weights: tuple[float, float, float]) -> None:
        self.table = table
        self.block_size = block_size
        """The partition's block size as :meth:`HttpApi.block_size` gave it (/query_by_hash answers)."""
        self.chain = chain
        """How its token ids are hashed in C (:func:`kvcoord.hashing.native_keys_plan`), or None."""
        self.weights = weights
        self.layout = table.layout()
        self.generation = generation
        self.valid_until = valid_until
        """Until when its live nodes' leases run at least (the first that may run out)."""
        self.fresh_until = valid_until
        """Until when it is used without a look at the registry: ``valid_until``, or now while a node
        is lapsed (asked again at every lookup)."""
        self.slots: list[_Slot | None] = []
        """Per table slot, its entry while lookups may report it."""
        self.hits: dict[int, _HitCache] = {}
        """Per block size, table rows seen, as hits (:func:`_hit`, their counts in that size's tokens):
        rows repeat, as prompts share prefixes. A slot's rows go when its entry changes (:meth:`forget`);
        all go when one size's grow past :data:`_MAX_HITS`."""
        self.rows_of: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        """slot -> its rows in :attr:`hits`, as (block size, row)."""
        self.answers: dict[tuple[int, bytes], tuple[bytes, bytes, int, tuple[int, ...]]] = {}
        """(block size, the table's packed rows) -> the answer's bytes before and after its sizes
        (:data:`SIZES`), its best match and the slots its rows name: the answer is theirs alone while
        those slots' entries stay (:meth:`forget`); all go when they grow past :data:`_MAX_ANSWERS`."""
        self.answers_of: dict[int, set[tuple[int, bytes]]] = {}
        """slot -> the keys of the answers kept whose rows name it."""
        self.by_node: dict[str, list[tuple[int, int]]] = {}
        """node id -> its (slot, dp rank)s in the table, as of the layout."""
        self.lapsed: set[str] = set()
        """Nodes past their lease, not yet expired: their slots are looked at again at every lookup."""
        self.members: set[str] = set()
        """The nodes whose records are of this partition (the last one leaving may make it unknown)."""

    def forget(self, slot: int) -> None:
        """Slot ``slot``'s entry changed: its rows' hits and every answer naming it are stale."""
        for size, row in self.rows_of.pop(slot, ()):
            self.hits.get(size, {}).pop(row, None)
        for key in self.answers_of.pop(slot, ()):
            known = self.answers.pop(key, None)
            for other in known[3] if known is not None else ():
                self.answers_of.get(other, set()).discard(key)  # so each slot names only answers kept
