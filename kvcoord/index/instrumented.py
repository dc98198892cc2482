"""Metrics as a wrapper (llm-d's ``instrumentedIndex``): :class:`InstrumentedIndex` times and counts the
core calls of any backend, so no backend keeps call metrics of its own.

The coordinator wraps whatever index it opens; it exports the counts at scrape time (plain numbers
here, so this layer imports no Prometheus). What only a backend can see (Redis round trips, the
mirror) stays in its ``remote.metrics``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from time import perf_counter
from typing import Any, Protocol, TypeVar

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import (
    ApplyResult,
    EngineRecords,
    FencedWrite,
    Fencing,
    Index,
    IndexStats,
    NativeView,
    NodeKey,
    NodeMatch,
    NodeRecords,
    Remote,
    ReservationFeed,
)
from kvcoord.validate import Op, SnapshotEntry

__all__ = ["OPS", "InstrumentedIndex", "Observer"]

_T = TypeVar("_T")

OPS = ("apply", "match", "clear", "remove_node", "export_node", "replace_node", "stats")
"""The core calls, as the ``op`` label of the exported series."""


class Observer(Protocol):
    """Where one call's seconds go: ``kvcoord._native.Tally`` or its Python twin (a histogram as plain
    counts, cheaper than prometheus_client's ``observe`` on the lookup path), read at scrape time."""

    def observe(self, value: float, /) -> None: ...
    def counts(self) -> tuple[tuple[int, ...], float]: ...


class InstrumentedIndex:
    """An :class:`~kvcoord.index.base.Index` that forwards to ``inner``, timing each core call into
    ``seconds[op]`` and counting the calls that raised (``errors[op]``) and the writes refused by
    fencing (``fenced_writes``). Capabilities are the inner backend's own objects, unwrapped; other
    attributes of the backend (e.g. the memory index's ``*_sync`` calls) are reached through it."""

    def __init__(self, inner: Index, observer: Callable[[], Observer]) -> None:
        self.inner = inner
        self.backend: str = inner.backend
        self.inline: bool = inner.inline
        self.fencing: Fencing | None = inner.fencing
        self.native: NativeView | None = inner.native
        self.remote: Remote | None = inner.remote
        self.node_directory: NodeRecords | None = inner.node_directory
        self.engine_store: EngineRecords | None = inner.engine_store
        self.reservation_feed: ReservationFeed | None = inner.reservation_feed
        self.seconds: dict[str, Observer] = {op: observer() for op in OPS}
        self.errors: dict[str, int] = dict.fromkeys(OPS, 0)
        self.fenced_writes = 0
        self._match = inner.match
        self._match_seconds = self.seconds["match"].observe

    def __getattr__(self, name: str) -> Any:
        # Only for names this class lacks: backend extras, never the core calls or capabilities.
        return getattr(self.inner, name)

    def _failed(self, op: str, exc: Exception) -> None:
        self.errors[op] += 1
        if isinstance(exc, FencedWrite):
            self.fenced_writes += 1

    async def match(
        self, model: str, hashes: Sequence[BlockHash64], candidates: Collection[NodeKey] | None = None
    ) -> list[NodeMatch]:
        t0 = perf_counter()  # inlined, not _timed: one coroutine less on the lookup path
        try:
            found = await self._match(model, hashes, candidates)
        except Exception as exc:
            self._failed("match", exc)
            raise
        self._match_seconds(perf_counter() - t0)
        return found

    async def _timed(self, op: str, call: Awaitable[_T]) -> _T:
        t0 = perf_counter()
        try:
            result = await call
        except Exception as exc:
            self._failed(op, exc)
            raise
        self.seconds[op].observe(perf_counter() - t0)
        return result

    async def apply(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        return await self._timed("apply", self.inner.apply(model, node_id, dp_rank, ops))

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        await self._timed("clear", self.inner.clear(model, node_id, dp_rank))

    async def remove_node(self, node_id: str) -> None:
        await self._timed("remove_node", self.inner.remove_node(node_id))

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        return await self._timed("export_node", self.inner.export_node(model, node_id, dp_rank))

    async def replace_node(
        self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64], tiers: bytes = b""
    ) -> None:
        await self._timed("replace_node", self.inner.replace_node(model, node_id, dp_rank, hashes, tiers))

    async def stats(self, *, exact: bool = True) -> IndexStats:
        return await self._timed("stats", self.inner.stats(exact=exact))

    async def close(self) -> None:
        await self.inner.close()
