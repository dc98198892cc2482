"""Key naming and bucketing: what the keyspace looks like, kept in one place so that the index, the
scripts' callers and the mirror agree on it (the package docstring describes the keyspace)."""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Sequence

from kvcoord.events import Tier

_LAYOUT = "v3"
"""Keyspace format, stored with the bucket count in ``{<prefix>}:conf``; v2 keeps holder records sorted,
v3 bumps ``T:ver`` whenever ``T:name`` changes (the lookup fast path caches ``T:name`` by it)."""
_DEFAULT_CLUSTER_BUCKETS = 16
FEED_MAX_ENTRIES = 1_000
"""Entries a bucket's change feed keeps (``XADD MAXLEN ~``): a mirror further behind than this reloads.
An entry is one write call: ~40 bytes per changed block, up to ``_WRITE_COALESCE_BLOCKS`` blocks (so a
few MB typically, 80 MB at most); a mirror replays ~1M blocks/s, several times Redis's write rate."""
_TIER_BITS = tuple((t, 1 << t) for t in Tier)
"""``(tier, bit)`` of a tier mask (the value of a ``T:fwd:<id>`` field, the last byte of a holder record)."""


def bucket_tags(key_prefix: str, buckets: int) -> list[str]:
    """Every bucket's hash tag ``{<prefix>:<b>}``: all keys of bucket ``b`` start with it."""
    return [f"{{{key_prefix}:{b}}}" for b in range(buckets)]


def conf_key(key_prefix: str) -> str:
    """The key holding ``<layout>:<buckets>`` of the keyspace ``key_prefix``."""
    return f"{{{key_prefix}}}:conf"


def bucket_of(node_id: str, buckets: int) -> int:
    """The bucket (hence hash tag, slot and shard) holding every key of ``node_id``."""
    return zlib.crc32(node_id.encode()) % buckets


def _pack(hashes: Sequence[int]) -> bytes:
    """uint64 hashes as the keyspace stores them: 8 big-endian bytes each."""
    packed = array("Q", hashes)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def _loc_name(model: str, node_id: str, dp_rank: int) -> str:
    return f"{len(model.encode())}:{model}{dp_rank}:{node_id}"


def _parse_loc_name(raw: bytes) -> tuple[str, str, int]:
    """``(model, node_id, dp_rank)`` from a location name."""
    c = raw.index(b":")
    n = int(raw[:c])
    model = raw[c + 1 : c + 1 + n].decode()
    rest = raw[c + 1 + n :]
    r = rest.index(b":")
    return model, rest[r + 1 :].decode(), int(rest[:r])


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` as a literal in a SCAN MATCH pattern (bucket tags hold braces, which are literals)."""
    out = bytearray()
    for c in raw:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)
