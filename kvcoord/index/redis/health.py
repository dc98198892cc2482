"""The Redis index's ``remote`` capability: its health (``ping``), its lifetime (``generation``) and its
round-trip counters (``metrics``), as :class:`kvcoord.index.base.Remote` says."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import TYPE_CHECKING

import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import NotPrimary, RedisMetrics, is_not_primary

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
        if self.index._conn.watch is not None:
            self.index._conn.watch.start()  # the sentinels' failover announcements, before any round trip
        try:
            async with asyncio.timeout(2.0):  # not wait_for: the coordinator's refresh loop pings
                if self.index._cluster:
                    await self.index._r.ping(target_nodes=RedisCluster.PRIMARIES)
                else:  # ROLE, not PING: a demoted node answers PING but refuses every write
                    await self._primary()
        except Exception as e:
            self.metrics.errors += 1
            self.metrics.up = False
            if is_not_primary(e):
                await self.index._conn.primary_moved()
            return False
        self.metrics.answered()
        return True

    async def _primary(self) -> None:
        """:class:`NotPrimary` unless the node says master (PING only, if its ACL denies ``ROLE``)."""
        try:
            role = await self.index._r.execute_command("ROLE")
        except rexc.NoPermissionError:
            await self.index._r.ping()
            return
        if role[0] != b"master":
            raise NotPrimary(f"redis answers as a {role[0]!r}, not the primary")

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
