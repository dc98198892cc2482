"""The index's size figures: the cheap ones the refresh loop keeps, the exact ones the Stats RPC asks for."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from kvcoord.coordinator.health import LogOnce
from kvcoord.coordinator.metrics import Metrics
from kvcoord.index.base import Index, IndexStats

EXACT_STATS_SECONDS = 5.0
"""How long the Stats RPC reuses an exact index count."""


class IndexFigures:
    """The last index stats known, and whether they are stale. Lives on one event loop."""

    def __init__(self, index: Index, metrics: Metrics, log_once: LogOnce) -> None:
        self.index = index
        self.metrics = metrics
        self.log_once = log_once
        self.last: IndexStats | None = None
        self.stale = False
        """The last index stats call failed: ``last`` is what was known before."""
        self._failures = 0
        self._exact: tuple[float, IndexStats] | None = None
        self._exact_lock = asyncio.Lock()

    async def refresh(self) -> None:
        """The cheap figures into the size gauges: an exact distinct-block count can mean scanning
        millions of fields on a sharded backend, not something to do every stats interval."""
        try:
            stats = await self.index.stats(exact=False)
        except Exception as exc:
            self.failed(exc)
        else:
            self.ok()
            self.last = stats
            self.metrics.set_index_stats(stats)

    def failed(self, exc: BaseException) -> None:
        """An index stats call failed: the figures kept are stale (said in Stats), warned once per run
        of failures."""
        self.stale = True
        self.log_once(
            f"stats-fail:{self._failures}",
            logging.WARNING,
            "index stats failed (%s: %s); Stats and the size gauges keep the last figures, marked stale",
            type(exc).__name__,
            exc,
        )

    def ok(self) -> None:
        if self.stale:
            self.stale = False
            self._failures += 1  # a later failure warns again

    async def exact(self) -> tuple[IndexStats | None, bool]:
        """Stats for the Stats RPC: current entries and bytes, and an exact distinct-block count.

        Where the exact count is expensive (a sharded backend's cheap figure is an upper bound), the
        exact one is computed here, not in the refresh loop, and reused for ``EXACT_STATS_SECONDS`` (a
        burst of Stats calls shares one scan). Returns (stats, stale): stale when the index failed and
        the figures are the last known.
        """
        index = self.index
        try:
            stats = await index.stats(exact=False)
            if stats.blocks_upper_bound:
                async with self._exact_lock:
                    cached = self._exact
                    if cached is None or time.monotonic() - cached[0] >= EXACT_STATS_SECONDS:
                        cached = self._exact = (time.monotonic(), await index.stats())
                stats = dataclasses.replace(
                    stats,
                    blocks=cached[1].blocks,
                    blocks_by_model=cached[1].blocks_by_model,
                    blocks_upper_bound=cached[1].blocks_upper_bound,
                )
        except Exception as exc:
            self.failed(exc)
            return self.last, True
        self.ok()
        self.last = stats
        return stats, False
