"""The global block index: a protocol and its backends, chosen at run time by URI."""

from __future__ import annotations

from kvcoord.index.base import (
    ApplyResult,
    Index,
    IndexStats,
    InvalidEvent,
    NodeKey,
    NodeMatch,
    SnapshotEntry,
)

__all__ = [
    "ApplyResult",
    "Index",
    "IndexStats",
    "InvalidEvent",
    "NodeKey",
    "NodeMatch",
    "SnapshotEntry",
    "open_index",
]


def open_index(uri: str, *, key_prefix: str = "kvcoord") -> Index:
    """Open a backend from a URI: ``memory``, ``redis://host:port/db`` or ``redis+cluster://h:p,…``."""
    if uri in ("", "memory", "memory://"):
        from kvcoord.index.memory import MemoryIndex

        return MemoryIndex()
    if uri.startswith(("redis://", "rediss://", "redis+cluster://", "unix://")):
        from kvcoord.index.redis import RedisIndex

        return RedisIndex.from_uri(uri, key_prefix=key_prefix)
    raise ValueError(f"unknown index backend {uri!r}: use 'memory', 'redis://host:port/db' or 'redis+cluster://…'")
