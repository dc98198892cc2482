"""The Redis index's ``remote`` capability: its health (``ping``), its lifetime (``generation``) and its
round-trip counters (``metrics``), as :class:`kvcoord.index.base.Remote` says."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import TYPE_CHECKING

from redis.asyncio.cluster import RedisCluster

from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import RedisMetrics

if TYPE_CHECKING:
    from kvcoord.index.redis.index import RedisIndex


class RedisHealth:
    """Whether one :class:`~kvcoord.index.redis.index.RedisIndex` client reaches Redis, and whether Redis
    still holds the index."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index

    @property
    def metrics(self) -> RedisMetrics:
        return self.index.metrics

    async def ping(self) -> bool:
        if self.index._mirror is not None:
            self.index._mirror.start()  # the coordinator pings at start: load the copy before lookups come
        try:
            if self.index._cluster:
                await asyncio.wait_for(self.index._r.ping(target_nodes=RedisCluster.PRIMARIES), 2.0)
            else:
                await asyncio.wait_for(self.index._r.ping(), 2.0)
        except Exception:
            self.metrics.errors += 1
            self.metrics.up = False
            return False
        self.metrics.answered()
        return True

    async def generation(self) -> str:
        """A token that changes when Redis lost the index (restarted empty, flushed, failed over badly).

        Each bucket keeps a random marker ``T:epoch``, set when missing (one script per bucket, one
        round trip); the coordinator compares the token over time and asks every agent for a snapshot
        when it changed. The markers read become the index's accepted epochs: its lookups and writes
        check them inline and raise ``IndexReset`` until this is called again after a loss. Raises
        :class:`~kvcoord.index.redis.client.IndexUnavailable` when Redis cannot be reached.
        """
        ix = self.index
        tokens = await ix._conn.eval_many(lua.EPOCH, [(tag, [uuid.uuid4().hex]) for tag in ix._tags])
        if ix._epochs.accept(tokens):
            ix._layout_checked = False  # the layout record was lost with the data: written again
        return hashlib.sha1(b"|".join(t if isinstance(t, bytes) else b"" for t in tokens)).hexdigest()[:16]

    async def data_epoch(self) -> str:
        """Alias of :meth:`generation` (the name this module used first)."""
        return await self.generation()
