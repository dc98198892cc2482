"""What coordinator replicas share beside the index, kept in the index's Redis: the node directory
(:class:`RedisNodeRecords`), the engine registrations with their owner records
(:class:`RedisEngineRecords`), and the stream of routers' reservation changes
(:class:`RedisReservationFeed`). Records and entries are opaque strings here; the coordinator encodes and
decodes them (``kvcoord.coordinator.shared``, ``kvcoord.coordinator.engines`` and
``kvcoord.coordinator.reservation_sync``). Each store is one or two keys in one hash slot; the hashes are
written by the Lua scripts of this package (``scripts/*.lua``). They share the index's client, and close
with it."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from kvcoord.index.redis.scripts import read_script

log = logging.getLogger("kvcoord.index.redis")

__all__ = ["RedisEngineRecords", "RedisNodeRecords", "RedisReservationFeed"]


class RedisNodeRecords:
    """The node directory as one Redis hash, ``{prefix}:nodes`` (one key: on a Cluster it lives on one
    shard, which is fine for a few thousand small records read twice a second)."""

    def __init__(self, client: Any, prefix: str) -> None:
        self._r = client
        self.key = f"{{{prefix}}}:nodes"
        self._publish = client.register_script(read_script("publish_node.lua"))

    async def publish(self, records: Sequence[tuple[str, str, float, int, str]]) -> None:
        args: list[object] = []
        for node_id, owner, heard, fence, record in records:
            args += [node_id, owner, repr(heard), str(fence), record]
        if not args:
            return
        try:
            await self._publish(keys=[self.key], args=args)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc

    async def fetch_all(self) -> dict[str, bytes]:
        try:
            raw: dict[bytes, bytes] = await self._r.hgetall(self.key)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc
        return {k.decode(errors="replace"): v for k, v in raw.items()}

    async def fetch(self, node_id: str) -> bytes | None:
        try:
            raw: bytes | None = await self._r.hget(self.key, node_id)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc
        return raw

    async def delete(self, node_ids: Sequence[str]) -> None:
        if not node_ids:
            return
        try:
            await self._r.hdel(self.key, *node_ids)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc


class RedisEngineRecords:
    """Registrations and owner records as two Redis hashes in one hash slot (``{prefix}:engines`` and
    ``{prefix}:engine-owners``). Owner records carry their expiry (Redis server time, so replicas' clocks
    need not agree) instead of per-field TTLs, which Redis 7.2 lacks."""

    def __init__(self, client: Any, prefix: str) -> None:
        self._r = client
        self.key = f"{{{prefix}}}:engines"
        self.owners_key = f"{{{prefix}}}:engine-owners"
        self.kept = f"kept in Redis (hash {self.key})"
        self._swap = client.register_script(read_script("swap_engine.lua"))
        self._claim = client.register_script(read_script("claim_engine.lua"))
        self._release = client.register_script(read_script("release_engine.lua"))

    async def _now(self) -> float:
        sec, usec = await self._r.time()
        return float(sec) + float(usec) / 1e6

    async def all(self) -> dict[int, bytes]:
        try:
            raw: dict[bytes, bytes] = await self._r.hgetall(self.key)
        except Exception as exc:
            raise ConnectionError(f"engine registrations: {exc}") from exc
        out: dict[int, bytes] = {}
        for k, v in raw.items():
            try:
                out[int(k)] = v
            except ValueError:
                log.warning("skipping an engine registration of a bad instance id %r", k)
        return out

    async def swap(self, instance_id: int, old: str, new: str) -> bool:
        try:
            return bool(await self._swap(keys=[self.key], args=[str(instance_id), old, new]))
        except Exception as exc:
            raise ConnectionError(f"engine registrations: {exc}") from exc

    async def claim(self, instance_id: int, replica: str, status: str, lease: float) -> bool:
        try:
            now = await self._now()
            return bool(await self._claim(keys=[self.owners_key],
                                          args=[str(instance_id), replica, status, repr(now), repr(lease)]))
        except Exception as exc:
            raise ConnectionError(f"engine owners: {exc}") from exc

    async def release(self, instance_id: int, replica: str) -> None:
        try:
            await self._release(keys=[self.owners_key], args=[str(instance_id), replica])
        except Exception as exc:
            raise ConnectionError(f"engine owners: {exc}") from exc

    async def owners(self) -> dict[int, tuple[str, str]]:
        try:
            now = await self._now()
            raw: dict[bytes, bytes] = await self._r.hgetall(self.owners_key)
        except Exception as exc:
            raise ConnectionError(f"engine owners: {exc}") from exc
        out: dict[int, tuple[str, str]] = {}
        for k, v in raw.items():
            try:
                d = json.loads(v)
                if float(d["expires"]) > now:
                    out[int(k)] = (str(d["replica"]), str(d.get("status", "")))
            except (ValueError, KeyError, TypeError):
                continue
        return out


FEED_ENTRIES = 10_000
"""Entries the reservation stream keeps (``XADD MAXLEN ~``): replicas read it every few ms, so only a
reader stalled for longer than this many flushes misses entries (their reservations expire on their own)."""
_READ_COUNT = 1_000
"""Entries one read takes at most (the rest come at the next)."""


class RedisReservationFeed:
    """Routers' reservation changes exchanged by replicas, as one Redis stream ``{prefix}:reservations``
    (one key, so one shard on a Cluster): each flush is one pipelined ``XADD`` + ``XREAD`` on the index's
    client. Lookups' holds on new prefixes are keys ``{prefix}:hold:<model>:<block hash>`` that expire."""

    def __init__(self, client: Any, prefix: str) -> None:
        self._r = client
        self.key = f"{{{prefix}}}:reservations"
        self.hold_prefix = f"{{{prefix}}}:hold:"

    async def append(self, entry: bytes) -> str:
        try:
            return _text(await self._r.xadd(self.key, {"c": entry}, maxlen=FEED_ENTRIES, approximate=True))
        except Exception as exc:
            raise ConnectionError(f"reservation feed: {exc}") from exc

    async def history(self, entry: bytes, seconds: float) -> tuple[str, float, list[tuple[float, bytes]]]:
        """Append ``entry`` (its id is Redis' time now), then page back (newest first) through the entries
        of the ``seconds`` before it, at most :data:`FEED_ENTRIES`; every time is an id's milliseconds
        (Redis' clock, so no replica's is involved)."""
        now = await self.append(entry)
        now_ms = _ms(now)
        low, high = f"{max(0, now_ms - int(seconds * 1000))}-0", now
        out: list[tuple[float, bytes]] = []
        try:
            while len(out) < FEED_ENTRIES:
                page: list[Any] = await self._r.xrevrange(self.key, max=high, min=low, count=_READ_COUNT)
                for entry_id, fields in page:
                    raw = fields.get(b"c")
                    if raw is not None:
                        out.append((_ms(_text(entry_id)) / 1000, raw))
                if len(page) < _READ_COUNT:
                    break
                high = "(" + _text(page[-1][0])
        except Exception as exc:
            raise ConnectionError(f"reservation feed: {exc}") from exc
        del out[FEED_ENTRIES:]
        out.reverse()
        return now, now_ms / 1000, out

    async def exchange(self, entry: bytes | None,
                       after: str) -> tuple[str, float | None, list[tuple[float, bytes]]]:
        try:
            pipe = self._r.pipeline(transaction=False)
            if entry is not None:
                pipe.xadd(self.key, {"c": entry}, maxlen=FEED_ENTRIES, approximate=True)
            pipe.xread({self.key: after}, count=_READ_COUNT)
            replies = await pipe.execute()
        except Exception as exc:
            raise ConnectionError(f"reservation feed: {exc}") from exc
        out: list[tuple[float, bytes]] = []
        for _key, entries in replies[-1] or []:
            for entry_id, fields in entries:
                after = _text(entry_id)
                raw = fields.get(b"c")
                if raw is not None:
                    out.append((_ms(after) / 1000, raw))
        return after, None if entry is None else _ms(_text(replies[0])) / 1000, out

    async def claim(self, name: str, holder: bytes, seconds: float) -> tuple[bytes, float] | None:
        """``SET NX PX``, ``GET`` and ``PTTL`` of ``{prefix}:hold:<name>``, pipelined (any Redis version;
        the key shares the stream's slot). A claim that lapsed between them is nobody's: None."""
        key = self.hold_prefix + name
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.set(key, holder, nx=True, px=max(1, int(seconds * 1000)))
            pipe.get(key)
            pipe.pttl(key)
            claimed, now, left_ms = await pipe.execute()
        except Exception as exc:
            raise ConnectionError(f"reservation feed: {exc}") from exc
        if claimed or now is None or left_ms <= 0:
            return None
        return bytes(now), left_ms / 1000


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _ms(entry_id: str) -> int:
    """A stream id's milliseconds (``<ms>-<seq>``): when Redis added the entry, by its clock."""
    return int(entry_id.split("-", 1)[0])
