"""The buckets' lifetimes: per bucket, the ``T:epoch`` marker this client accepted (see the package
docstring). Lookups and write scripts carry it and Redis checks it in the same round trip, so a bucket
that lost its data (FLUSHALL, a restart without persistence) is refused, never answered from or written
into, until the client re-reads the generation (``remote.generation``, which accepts the new markers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import RedisConnection, _Script


class BucketEpochs:
    """The accepted marker per bucket tag, shared by the index, its write queue and its mirror."""

    __slots__ = ("_accepted", "_conn", "_tags")

    def __init__(self, conn: RedisConnection, tags: Sequence[str]) -> None:
        self._conn = conn
        self._tags = list(tags)
        self._accepted: dict[str, bytes] = {}

    def of(self, tag: str) -> bytes:
        """The marker accepted for ``tag`` (``b''`` before any: Redis's check then fails)."""
        return self._accepted.get(tag, b"")

    @property
    def known(self) -> bool:
        """Every bucket has an accepted marker."""
        return len(self._accepted) == len(self._tags)

    def accept(self, tokens: Sequence[object]) -> bool:
        """The markers ``remote.generation`` read (and set where missing), in bucket order. True when
        they replaced different ones (the data was lost since the last reading)."""
        new = {tag: t if isinstance(t, bytes) else b"" for tag, t in zip(self._tags, tokens, strict=True)}
        changed = bool(self._accepted) and new != self._accepted
        self._accepted = new
        return changed

    async def eval(self, script: _Script, tag: str, what: str, *args: object, durable: bool = False) -> Any:
        """A write script on bucket ``tag``, carrying its accepted marker; ``IndexReset`` if refused.
        ``durable``: a write that acknowledges data (``RedisConnection.write``: WAITs with
        ``?wait_replicas``), rather than a step of one (a snapshot's BEGIN, a claim)."""
        run = self._conn.write if durable else self._conn.eval
        res = await run(script, tag, self.of(tag), *args)
        if lua.epoch_changed(res):
            raise lua.index_reset([tag], what)
        return res
