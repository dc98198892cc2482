"""The lookup walk over holder strings, client-side: the lookup rule (the run stops at the first block no
live candidate holds), as pure functions shared by lookups from Redis and the mirror (whose C walk,
``walk.c``, is held to them)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Sequence
from typing import cast

from kvcoord.index.base import NodeMatch
from kvcoord.index.redis.keys import _parse_loc_name

_HOLDER = struct.Struct(">IB")
"""One holder record: location id u32 BE, tier mask u8."""
_LOCAL_IDS = 1 << 24
"""Location ids a bucket may reach while the mirror merges buckets (ids are never reused)."""


class _Names:
    """A bucket's live locations as of the version token ``ver`` (``T:ver``); ids are never reused."""

    __slots__ = ("by_id", "by_name", "ver")

    def __init__(self, ver: bytes, flat: list[bytes]) -> None:
        self.ver = ver
        self.by_id: dict[int, tuple[str, str, int]] = {}
        self.by_name: dict[bytes, int] = {}
        for i in range(0, len(flat), 2):
            lid = int(flat[i])
            self.by_id[lid] = _parse_loc_name(flat[i + 1])
            self.by_name[flat[i + 1]] = lid


def _walk(holders: list[bytes | None], names: _Names, allowed: set[int] | None) -> list[NodeMatch]:
    """The lookup walk over one bucket's holder strings (``None`` = no holder: the walk stops)."""
    return _walk_runs(_runs_of(holders), names, allowed)


def _walk_runs(
    holder_runs: Iterable[tuple[bytes, int]], names: _Names, allowed: set[int] | None
) -> list[NodeMatch]:
    """``_walk`` over runs ``(holder string, consecutive blocks holding it)``, up to the stop."""
    live = names.by_id
    cur: dict[int, int] | None = None
    runs: dict[int, list[int]] = {}
    for v, seg in holder_runs:
        nxt = {
            lid: m
            for lid, m in _HOLDER.iter_unpack(v)
            if (cur is None or lid in cur) and lid in live and (allowed is None or lid in allowed)
        }
        if not nxt:
            break
        for lid, m in nxt.items():
            r = runs.get(lid)
            if r is None:
                r = runs[lid] = [0, 0, 0, 0]
            r[0] += seg
            r[1 if m & 1 else 2 if m & 2 else 3] += seg
        cur = nxt
    out = []
    for lid, (run, g, c, st) in runs.items():
        _, node_id, rank = live[lid]
        out.append(NodeMatch(node_id, rank, run, (g, c, st)))
    return out


def _holder_runs(copy: dict[int, bytes], hashes: Sequence[int]) -> list[tuple[bytes, int]]:
    """The copy's holder strings of ``hashes`` as runs (``_walk_runs``' input): the walk without C."""
    get = copy.get
    return _runs_of([get(h) for h in hashes])


def _runs_of(holders: list[bytes | None]) -> list[tuple[bytes, int]]:
    """Runs of equal consecutive holder strings, up to the first block no one holds."""
    try:
        stop = holders.index(None)
    except ValueError:
        stop = len(holders)
    groups = itertools.groupby(cast("list[bytes]", holders[:stop]))
    return [(v, len(list(same))) for v, same in groups]


def _rebase(bucket: int, v: bytes) -> bytes | None:
    """Bucket-local holder records with each id made global (its top byte set to the bucket); None
    when an id is already past 2**24."""
    if v[0::5].count(0) != len(v) // 5:
        return None
    out = bytearray(v)
    out[0::5] = bytes((bucket,)) * (len(v) // 5)
    return bytes(out)
