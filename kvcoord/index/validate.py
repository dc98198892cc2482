"""Input rules every index backend shares: one source of truth for what a valid event, target and
snapshot are, and for the ``InvalidEvent`` messages that say why not.

Backends call these before mutating anything, so a bad batch is refused whole. The checks are
cheap on the common shapes (lists of in-range ints take a C-level check); the per-item loops run
only to reduce digests or to name the bad item.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias, cast

from kvcoord.events import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
    normalize_medium,
)
from kvcoord.hashing import BlockHash64, to_block_hash64
from kvcoord.index.base import InvalidEvent, SnapshotEntry

try:
    from kvcoord import _indexcore
except ImportError:  # built without a compiler: the pure-Python check serves
    _indexcore = None  # type: ignore[assignment]

__all__ = [
    "CLEAR",
    "EMPTY",
    "FAST_SEQ",
    "NOT_SEQ",
    "NTIERS",
    "REMOVE",
    "STORE",
    "Op",
    "U64Check",
    "U64Conv",
    "check_events_seq",
    "check_target",
    "fast_u64_ok",
    "group",
    "hashes64",
    "indexable_kind",
    "ops_of",
    "py_u64_ok",
    "snapshot_per_tier",
    "tier",
]

STORE, REMOVE, CLEAR = 0, 1, 2
"""Op kinds (BlockStored, BlockRemoved, AllBlocksCleared)."""

NOT_SEQ = (str, bytes, bytearray, memoryview)
"""Sequences that are never a list of hashes or events."""
FAST_SEQ = (tuple, list)
"""Sequence types read in place, without a copy."""
EMPTY: tuple[BlockHash64, ...] = ()
NTIERS = len(Tier)

Op: TypeAlias = tuple[int, int, Sequence[BlockHash64], "int | None", bool]
"""``(kind, tier, hashes, group_idx, indexable)`` of one validated event."""

U64Check: TypeAlias = Callable[[object], bool]
"""A fast all-good test: True when a sequence is all plain ints in [0, 2**64) (False: check slowly)."""

U64Conv: TypeAlias = Callable[[object], "Sequence[BlockHash64] | None"]
"""A fast check that may also convert: the hashes, in a form the C core reads directly (e.g. a packed
``memoryview`` of format ``Q``), or None (check slowly). It saves converting a long event twice."""


def py_u64_ok(raw: object) -> bool:
    """Pure-Python fast check: a sequence of ints in [0, 2**64) (False: take the slow path)."""
    if not isinstance(raw, Sequence) or isinstance(raw, NOT_SEQ):
        return False
    if not raw:
        return True
    try:
        array("Q", raw)  # C-level check: ints (or __index__) in [0, 2**64)
    except (TypeError, OverflowError, ValueError):
        return False
    # array() accepts bools (True == 1, False == 0) and __index__ objects: only plain big ints pass here.
    return bool(min(raw) > 1)


fast_u64_ok: U64Check = _indexcore.validate_u64_seq if _indexcore is not None else py_u64_ok
"""The fastest all-good check built here: the C core's when it is built (same answers as ``py_u64_ok``)."""

_MEDIUM_TIERS: dict[str, int] = {}
"""Media already normalised (bounded: known names only, at most 64)."""


def check_target(model: object, node_id: object, dp_rank: object) -> None:
    """The ``(model, node_id, dp_rank)`` an update or snapshot is for."""
    if not isinstance(model, str):
        raise InvalidEvent(f"model must be a string, not {type(model).__name__}")
    if not isinstance(node_id, str) or not node_id:
        raise InvalidEvent(f"node_id must be a non-empty string, not {node_id!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise InvalidEvent(f"dp_rank must be a non-negative int, not {dp_rank!r}")


def check_events_seq(events: object) -> None:
    """A batch must be an ordered sequence (not a string or bytes)."""
    if not isinstance(events, Sequence) or isinstance(events, NOT_SEQ):
        raise InvalidEvent(f"events must be a sequence, not {type(events).__name__}")


def hashes64(raw: object, where: str, u64_ok: U64Check = fast_u64_ok) -> Sequence[BlockHash64]:
    """An event's hashes as uint64 ints (digests reduced as vLLM does); raises ``InvalidEvent``.

    Any ordered sequence of ints/digests is accepted, as the C core accepts it; bools are not hashes.
    A list or tuple that ``u64_ok`` passes is returned as it is (no copy): do not mutate it.
    """
    if type(raw) not in FAST_SEQ:
        if not isinstance(raw, Sequence) or isinstance(raw, NOT_SEQ):
            raise InvalidEvent(f"{where}: block_hashes must be a list, not {type(raw).__name__}")
        raw = list(raw)  # e.g. a protobuf repeated field: one C-level copy, then read in place
    if u64_ok(raw):
        return cast("Sequence[BlockHash64]", raw)
    out: list[BlockHash64] = []
    for i, h in enumerate(cast("Sequence[object]", raw)):
        if isinstance(h, bytes | bytearray | memoryview) and len(h) == 0:
            raise InvalidEvent(f"{where}: block_hashes[{i}] is an empty digest")
        try:
            out.append(to_block_hash64(h))  # type: ignore[arg-type]  # it checks the type itself
        except (TypeError, ValueError) as e:
            raise InvalidEvent(f"{where}: block_hashes[{i}]: {e}") from None
    return out


def tier(medium: object, where: str) -> int:
    """The tier (``Tier`` value) of an event's ``medium``; a missing medium is GPU."""
    if medium is None:
        return 0
    if type(medium) is str:
        t = _MEDIUM_TIERS.get(medium)
        if t is not None:
            return t
    if not isinstance(medium, str):
        raise InvalidEvent(f"{where}: medium must be a string, not {type(medium).__name__}")
    try:
        t = int(normalize_medium(medium))
    except ValueError as e:
        raise InvalidEvent(f"{where}: {e}") from None
    if len(_MEDIUM_TIERS) < 64:
        _MEDIUM_TIERS[medium] = t
    return t


def group(group_idx: object, where: str) -> int | None:
    """An event's ``group_idx``: absent, or a non-negative int."""
    if group_idx is None:
        return None
    if isinstance(group_idx, bool) or not isinstance(group_idx, int) or group_idx < 0:
        raise InvalidEvent(f"{where}: group_idx must be a non-negative int, not {group_idx!r}")
    return group_idx


def indexable_kind(kind: object, where: str) -> bool:
    """Whether a store's ``kv_cache_spec_kind`` is prefix-indexable (absent or full attention)."""
    if kind is None:
        return True
    if not isinstance(kind, str):
        raise InvalidEvent(f"{where}: kv_cache_spec_kind must be a string")
    return kind in FULL_ATTENTION_KINDS


def ops_of(
    events: Sequence[KVEvent], u64_ok: U64Check = fast_u64_ok, conv: U64Conv | None = None
) -> list[Op]:
    """Validate a whole batch of event objects into ops, before anything is mutated.

    With ``conv`` (the C core's ``u64_view``) an op's hashes may come back already packed for the core.
    """
    check_events_seq(events)
    ops: list[Op] = []
    for i, ev in enumerate(events):
        where = f"event {i}"
        if isinstance(ev, BlockStored):
            indexable = indexable_kind(ev.kv_cache_spec_kind, where)
            t = tier(ev.medium, where)
            hs = None if conv is None else conv(ev.block_hashes)
            if hs is None:
                hs = hashes64(ev.block_hashes, where, u64_ok)
            ops.append((STORE, t, hs, group(ev.group_idx, where), indexable))
        elif isinstance(ev, BlockRemoved):
            t = tier(ev.medium, where)
            hs = None if conv is None else conv(ev.block_hashes)
            if hs is None:
                hs = hashes64(ev.block_hashes, where, u64_ok)
            ops.append((REMOVE, t, hs, group(ev.group_idx, where), True))
        elif isinstance(ev, AllBlocksCleared):
            ops.append((CLEAR, 0, EMPTY, None, True))
        else:
            raise InvalidEvent(f"{where}: not a KV event: {type(ev).__name__}")
    return ops


def snapshot_per_tier(entries: Iterable[SnapshotEntry], u64_ok: U64Check = fast_u64_ok) -> list[list[int]]:
    """Validate snapshot ``(hash, tier)`` entries and group their uint64 hashes by tier value."""
    per_tier: list[list[int]] = [[] for _ in range(NTIERS)]
    try:
        items = list(entries)
    except TypeError as e:
        raise InvalidEvent(f"snapshot entries must be iterable: {e}") from None
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidEvent(f"snapshot entry {i} must be (hash, tier), not {item!r}")
        h, t = item
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < NTIERS:
            raise InvalidEvent(f"snapshot entry {i}: tier must be a Tier, not {t!r}")
        per_tier[t].extend(hashes64((h,), f"snapshot entry {i}", u64_ok))
    return per_tier
