"""The global block index: a protocol and its backends, chosen at run time by URI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcoord.index.base import ApplyResult, Index
from kvcoord.index.uri import IndexSpec, parse_index_uri

__all__ = ["apply_events", "open_index"]


def open_index(uri: str | IndexSpec, *, key_prefix: str = "kvcoord") -> Index:
    """Open a backend from a URI (``memory``, ``redis://host:port/db``, ``redis+cluster://h:p,…`` or
    ``redis+sentinel://h:p,…/master-name``) or from its :class:`IndexSpec` (then ``key_prefix`` is the
    spec's)."""
    spec = uri if isinstance(uri, IndexSpec) else parse_index_uri(uri, key_prefix=key_prefix)
    if spec.redis is None:
        from kvcoord.index.memory import MemoryIndex

        return MemoryIndex()
    from kvcoord.index.redis.index import RedisIndex

    return RedisIndex.from_spec(spec)


async def apply_events(
    index: Index, model: str, node_id: str, dp_rank: int, events: Sequence[Any]
) -> ApplyResult:
    """Validate model events (or relay views) and apply them: ``index.apply(..., ops_of(events))``."""
    from kvcoord.validate import ops_of

    return await index.apply(model, node_id, dp_rank, ops_of(events))
