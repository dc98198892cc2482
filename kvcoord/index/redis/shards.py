"""The pipelined fast path on a Redis Cluster: one :class:`~kvcoord.index.redis.client._FastPath` per
primary, found by slot through redis-py's own view of the cluster, so a lookup sends each bucket's
``MULTI`` straight to its shard, every bucket at once. A ``MOVED`` (a failover, a resharding) or a lost
connection refreshes that view; writes and everything else keep going through redis-py. Over TLS
(``redis+cluster://…?ssl=1``) each connection takes redis-py's TLS context from the cluster's own options."""

from __future__ import annotations

import contextlib
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from kvcoord.index.redis.client import _FastPath, tls_context

REDIRECTS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
"""Replies that mean the slot is (for now) served elsewhere: refresh the view and try again."""


class ShardPaths:
    """Per primary of ``client``'s cluster, a lazily connected pipelined connection."""

    __slots__ = ("_client", "_kwargs", "_paths", "_tls")

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        kwargs: dict[str, Any] = dict(client.get_connection_kwargs())
        klass = kwargs.pop("connection_class", None) or Connection
        self._kwargs = kwargs
        self._tls = tls_context(klass, kwargs)
        self._paths: dict[tuple[str, int], _FastPath] = {}

    def of(self, tag: str) -> _FastPath:
        """The connection to the primary serving bucket ``tag`` (its keys share the tag's slot)."""
        node = self._client.nodes_manager.get_node_from_slot(key_slot(f"{tag}:loc".encode()))
        where = (str(node.host), int(node.port))
        path = self._paths.get(where)
        if path is None:
            path = self._paths[where] = _FastPath({**self._kwargs, "host": where[0], "port": where[1]},
                                                  tls=self._tls)
        return path

    async def refresh(self) -> None:
        """Ask the cluster where the slots are now, and drop every connection (a new one checks ``ROLE``)."""
        self.close(abort=True)
        with contextlib.suppress(Exception):  # unreachable now: the next lookup fails and tries again
            await self._client.nodes_manager.initialize()

    def close(self, abort: bool = False) -> None:
        for path in self._paths.values():
            path.close(abort)
        self._paths.clear()
