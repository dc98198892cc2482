"""What valid input is, once: the rules that turn engine events into index operations, the bounds a
batch or node must stay within, and the identities (node ids, model names) clients may use.

Every path into an index goes through here: the in-process index takes :func:`ops_of` of decoded events,
the relay (its mirror, the reporter, the coordinator's in-process feed) :func:`op_runs` (runs of like
events as one op), the coordinator :func:`kvcoord.wire.ops_from_proto` of the wire, which applies the
same rules field by field. An :class:`Op` is valid by construction (uint64 hashes,
a known tier, a non-negative group), so an index never validates and a bad event rejects its whole
batch before anything changes. Errors are :class:`InvalidEvent` naming the event's position. An event of
a medium the media map (:mod:`kvcoord.media`) does not know is not bad: it is skipped and counted
(:func:`known_runs`).
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from operator import attrgetter
from typing import Any, NamedTuple, TypeAlias, cast
from urllib.parse import urlsplit

import msgspec

from kvcoord.events import (
    CLEAR,
    NOT_SEQ,
    REMOVE,
    STORE,
    VIEW_TYPES,
    Tier,
    indexable_spec,
    py_u64_ok,
    u64_ok,
)
from kvcoord.hashing import BlockHash64, to_block_hash64
from kvcoord.media import MEDIUM_TIERS, MISFIT_STORES, UNKNOWN_MEDIA, UNSPECIFIED_KIND, normalize_medium
from kvcoord.native import native

__all__ = [
    "MAX_JSON_DEPTH",
    "NTIERS",
    "Hashes",
    "InvalidEvent",
    "Known",
    "Op",
    "OverLimit",
    "RunKey",
    "Runs",
    "SnapshotEntry",
    "check_batch_bounds",
    "check_model",
    "check_node_entries",
    "check_node_id",
    "check_target",
    "check_tiers",
    "group",
    "hashes64",
    "indexable_kind",
    "json_too_deep",
    "known_runs",
    "op_runs",
    "ops_of",
    "pack_u64",
    "run_key",
    "shown",
    "snapshot_columns",
    "snapshot_per_tier",
    "tier",
    "unpack_u64",
    "valid_url",
]

NTIERS = len(Tier)
FAST_SEQ = (tuple, list)
"""Sequence types read in place, without a copy."""

Hashes: TypeAlias = Sequence[BlockHash64]
"""An op's hashes: a list or tuple of uint64 ints, or a flat ``memoryview`` of format ``Q`` (the wire's
packed bytes, which the native index reads with one copy)."""

SnapshotEntry: TypeAlias = tuple[BlockHash64, Tier]
"""One (block, tier) a node holds; a node's snapshot is a list of these."""


class InvalidEvent(ValueError):
    """An event that cannot be applied (bad hash, a medium that is not a string, wrong type). Nothing was
    applied."""


class OverLimit(InvalidEvent):
    """Valid input past a configured bound (``limit`` names the setting). Nothing was applied."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class Op(NamedTuple):
    """One validated event, as every index applies it."""

    kind: int
    """STORE, REMOVE or CLEAR."""
    tier: int
    """A ``Tier`` value (0 for CLEAR)."""
    hashes: Hashes
    group: int | None
    """The event's ``group_idx``."""
    indexable: bool
    """False for a store of a non-full-attention group: counted and remembered, never indexed."""


RunKey: TypeAlias = tuple[int, int, int | None, bool]
"""``(kind, tier, group, indexable)``: what makes events alike. Consecutive stores (or removals) of one key
form a run, applied as one op of all their hashes: exact for every index and the relay's mirror, which
apply an op's hashes one by one, idempotently (a run applies as its events would, and counts add up).
A CLEAR has no key: it is never in a run."""


EMPTY: Hashes = ()
CLEAR_OP = Op(CLEAR, 0, EMPTY, None, True)
CLEAR_KEY: RunKey = (CLEAR, 0, None, True)
"""Never a run's key (a CLEAR is never in a run): where a key is kept before the first one is made."""


_u64_view: Callable[[object], Sequence[int] | None] | None = native.u64_view if native is not None else None
""":data:`u64_ok` that also packs a long sequence (as a ``memoryview`` of ``Q``, which the index's C core
reads with one copy instead of converting every int again)."""

_MEDIUM_TIERS = MEDIUM_TIERS
"""Media already normalised (bounded: known names only, at most 64; emptied when the map changes)."""


SHOWN_CHARS = 64
"""Characters of an untrusted string that errors and logs echo (see :func:`shown`)."""


def shown(value: object, limit: int = SHOWN_CHARS, *, quote: bool = True) -> str:
    """An untrusted value as errors and log lines may echo it: ``repr`` (control characters, bidi
    overrides and look-alikes escaped; without quotes when ``quote`` is false) cut to ``limit``
    characters. A status trailer or log line built from a client's 100 KB node id stays short, and
    cannot forge a line or hide what it says."""
    if not isinstance(value, str):
        text = ascii(value)
        return text if len(text) <= limit else f"{text[:limit]}..."
    text = ascii(value[:limit])
    if not quote:
        text = text[1:-1]
    return text if len(value) <= limit else f"{text}... ({len(value)} chars)"


NODE_ID_RULE = "1-253 ASCII letters, digits, '.', '_', ':' or '-', starting and ending with a letter or digit"
MODEL_RULE = "1-256 ASCII letters, digits, '.', '_', ':', '-', '/', '@' or '+'"
_NODE_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:-]{0,251}[A-Za-z0-9])?")
_MODEL = re.compile(r"[A-Za-z0-9._:/@+-]{1,256}")


def check_node_id(node_id: object, where: str = "node_id") -> str:
    """A node id as a client may name one: Kubernetes DNS-1123-label-like (plus ``.``, ``_``, ``:``
    for host names, pod names and ``host:port``), so logs, dashboards and ``kvcoord nodes`` cannot
    be made to show one node as another (NUL, trailing space, look-alike or right-to-left tricks)."""
    if not isinstance(node_id, str) or _NODE_ID.fullmatch(node_id) is None:
        raise InvalidEvent(f"{where} {shown(node_id)} is not a valid node id ({NODE_ID_RULE})")
    return node_id


def check_model(model: object, where: str = "model") -> str:
    """A model name (``Qwen/Qwen3-0.6B``, ``/models/llama``, ``name@routing_group``): as node ids,
    printable ASCII without spaces, and ``/``, ``@``, ``+`` as well."""
    if not isinstance(model, str) or _MODEL.fullmatch(model) is None:
        raise InvalidEvent(f"{where} {shown(model)} is not a valid model name ({MODEL_RULE})")
    return model


def valid_url(url: str) -> str:
    """An engine's URL (its base, or its ``/metrics``): ``http(s)://HOST[:PORT][/path]`` without a query,
    returned without a trailing slash; ValueError otherwise."""
    url = url.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query:
        raise ValueError(f"{url!r} is not an http(s)://HOST:PORT URL")
    return url


MAX_JSON_DEPTH = 128
"""How deep a JSON request body may nest (serde_json's limit, as Dynamo's indexer reads bodies)."""


def json_too_deep(raw: bytes, value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (JSON types, or a msgspec Struct of them), decoded from the JSON ``raw``, nests
    deeper than ``limit`` (a top-level object or array is 1). Parsers give up only near Python's recursion
    limit (a ``RecursionError``), and what they take may still be too deep for the next encoder deeper in
    the stack. Walked only when ``raw`` has more brackets than ``limit``, so a body of flat arrays costs
    two ``bytes.count``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, msgspec.Struct):
            item = msgspec.structs.astuple(item)
        inner = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else ()
        stack.extend((x, depth + 1) for x in inner if isinstance(x, dict | list | tuple | msgspec.Struct))
    return False


def check_batch_bounds(ops: Sequence[Op], held: int, *, max_hashes: int, max_entries: int) -> int:
    """A validated batch against its bounds, before it is applied: at most ``max_hashes`` block hashes
    over all its events, and a node holding ``held`` entries may not pass ``max_entries``. Returns
    the entries it may add (an upper bound: a store of a held block adds none)."""
    total = adds = 0
    for op in ops:
        n = len(op.hashes)
        total += n
        if op.kind == STORE and op.indexable:
            adds += n
    if total > max_hashes:
        raise OverLimit("max_hashes_per_batch",
                        f"{total} block hashes in one batch; max_hashes_per_batch is {max_hashes}")
    check_node_entries(held + adds, max_entries)
    return adds


def check_node_entries(entries: int, max_entries: int) -> None:
    """A node may hold at most ``max_entries`` entries (a batch's or snapshot's upper bound)."""
    if entries > max_entries:
        raise OverLimit("max_entries_per_node",
                        f"the node would hold up to {entries} entries; max_entries_per_node is {max_entries}")


def check_target(model: object, node_id: object, dp_rank: object) -> None:
    """The ``(model, node_id, dp_rank)`` an update or snapshot is for."""
    if not isinstance(model, str):
        raise InvalidEvent(f"model must be a string, not {type(model).__name__}")
    if not isinstance(node_id, str) or not node_id:
        raise InvalidEvent(f"node_id must be a non-empty string, not {shown(node_id)}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise InvalidEvent(f"dp_rank must be a non-negative int, not {shown(dp_rank)}")


def hashes64(raw: object, where: str) -> Hashes:
    """An event's hashes as uint64 ints (digests reduced as vLLM does); raises ``InvalidEvent``.

    Any ordered sequence of ints or digests is accepted; bools are not hashes. A list or tuple of
    plain uint64 ints is returned as it is (no copy: do not mutate it) or, when long and native code
    runs, packed once as a ``memoryview`` of ``Q``.
    """
    if type(raw) not in FAST_SEQ:
        if isinstance(raw, memoryview) and raw.format == "Q" and raw.ndim == 1:
            return cast("Hashes", raw)  # packed uint64 (the wire's): valid by construction
        if not isinstance(raw, Sequence) or isinstance(raw, NOT_SEQ):
            raise InvalidEvent(f"{where}: block_hashes must be a list, not {type(raw).__name__}")
        raw = list(raw)
    if _u64_view is not None:
        packed = _u64_view(raw)
        if packed is not None:
            return cast("Hashes", packed)
    elif py_u64_ok(raw):
        return cast("Hashes", raw)
    out: list[BlockHash64] = []
    for i, h in enumerate(cast("Sequence[object]", raw)):
        try:
            out.append(to_block_hash64(h))  # type: ignore[arg-type]  # it checks the type itself
        except (TypeError, ValueError) as e:
            raise InvalidEvent(f"{where}: block_hashes[{i}]: {e}") from None
    return out


def tier(medium: object, where: str) -> int | None:
    """The tier (``Tier`` value) of an event's ``medium``: a missing medium is GPU, a name the media map
    (:mod:`kvcoord.media`) does not know None (the event is skipped); a medium that is not a string
    raises ``InvalidEvent``."""
    if medium is None or type(medium) is str:
        t = _MEDIUM_TIERS.get(medium)
        if t is not None:
            return t
    if not isinstance(medium, str):
        raise InvalidEvent(f"{where}: medium must be a string, not {type(medium).__name__}")
    found = normalize_medium(medium)
    if found is None:
        return None
    if len(_MEDIUM_TIERS) < 64:
        _MEDIUM_TIERS[medium] = int(found)
    return int(found)


def group(group_idx: object, where: str) -> int | None:
    """An event's ``group_idx``: absent, or a non-negative int."""
    if group_idx is None:
        return None
    if isinstance(group_idx, bool) or not isinstance(group_idx, int) or group_idx < 0:
        raise InvalidEvent(f"{where}: group_idx must be a non-negative int, not {group_idx!r}")
    return group_idx


def indexable_kind(kind: object, where: str) -> bool:
    """Whether a store's ``kv_cache_spec_kind`` is prefix-indexable (:func:`kvcoord.events.indexable_spec`),
    once it is a string or None."""
    if kind is not None and not isinstance(kind, str):
        raise InvalidEvent(f"{where}: kv_cache_spec_kind must be a string")
    return indexable_spec(kind)


def run_key(kind: int, t: int, g: Any, spec: object, pos: int) -> RunKey:
    """The key of the store or removal at position ``pos`` of a batch (of events or wire events), from its
    kind, tier number ``t``, ``group_idx`` and (a store's; None for a removal) ``kv_cache_spec_kind``; raises
    ``InvalidEvent`` naming the event. Every key is made here: of events (:func:`op_runs`, :func:`ops_of`)
    and of the wire (:func:`kvcoord.wire.ops_from_proto`)."""
    if not 0 <= t < NTIERS:
        raise InvalidEvent(f"event {pos}: unknown tier {t}")
    if g is not None and (type(g) is not int or g < 0):
        g = group(g, f"event {pos}")
    if kind == REMOVE or spec is None:
        return kind, t, g, True
    if type(spec) is str:
        return kind, t, g, indexable_spec(spec)
    return kind, t, g, indexable_kind(spec, f"event {pos}")


def ops_of(events: Sequence[Any]) -> list[Op]:
    """Validate a whole batch of events (model structs or the relay's views) into ops, one per event of a
    known medium (an unknown medium's events are skipped, see :func:`known_runs`), before anything is
    mutated anywhere; the first bad event raises ``InvalidEvent`` naming its position."""
    return _runs(events, False).ops


Runs: TypeAlias = tuple[list[Op], list[int]]
"""A batch's ops with each run of like events merged (see :func:`op_runs`), and the events each op
stands for, in order (they add up to the batch's events of known media: :attr:`Known.events`)."""


class Known(NamedTuple):
    """A validated batch: its events of known media, and their ops and spans (see :data:`Runs`)."""

    events: Sequence[Any]
    """The batch itself when every medium is known, else the events of known media, in order."""
    ops: list[Op]
    spans: list[int]
    """Events of ``events`` each op stands for (1 each unless merged)."""


def op_runs(events: Sequence[Any]) -> Runs:
    """:func:`ops_of` with each run of like events (one :func:`run_key`) as one op of all their hashes, in
    order: a batch of 1-block removals (vLLM frees blocks one event each) costs one op, not hundreds."""
    known = _runs(events, True)
    return known.ops, known.spans


def known_runs(events: Sequence[Any], *, merge: bool = True) -> Known:
    """The one validation of a batch (:func:`op_runs`, or :func:`ops_of` unless ``merge``), with the events
    its spans add up to. An event of a medium the map does not know (:mod:`kvcoord.media`) is skipped: no
    op, no span (so it is absent from ``events``), counted per name in
    :data:`kvcoord.media.UNKNOWN_MEDIA` once the batch is valid. It never makes the batch bad: only its
    medium's type is checked (a removal of it could remove nothing indexed anyway)."""
    return _runs(events, merge)


_NO_SPEC = object()
"""The spec kind of a run of removals: they have none, so class, medium and group decide."""


def _runs(events: Sequence[Any], merge: bool) -> Known:
    """The one validation of events (:func:`known_runs`): the common form is checked inline, anything else
    by the rule's own function, which names what is wrong. An event whose medium, group and spec kind are
    the very objects of the last one keyed has its key. Merged, hashes are checked a run at once
    (:func:`_checked`), and a decoded view (:data:`kvcoord.events.VIEW_TYPES`) like the event before
    (class, medium, group, spec kind) continues its run unchecked: msgspec typed them."""
    if type(events) not in FAST_SEQ and (not isinstance(events, Sequence) or isinstance(events, NOT_SEQ)):
        raise InvalidEvent(f"events must be a sequence, not {type(events).__name__}")
    ops: list[Op] = []
    spans: list[int] = []
    known, pack, new, typed = _MEDIUM_TIERS, _u64_view, _new_op, VIEW_TYPES if merge else ()
    key: RunKey | None = None
    run: list[BlockHash64] = []
    first: Any = EMPTY
    n = seen = 0  # events in the open run, and before it
    cls: type[Any] | None = None
    last = t = cast(Any, -1)
    medium = g = spec = cast(Any, None)
    k = CLEAR_KEY
    skipped, misfit = cast("tuple[list[int], list[int]]", ([], []))  # positions: unknown media, misfit stores
    try:
        for ev in events:
            if (type(ev) is cls and ev.medium == medium and ev.group_idx == g  # (a misfit store: below)
                    and (spec is _NO_SPEC or (ev.kv_cache_spec_kind == spec and fits(ev)))):
                if n == 1:
                    run = list(first)
                run += ev.block_hashes
                n += 1
                continue
            kind, i = getattr(ev, "KIND", None), seen + n
            if kind == STORE:
                s = ev.kv_cache_spec_kind
            elif kind == REMOVE:
                s = _NO_SPEC
            elif kind == CLEAR:
                if key is not None:
                    ops.append(new(Op, (key[0], key[1], first if n == 1 else run, key[2], key[3])))
                    spans.append(n)
                    key, cls, seen, n = None, None, i, 0
                ops.append(CLEAR_OP)
                spans.append(1)
                seen += 1
                continue
            else:
                raise InvalidEvent(f"event {i}: not a KV event: {type(ev).__name__}")
            m, gi, hashes = ev.medium, ev.group_idx, ev.block_hashes
            if not (kind == last and m is medium and gi is g and s is spec):  # else: the last key made
                last, medium, g, spec = kind, m, gi, s
                t = known.get(m) if m is None or type(m) is str else None
                t = tier(m, f"event {i}") if t is None else t
                k = k if t is None else run_key(kind, t, gi, None if s is _NO_SPEC else s, i)
            if t is None or (kind == STORE and not fits(ev)):  # an unknown medium, a sparse group's store:
                (skipped if t is None else misfit).append(i)  # skipped (its position counts on; no run
                seen, cls = seen + 1, None  # continues across it)
                continue
            fast = type(hashes) in FAST_SEQ
            if not merge:  # an op per event (no spans)
                h = pack(hashes) if pack is not None and fast else None
                ops.append(new(Op, (kind, t, hashes64(hashes, f"event {i}") if h is None else h, k[2], k[3])))
                seen += 1
                continue
            cls = type(ev) if type(ev) in typed else None
            if not fast:
                hashes = hashes64(hashes, f"event {i}")  # no fast form: checked (digests reduced) now
            if k == key:
                if n == 1:
                    run = list(first)
                run += hashes
                n += 1
                continue
            if key is not None:
                ops.append(new(Op, (key[0], key[1], first if n == 1 else run, key[2], key[3])))
                spans.append(n)
            key, first, seen, n = k, hashes, i, 1
    finally:  # also when an event failed: an earlier event's bad hash, unchecked so far, is the one named
        if key is not None:
            ops.append(new(Op, (key[0], key[1], first if n == 1 else run, key[2], key[3])))
            spans.append(n)
        kept = _kept(events, skipped, ops, spans, merge, misfit)
    return Known(kept, ops, spans if merge else [1] * len(ops))


def _token_count(token_ids: Any) -> int:
    """How many token ids a store carries: ``len`` of the decoded ids, or read from the msgpack array head of
    a relay view's raw ids (-1: neither, which fits: the decoder judges it)."""
    if type(token_ids) in (tuple, list):
        return len(token_ids)
    try:
        raw = memoryview(token_ids)
    except TypeError:
        return -1
    head = raw[0] if raw else 0xC0
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head in (0xDC, 0xDD) and len(raw) >= (3 if head == 0xDC else 5):
        return int.from_bytes(raw[1 : 3 if head == 0xDC else 5], "big")
    return 0 if head == 0xC0 else -1


def py_store_fits(ev: Any) -> bool:
    """Whether a BlockStored's token ids are ``block_size`` per block hash, as llm-d checks a sparse group's
    stores: a sparse (sliding-window) group of a hybrid model keeps fewer blocks than its tokens span, and
    its hashes cannot be matched as a prefix. No token ids (a store of an offloading tier) fits."""
    n = _token_count(ev.token_ids)
    size, count = ev.block_size, len(ev.block_hashes)
    if n <= 0 or not isinstance(size, int) or size < 0:
        return True
    return bool(size and n == size * count)


fits: Callable[[Any], bool] = native.store_fits if native is not None else py_store_fits
"""The token-count check of a store (:func:`py_store_fits`): native when built, with the same answers."""


def _kept(events: Sequence[Any], skipped: list[int], ops: list[Op], spans: list[int],
          merge: bool, misfit: list[int]) -> Sequence[Any]:
    """The events neither ``skipped`` (of unknown media) nor ``misfit`` (see :func:`fits`), both counted here,
    once merged ``ops`` whose hashes are not all plain uint64 ints are made again event by event
    (:func:`_checked`)."""
    if not skipped and not misfit:
        kept, pos = events, cast("Sequence[int]", range(len(events)))
    else:
        for i in skipped:
            UNKNOWN_MEDIA.add(events[i].medium)
        for i in misfit:
            MISFIT_STORES.add(str(events[i].kv_cache_spec_kind or UNSPECIFIED_KIND))
        gone = set(skipped).union(misfit)
        pos = [i for i in range(len(events)) if i not in gone]
        kept = [events[i] for i in pos]
    if merge and not all(map(u64_ok, map(_HASHES, ops))):
        _checked(ops, spans, kept, pos)
    return kept


def _checked(ops: list[Op], spans: list[int], events: Sequence[Any], pos: Sequence[int]) -> None:
    """Merged ops whose hashes are not all uint64 ints (:data:`u64_ok`) made again event by event
    (:func:`hashes64`: digests reduced, or the first bad event named by its position ``pos`` in the batch)."""
    start = 0
    for j, op in enumerate(ops):
        n = spans[j]
        if op.hashes and not u64_ok(op.hashes):
            parts = [hashes64(events[e].block_hashes, f"event {pos[e]}") for e in range(start, start + n)]
            ops[j] = op._replace(hashes=parts[0] if n == 1 else [h for part in parts for h in part])
        start += n


_HASHES = attrgetter("hashes")
_new_op = tuple.__new__
"""``Op``'s fields as one: the NamedTuple's own ``__new__`` is a Python frame, ~0.2 us an event."""


def snapshot_per_tier(hashes: Sequence[BlockHash64], tiers: bytes = b"") -> list[Hashes]:
    """Validate a snapshot's columns (hashes, and one tier byte each or none: all GPU) and group the
    uint64 hashes by tier value."""
    checked = hashes64(hashes, "snapshot")
    if not tiers:
        return [checked, *([] for _ in range(NTIERS - 1))]
    check_tiers(tiers, len(checked))
    return [list(compress(checked, (t == k for t in tiers))) for k in range(NTIERS)]


def check_tiers(tiers: bytes, n: int) -> None:
    """A snapshot's tier column: empty (all GPU), or one known tier byte for each of its ``n`` hashes."""
    if not tiers:
        return
    if not isinstance(tiers, bytes | bytearray) or len(tiers) != n:
        raise InvalidEvent(f"snapshot has {n} block_hashes but {len(tiers)} tiers")
    if max(tiers) >= NTIERS:
        raise InvalidEvent(f"snapshot has an unknown tier {max(tiers)}")


def snapshot_columns(entries: Iterable[SnapshotEntry]) -> tuple[list[BlockHash64], bytes]:
    """``(hash, tier)`` pairs as the columns :meth:`Index.replace_node` takes (tests, small snapshots)."""
    hashes: list[BlockHash64] = []
    tiers = bytearray()
    for i, item in enumerate(entries):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidEvent(f"snapshot entry {i} must be (hash, tier), not {item!r}")
        h, t = item
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < NTIERS:
            raise InvalidEvent(f"snapshot entry {i}: tier must be a Tier, not {t!r}")
        hashes.append(h)
        tiers.append(t)
    return hashes, bytes(tiers) if any(tiers) else b""


_LITTLE = sys.byteorder == "little"


def pack_u64(hashes: Sequence[int]) -> bytes:
    """uint64 hashes as the wire carries them: 8 little-endian bytes each (``ValueError`` for values
    that are not ints in 0..2**64-1)."""
    if isinstance(hashes, memoryview):
        return hashes.tobytes() if _LITTLE else _swapped(hashes)
    try:
        packed = array("Q", hashes)
    except (OverflowError, TypeError):
        raise ValueError("block hashes must be integers in 0..2**64-1") from None
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _swapped(view: memoryview) -> bytes:
    packed = array("Q", view)
    packed.byteswap()
    return packed.tobytes()


def unpack_u64(data: bytes, where: str) -> Hashes:
    """The wire's packed hashes as a flat uint64 view (no copy on little-endian machines)."""
    if len(data) % 8:
        raise InvalidEvent(f"{where}: block_hashes is {len(data)} bytes, not a multiple of 8")
    if _LITTLE:
        return cast("Hashes", memoryview(data).cast("Q"))
    packed = array("Q", data)
    packed.byteswap()
    return cast("Hashes", packed)
