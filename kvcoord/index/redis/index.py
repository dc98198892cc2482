"""``RedisIndex``: the Index protocol on Redis or a Redis Cluster, put together from the package's
parts (keys, scripts, connection, write queue, mirror); the package docstring describes the design."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
from collections.abc import Collection, Sequence
from typing import Any, cast

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from kvcoord import validate
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import (
    ApplyResult,
    EngineRecords,
    Fencing,
    IndexStats,
    NativeView,
    NodeKey,
    NodeMatch,
    NodeRecords,
    Remote,
    ReservationFeed,
)
from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import (
    _EXEC,
    _MULTI,
    RedisConnection,
    RedisMetrics,
    _command,
    _hmget_command,
)
from kvcoord.index.redis.epochs import BucketEpochs
from kvcoord.index.redis.fencing import RedisFencing
from kvcoord.index.redis.health import RedisHealth
from kvcoord.index.redis.keys import (
    _DEFAULT_CLUSTER_BUCKETS,
    _LAYOUT,
    _TIER_BITS,
    _loc_name,
    _pack,
    bucket_of,
    bucket_tags,
    conf_key,
)
from kvcoord.index.redis.mirror import LookupMirror
from kvcoord.index.redis.records import RedisEngineRecords, RedisNodeRecords, RedisReservationFeed
from kvcoord.index.redis.shards import REDIRECTS, ShardPaths
from kvcoord.index.redis.stats import read_stats
from kvcoord.index.redis.walk import _Names, _walk
from kvcoord.index.redis.writes import WriteQueue, compile_ops
from kvcoord.index.uri import IndexSpec, parse_index_uri
from kvcoord.validate import Op, SnapshotEntry
from kvcoord.waits import wait_event

__all__ = ["RedisIndex"]

log = logging.getLogger("kvcoord.index.redis")  # the backend's one logger, as before it was a package

_REPLACE_CHUNK = 20_000
"""Entries per script call when filling a replacement (bounds how long one script blocks Redis)."""
_RECLAIM_CHUNK = 1_000


class RedisIndex:
    """The :class:`~kvcoord.index.base.Index` protocol on Redis (``backend='redis'``) or Redis Cluster."""

    def __init__(
        self,
        client: aredis.Redis | RedisCluster,
        *,
        key_prefix: str = "kvcoord",
        buckets: int | None = None,
        reclaim_interval: float = 5.0,
        mirror: bool = False,
        wait: tuple[int, float] | None = None,
    ) -> None:
        self._r = client
        self._cluster = isinstance(client, RedisCluster)
        self.backend = "redis-cluster" if self._cluster else "redis"
        self.inline = False
        self._fencer = RedisFencing(self)
        self.fencing: Fencing | None = self._fencer
        """Replicas share this index: writes are fenced (``fencing.claim``)."""
        self._health = RedisHealth(self)
        self.remote: Remote | None = self._health
        """Health (``remote.ping``), lifetime (``remote.generation``), round-trip counters (``metrics``)."""
        self.native: NativeView | None = None
        self.node_directory: NodeRecords | None = RedisNodeRecords(client, key_prefix)
        self.engine_store: EngineRecords | None = RedisEngineRecords(client, key_prefix)
        self.reservation_feed: ReservationFeed | None = RedisReservationFeed(client, key_prefix)
        self.key_prefix = key_prefix
        self.buckets = buckets if buckets is not None else (_DEFAULT_CLUSTER_BUCKETS if self._cluster else 1)
        if self.buckets < 1:
            raise ValueError("buckets must be >= 1")
        self._tags = bucket_tags(key_prefix, self.buckets)
        self._conf_key = conf_key(key_prefix)
        self.metrics = RedisMetrics()
        self._conn = RedisConnection(client, self.metrics, wait)
        """``wait``: ``(replicas, timeout)`` of the WAIT after every index write (``?wait_replicas``)."""
        self._fast = self._conn.fast
        self._layout_checked = False
        self._layout_lock = asyncio.Lock()
        self._reclaim_interval = reclaim_interval
        self._reclaim_wake = asyncio.Event()
        self._reclaim_task: asyncio.Task[None] | None = None
        self._closed = False
        self._retired_gen = 0
        self._reclaimed_gen = 0
        """Retirements this client made, and how many of them a finished reclaim pass has covered."""
        self._epochs = BucketEpochs(self._conn, self._tags)
        """Per bucket: the ``T:epoch`` marker this client accepted (``remote.generation`` sets it).
        Every lookup and write checks it in its own round trip (``IndexReset`` when Redis's differs)."""
        self._writes = WriteQueue(self._conn, self._tags, self._epochs)
        self._names: dict[str, _Names] = {}
        """Per bucket tag: ``T:name`` as of a ``T:ver`` (the lookups' cache)."""
        self._shards = ShardPaths(client) if isinstance(client, RedisCluster) else None
        """A Cluster's pipelined connections, one per primary (lookups only); None off a Cluster."""
        self._mirror = LookupMirror(self._conn, self._tags, self._epochs) if mirror else None
        """Lookups from an in-memory copy fed by the buckets' change feeds (``?mirror=1``), or None."""
        self.metrics.mirror = self._mirror

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    def from_uri(cls, uri: str, *, key_prefix: str = "kvcoord") -> RedisIndex:
        """``redis://host:port/db`` (also ``rediss://``, ``unix://``), ``redis+cluster://h:p,h:p`` or
        ``redis+sentinel://h:p,h:p/master-name`` (:mod:`kvcoord.index.uri` lists every option).

        Query parameters read here: ``buckets`` (see the package docstring), ``timeout`` (socket
        timeout in seconds, default 5), ``prefix`` (overrides ``key_prefix``), ``mirror`` (``1``:
        answer lookups from an in-memory copy kept current by Redis's change feed; see
        :class:`LookupMirror`), ``wait_replicas``/``wait_timeout`` (``WAIT`` after every index write;
        a write fewer replicas confirmed raises ``WriteNotReplicated``). Does not connect.
        """
        return cls.from_spec(parse_index_uri(uri, key_prefix=key_prefix))

    @classmethod
    def from_spec(cls, spec: IndexSpec) -> RedisIndex:
        """From a parsed Redis URI (:func:`kvcoord.index.uri.parse_index_uri`). Does not connect."""
        parsed = spec.redis
        if parsed is None:
            raise ValueError(f"index URI {spec.uri!r} is not a Redis one")
        wait = (parsed.wait_replicas, parsed.wait_timeout) if parsed.wait_replicas else None
        return cls(parsed.client(), key_prefix=spec.key_prefix, buckets=parsed.buckets, mirror=parsed.mirror,
                   wait=wait)

    def bucket_of(self, node_id: str) -> int:
        """The bucket (hence hash tag, slot and shard) holding every key of ``node_id``."""
        return bucket_of(node_id, self.buckets)

    def tag_of(self, node_id: str) -> str:
        return self._tags[self.bucket_of(node_id)]

    async def _check_layout(self) -> None:
        """Refuse to share a keyspace with a client of another layout (bucket count, record format)."""
        if self._layout_checked:
            return
        async with self._layout_lock:  # concurrent first writers share one check
            if not self._layout_checked:
                await self._check_layout_now()

    async def _check_layout_now(self) -> None:
        mine = f"{_LAYOUT}:{self.buckets}"

        async def go() -> Any:
            await self._r.set(self._conf_key, mine, nx=True)
            return await self._r.get(self._conf_key)

        stored = await self._conn.round_trip(go)
        if stored is not None and stored.decode() != mine:
            layout, _, buckets = stored.decode().rpartition(":")
            if layout != _LAYOUT:
                raise ValueError(
                    f"the Redis keyspace {self.key_prefix!r} has layout {layout or 'v1'!r} "
                    f"(this client writes {_LAYOUT!r}): use a new key prefix"
                )
            raise ValueError(
                f"the Redis keyspace {self.key_prefix!r} uses {buckets} buckets, this client {self.buckets}"
            )
        if not self._epochs.known:
            await self._health.generation()  # library use: the coordinator reads it before serving
        self._layout_checked = True

    # ---------------------------------------------------------------------------------- the protocol

    async def apply(self, model: str, node_id: str, dp_rank: int, ops_in: Sequence[Op]) -> ApplyResult:
        validate.check_target(model, node_id, dp_rank)
        ops, skipped = compile_ops(ops_in)
        result = ApplyResult(skipped_group=skipped)
        if not ops:
            return result
        await self._check_layout()
        token = await self._fencer.token(node_id)
        batch: list[object] = [_loc_name(model, node_id, dp_rank), node_id, "A", token, len(ops)]
        blocks = 0
        for op, blob in ops:
            batch.append(op)
            batch.append(blob)
            blocks += len(blob) >> 3
        bucket = self.bucket_of(node_id)
        new, _dup, removed, unknown, cleared, skipped_removals, seq = await self._writes.submit(
            bucket, batch, blocks
        )
        if new < 0:
            raise self._fencer.fenced(node_id, "apply")
        if self._mirror is not None and seq:
            await self._mirror.caught_up(self._tags[bucket], seq)  # read-your-writes on this replica
        result.stored = int(new)
        result.skipped_group += int(skipped_removals)
        result.removed = int(removed)
        result.removed_unknown = int(unknown)
        result.cleared = int(cleared)
        if cleared:
            self._wake_reclaimer()
        return result

    def _want(self, model: str, candidates: Collection[NodeKey]) -> dict[int, set[bytes]]:
        """The candidates' location names, per bucket."""
        want: dict[int, set[bytes]] = {}
        for node_id, rank in candidates:
            want.setdefault(self.bucket_of(node_id), set()).add(_loc_name(model, node_id, rank).encode())
        return want

    async def match(
        self,
        model: str,
        hashes: Sequence[BlockHash64],
        candidates: Collection[NodeKey] | None = None,
    ) -> list[NodeMatch]:
        if not hashes:
            return []
        if type(hashes) is not list:
            hashes = list(hashes)  # e.g. the wire's packed view: the walks read a list
        if not self._layout_checked:
            await self._check_layout()  # (the epochs: accepted once before any lookup)
        mirror = self._mirror
        if mirror is not None:
            mirror.start()
            if mirror.current():  # (hashes are checked by the walk: the same error as below)
                want = self._want(model, candidates) if candidates is not None else None
                return mirror.match(model, hashes, want)
        try:
            blob = _pack(hashes)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"query hashes must be uint64 ints: {e}") from e
        return await self._match_walked(model, blob, candidates)

    async def _match_walked(
        self, model: str, blob: bytes, candidates: Collection[NodeKey] | None
    ) -> list[NodeMatch]:
        """``match`` by reading, per bucket, ``NAMES`` and a raw HMGET of the whole query's holder strings
        in one ``MULTI``, and walking them here (:func:`~kvcoord.index.redis.walk._walk`). On the fast path
        every bucket's MULTI goes in one write, one round trip; on a Cluster each bucket's is a transaction
        on its shard, all at once (:meth:`_read_cluster`).

        Why not walk in Lua: Redis's Lua turns each HMGET reply element into a Lua string and each
        query hash into a substring, ~0.6-1 us per block, several times the in-process walk; a raw
        HMGET costs Redis ~0.1 us per field and hiredis parses the reply in C. Consecutive blocks held
        by the same locations have equal holder strings, so the walk decodes only where they change
        (``itertools.groupby``). MULTI makes the names and the holders one atomic read.
        """
        want: dict[int, set[bytes]] | None = None
        if candidates is not None:
            want = self._want(model, candidates)
            if not want:
                return []
            buckets = sorted(want)
        else:
            buckets = list(range(self.buckets))
        tags = [self._tags[b] for b in buckets]
        hmgets = [_hmget_command(f"{tag}:inv:{model}".encode(), blob) for tag in tags]
        read = self._read_fast if self._fast is not None else self._read_cluster
        res = await self._conn.round_trip(functools.partial(read, tags, hmgets))
        self.metrics.walked_lookups += 1
        lost = [tag for k, tag in enumerate(tags) if lua.epoch_changed(res[2 * k])]
        if lost:
            raise lua.index_reset(lost, "lookup")
        out: list[NodeMatch] = []
        for k, tag in enumerate(tags):
            got = res[2 * k]
            names = self._names.get(tag)
            if got != 0 or names is None:
                names = self._names[tag] = _Names(got[0], got[1])
            allowed = None
            if want is not None:
                allowed = {i for n in want[buckets[k]] if (i := names.by_name.get(n)) is not None}
                if not allowed:
                    continue
            out.extend(_walk(res[2 * k + 1], names, allowed))
        out.sort(key=lambda m: (-m.matched_blocks, m.node_id, m.dp_rank))
        return out

    async def _read_fast(self, tags: list[str], hmgets: list[bytes], retry: bool = True) -> list[Any]:
        """The fast lookup's one write: ``MULTI``, per bucket ``NAMES`` (against the cached ``T:ver`` and
        the accepted epoch) and the HMGET, ``EXEC``; replies are ``[names, 0 or -2, holders]`` per
        bucket, flat."""
        fast = self._fast
        assert fast is not None
        parts = [_MULTI]
        for tag, hm in zip(tags, hmgets, strict=True):
            cached = self._names.get(tag)
            ver = cached.ver if cached is not None else b"-"
            epoch = self._epochs.of(tag)
            parts.append(_command("EVALSHA", lua.NAMES.sha, 1, tag + ":loc", tag, ver, epoch))
            parts.append(hm)
        parts.append(_EXEC)
        res: list[Any] = await fast.call(b"".join(parts), skip=1 + 2 * len(tags))
        for r in res:
            if isinstance(r, rexc.ResponseError):
                if retry and str(r).startswith("NOSCRIPT"):
                    await fast.call(_command("SCRIPT", "LOAD", lua.NAMES.src))
                    return await self._read_fast(tags, hmgets, False)
                raise r
        return res

    async def _read_cluster(self, tags: list[str], hmgets: list[bytes], retry: bool = True) -> list[Any]:
        """:meth:`_read_fast`'s read on a Cluster: per bucket one ``MULTI`` (its keys share one slot) on
        its shard's pipelined connection, every bucket's at once; the replies are :meth:`_read_fast`'s. A
        redirect or a lost connection refreshes the slots' owners and tries once more."""
        shards = self._shards
        assert shards is not None

        async def one(tag: str, hm: bytes) -> list[Any]:
            cached = self._names.get(tag)
            ver, epoch = cached.ver if cached is not None else b"-", self._epochs.of(tag)
            names = _command("EVALSHA", lua.NAMES.sha, 1, tag + ":loc", tag, ver, epoch)
            replies: list[Any] = await shards.of(tag).call(_MULTI + names + hm + _EXEC, keep=4)
            return cast(list[Any], replies[3])

        try:
            res = [r for pair in await asyncio.gather(*map(one, tags, hmgets)) for r in pair]
        except (TimeoutError, rexc.ResponseError, rexc.ConnectionError, OSError) as e:
            moved = not isinstance(e, rexc.ResponseError) or str(e).startswith(REDIRECTS)
            if not (retry and moved):
                raise
            await shards.refresh()
            return await self._read_cluster(tags, hmgets, False)
        for r in res:
            if isinstance(r, rexc.ResponseError):
                if retry and str(r).startswith("NOSCRIPT"):
                    await self._conn.client.script_load(lua.NAMES.src)
                    return await self._read_cluster(tags, hmgets, False)
                raise r
        return res

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        validate.check_target(model, node_id, dp_rank)
        lf = _loc_name(model, node_id, dp_rank)
        await self._check_layout()
        token = await self._fencer.token(node_id)
        res = int(await self._epochs.eval(lua.CLEAR, self.tag_of(node_id), "clear", lf, node_id, token,
                                             durable=True))
        if res < 0:
            raise self._fencer.fenced(node_id, "clear")
        if res:
            self._wake_reclaimer()
        await self._mirror_sync(self.tag_of(node_id))

    async def remove_node(self, node_id: str) -> None:
        await self._check_layout()
        token = await self._fencer.token(node_id)
        tag = self.tag_of(node_id)
        res = int(await self._epochs.eval(lua.REMOVE_NODE, tag, "remove_node", node_id, token, "0",
                                             durable=True))
        if res < 0:
            raise self._fencer.fenced(node_id, "remove_node")
        if res:
            self._wake_reclaimer()
        await self._mirror_sync(self.tag_of(node_id))

    async def _mirror_sync(self, tag: str) -> None:
        """Read-your-writes for a change whose feed seq the script did not return: wait for the copy
        to reach the feed's current end."""
        mirror = self._mirror
        if mirror is None or not mirror.ready:
            return
        seq = await self._conn.round_trip(lambda: self._r.get(f"{tag}:feedseq"))
        if seq:
            await mirror.caught_up(tag, int(seq))

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        validate.check_target(model, node_id, dp_rank)
        tag = self.tag_of(node_id)
        loc_id = await self._conn.round_trip(
            lambda: self._r.hget(tag + ":loc", _loc_name(model, node_id, dp_rank))
        )
        if loc_id is None:
            return []
        key = f"{tag}:fwd:{int(loc_id)}"

        async def scan() -> list[SnapshotEntry]:
            out: list[SnapshotEntry] = []
            async for h, m in self._r.hscan_iter(key, count=10_000):
                (h64,) = struct.unpack(">Q", h)
                mask = m[0]
                out.extend((BlockHash64(h64), t) for t, bit in _TIER_BITS if mask & bit)
            return out

        entries = await self._conn.round_trip(scan)
        entries.sort()
        return entries

    async def replace_node(
        self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64], tiers: bytes = b""
    ) -> None:
        validate.check_target(model, node_id, dp_rank)
        per_tier = validate.snapshot_per_tier(hashes, tiers)
        await self._check_layout()
        tag = self.tag_of(node_id)
        lf = _loc_name(model, node_id, dp_rank)
        token = await self._fencer.token(node_id)
        pending = int(await self._epochs.eval(lua.BEGIN, tag, "replace_node", lf, node_id, token))
        if pending < 0:
            raise self._fencer.fenced(node_id, "replace_node")
        try:
            committed = await self._fill_pending(tag, lf, node_id, pending, per_tier, token)
        except rexc.ResponseError as e:
            if "ABORTED" not in str(e):
                raise
            committed = 0  # the node was removed while we filled: its pending entries are being reclaimed
        except BaseException:
            with contextlib.suppress(Exception):
                await self._epochs.eval(lua.REMOVE_PENDING, tag, "replace_node", lf, node_id, str(pending))
            raise
        self._wake_reclaimer()
        await self._mirror_sync(tag)
        if not committed:
            log.info("replace_node %s/%s/%d lost to a concurrent remove_node", model, node_id, dp_rank)

    async def _fill_pending(
        self, tag: str, lf: str, node_id: str, pending: int, per_tier: Sequence[Sequence[int]], token: str
    ) -> Any:
        """Store a snapshot into the pending location in chunks, then swap it in (COMMIT's answer).
        Raises ``FencedWrite`` when the node was claimed by another client meanwhile."""
        for t, hs in enumerate(per_tier):
            for s in range(0, len(hs), _REPLACE_CHUNK):
                blob = _pack(hs[s : s + _REPLACE_CHUNK])
                res = await self._epochs.eval(lua.WRITE, tag, "replace_node", lf, node_id, str(pending),
                                               token, 1, f"S{t}", blob)
                if int(res[0]) < 0:
                    raise self._fencer.fenced(node_id, "replace_node")
        # The commit's WAIT (?wait_replicas) covers the chunks too: Redis replicates in order
        committed = int(await self._epochs.eval(lua.COMMIT, tag, "replace_node", lf, node_id, str(pending),
                                                 token, durable=True))
        if committed < 0:
            raise self._fencer.fenced(node_id, "replace_node")
        return committed

    # ---------------------------------------------------------------------------------- stats

    async def stats(self, *, exact: bool = True) -> IndexStats:
        """Exact: for this client's retirements (it reclaims them first); others' are reclaimed in the
        background by whichever replica gets there, and until then their blocks may still count.
        Distinct blocks of a model spread over several buckets (Cluster) are counted by HSCAN of
        their inverted hashes: up to millions of fields.

        Not exact (periodic gauges): one script call per bucket, no scan, no reclaim: ``blocks`` is the
        per-bucket sum, an upper bound when a model spans several buckets (a block held in two buckets
        counts twice); then ``blocks_upper_bound`` is set."""
        if exact and self._reclaimed_gen < self._retired_gen:
            await self.reclaim()
        return await read_stats(self._conn, self._r, self._tags, exact=exact)

    # ---------------------------------------------------------------------------------- health

    async def mirror_ready(self, timeout: float = 10.0) -> bool:
        """Start the lookup mirror (``?mirror=1``) if not running, and wait until it is loaded."""
        mirror = self._mirror
        if mirror is None:
            return False
        await self._check_layout()  # the accepted epochs: the copy answers only within them
        mirror.start()
        deadline = time.monotonic() + timeout
        while not mirror.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return mirror.ready

    async def close(self) -> None:
        self._closed = True
        if self._mirror is not None:
            await self._mirror.close()
        await self._writes.close()
        task, self._reclaim_task = self._reclaim_task, None
        if task is not None:
            # Let an in-flight reclaim chunk finish (cancelling redis-py's cluster pipeline midway
            # leaves its per-node tasks holding connections until the socket timeout).
            self._reclaim_wake.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._shards is not None:
            self._shards.close()
        await self._conn.close()
        if self._mirror is not None:
            await self._mirror.reap()

    # ------------------------------------------------------------------------------------- reclaim

    async def reclaim(self) -> int:
        """Reclaim every retired location's entries now; returns how many (block, location) were dropped."""
        total = 0
        gen = self._retired_gen
        pending = list(self._tags)
        while pending and not self._closed:
            res = await self._conn.eval_many(lua.RECLAIM, [(tag, ["", _RECLAIM_CHUNK]) for tag in pending])
            done_now = sum(int(done) for done, _ in res)
            total += done_now
            self.metrics.reclaimed_entries += done_now
            pending = [tag for tag, (done, left) in zip(pending, res, strict=True) if int(left) or int(done)]
        if not pending:
            self._reclaimed_gen = max(self._reclaimed_gen, gen)
        return total

    def _wake_reclaimer(self) -> None:
        self._retired_gen += 1
        if self._closed:
            return
        if self._reclaim_task is None or self._reclaim_task.done():
            loop = asyncio.get_running_loop()
            self._reclaim_task = loop.create_task(self._reclaim_loop(), name="redis-reclaim")
        self._reclaim_wake.set()

    async def _reclaim_loop(self) -> None:
        """Reclaim after retirements, and every ``reclaim_interval`` (other replicas' leftovers)."""
        backoff = 0.1
        while not self._closed:
            self._reclaim_wake.clear()
            try:
                await self.reclaim()
                backoff = 0.1
            except Exception as e:
                log.warning("redis reclaim failed (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            await wait_event(self._reclaim_wake, self._reclaim_interval)
