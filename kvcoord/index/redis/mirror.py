"""The lookup mirror (``?mirror=1``): this client's in-memory copy of the buckets' inverted hashes,
kept current by their change feeds, so that lookups walk memory instead of Redis (see
:class:`LookupMirror`). It reaches Redis only through the :class:`RedisConnection` it is given."""

from __future__ import annotations

import asyncio
import bisect
import logging
import operator
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeMatch
from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import RedisConnection, is_not_primary
from kvcoord.index.redis.epochs import BucketEpochs
from kvcoord.index.redis.keys import _glob_escape, _pack
from kvcoord.index.redis.walk import _LOCAL_IDS, _holder_runs, _Names, _rebase, _walk_runs
from kvcoord.native import native

_mirror_walk = native.mirror_walk if native is not None else None

log = logging.getLogger("kvcoord.index.redis")  # the backend's one logger, as before it was a package


class _FeedGap(Exception):
    """The mirror missed feed entries (trimmed, or Redis lost the feed): it must reload."""


_FEED_REC = struct.Struct(">QI")
_FEED_BLOCK = 250
"""Milliseconds a feed reader's XREAD blocks: also how soon it notices that it should stop."""
_FEED_COUNT = 1000
"""Entries one XREAD takes at most."""
CURRENT_SECONDS = 2 * _FEED_BLOCK / 1000
"""The copy answers a lookup only if every bucket's reader confirmed its epoch at most this long ago."""
_BY_NODE = operator.itemgetter(0, 1)
_BY_BLOCKS = operator.itemgetter(2)


class LookupMirror:
    """This client's copy of every bucket's inverted hashes and live location names, kept current
    from the buckets' change feeds (``T:feed``), so that lookups walk memory instead of Redis.

    Why: a 512-block lookup costs Redis itself ~0.1-0.25 ms of HMGET however it is walked; the copy
    answers with the same walk (``_walk``) in tens of microseconds. Redis stays the shared, durable
    index and the order of changes: each write script appends the holder strings it set to its
    bucket's feed in the same atomic call, so replaying the feed in order reproduces Redis's state.

    Loading: set ``T:feedon`` (from then on every writer, of any replica, feeds), note the feed's last
    entry, copy ``T:name`` and the inverted hashes (HSCAN), then replay the feed from the noted entry.
    Entries replayed over newer copied values converge, because each sets fields to absolute values
    and the last entry touching a field wins. A missed entry (sequence gap: the feed was trimmed past
    a slow reader, or Redis restarted) or a lost connection means a reload; until loaded, ``ready`` is
    false and lookups take the Redis path. Each bucket's feed has its own reader (on a Cluster the
    buckets live on different shards).

    Lost data (FLUSHALL, Redis restarted empty): the feed and ``T:feedon`` are gone, so writers stop
    feeding and the copy would freeze. So the copy is used only while provably current
    (:meth:`current`): each reader reads the bucket's ``T:epoch`` when its XREAD returns less than a full
    batch (the copy then holds every entry the feed had when the XREAD was sent; at most every 100 ms,
    at least every ``_FEED_BLOCK`` ms while Redis answers) and reloads when it changed; a lookup uses
    the copy only if, for every bucket, the epoch the copy was loaded in is the one the index accepted
    and a reader confirmed it, as of a moment within :data:`CURRENT_SECONDS`. Guarantee: an answer from
    the copy reflects every feed entry of the index's accepted lifetime up to a moment at most
    ``CURRENT_SECONDS`` before the lookup (plus this client's own writes, ``caught_up``); otherwise the
    lookup takes the Redis path, which checks the epoch in its own round trip.
    """

    def __init__(self, conn: RedisConnection, tags: Sequence[str], epochs: BucketEpochs) -> None:
        """``tags``: every bucket's hash tag, in bucket order (the index's); ``epochs``: the index's
        accepted epoch per tag (the index keeps it current)."""
        self._conn = conn
        self._accepted = epochs
        self._epoch: dict[str, bytes] = {}
        """Per bucket tag: the ``T:epoch`` the copy was loaded in."""
        self._confirmed: dict[str, float] = {}
        """Per bucket tag: when (monotonic, taken before the read was sent) that epoch was last read."""
        self._r = conn.client
        self._tags = list(tags)
        self.ready = False
        """The copy is loaded: lookups may use it."""
        self.active = False
        """Loading or following the feed (not failed, not stopped)."""
        self.inv: dict[str, dict[str, dict[int, bytes]]] = {}
        """Per bucket tag, per model: block hash -> holder string, as in ``T:inv:<model>``."""
        self.names: dict[str, _Names] = {}
        self.merged: dict[str, dict[int, bytes]] | None = None
        """With several buckets: per model, block hash -> every bucket's holder records in one string,
        location ids made global (``bucket << 24 | id``, so a record's first byte is its bucket): a
        lookup walks one copy instead of one per bucket. None: one bucket, or an id past 2**24."""
        self.merged_names = _Names(b"", [])
        self._bucket_of_tag = {tag: b for b, tag in enumerate(self._tags)}
        self._last_id: dict[str, bytes] = {}
        self.seq: dict[str, int] = {}
        """Per bucket tag: the feed sequence number applied last."""
        self._waiters: list[tuple[str, int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._halt = False
        """Stop: set by ``close``; the readers see it when their XREAD returns."""
        self._halt_readers = False
        """One reader failed: the others stop (then the copy reloads)."""
        self.loads = 0
        self.entries_applied = 0
        self.lookups = 0

    def current(self) -> bool:
        """Whether a lookup may use the copy now (see the class docstring's guarantee)."""
        if not self.ready:
            return False
        oldest = time.monotonic() - CURRENT_SECONDS
        accepted, confirmed = self._accepted, self._confirmed
        for tag in self._tags:
            epoch = accepted.of(tag)
            if not epoch or self._epoch.get(tag) != epoch or confirmed.get(tag, 0.0) < oldest:
                return False
        return True

    async def _confirm(self, tag: str, sent: float) -> None:
        """After an XREAD sent at ``sent`` (monotonic) returned less than a full batch, so that the copy
        holds every entry the feed had then: read the bucket's epoch. Unchanged, the copy is current as of
        ``sent``; changed, it reloads. At most every ``CURRENT_SECONDS / 5`` (a busy feed returns often)."""
        if sent - self._confirmed.get(tag, 0.0) < CURRENT_SECONDS / 5:
            return
        epoch = await self._r.get(f"{tag}:epoch")
        if epoch != self._epoch.get(tag):
            raise _FeedGap(f"the epoch of {tag} changed (Redis lost its data)")
        self._confirmed[tag] = sent

    # ------------------------------------------------------------------------------- running

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._halt = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-mirror")

    async def close(self, timeout: float = 1.5) -> None:
        """Stop following the feed: flag the readers and let their current XREADs return (within
        ``_FEED_BLOCK``). Cancelling a redis-py read in flight can leave its task waiting on the
        connection's cleanup, so cancelling is the last resort; ``reap`` collects such a task once the
        client's pool is closed."""
        task, self._task = self._task, None
        self._halt = True
        self.ready = self.active = False
        self._fail_waiters()
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
                self._stopping = task
            elif not task.cancelled():
                task.exception()  # retrieved (the loop logged it)

    async def reap(self, timeout: float = 1.0) -> None:
        """After the client's pool closed: wait for a stop that ``close`` left pending."""
        task, self._stopping = self._stopping, None
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)
        if task is not None and task.done() and not task.cancelled():
            task.exception()  # retrieved: it ended with the connection

    async def caught_up(self, tag: str, seq: int, timeout: float = 2.0) -> None:
        """Until the copy holds the feed through ``seq`` (a write's own), so that this client's next
        lookup sees the write. Returns at once while the copy is down (lookups then use Redis, which
        has the write). A copy stuck for ``timeout`` is reloaded."""
        if not self.active or self.seq.get(tag, 0) >= seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((tag, seq, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            log.warning("redis mirror: feed entry %d of %s unseen after %.1fs; reloading", seq, tag, timeout)
            await self.close()
            self.start()

    def _release(self) -> None:
        if not self._waiters:
            return
        keep = []
        for tag, seq, fut in self._waiters:
            if self.seq.get(tag, 0) >= seq:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((tag, seq, fut))
        self._waiters = keep

    def _fail_waiters(self) -> None:
        """Not ready: nobody waits for the copy (lookups go to Redis)."""
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters = []

    async def _run(self) -> None:
        backoff = 0.05
        while not self._halt:
            failed = False
            try:
                self.active = True  # loading or following: writers wait for their entries
                await self._load()
                backoff = 0.05
                if not self._halt:
                    await self._follow()
            except _FeedGap as e:
                log.warning("redis mirror: %s; reloading", e)
            except Exception as e:  # Redis away: lookups take the Redis path (and report it) meanwhile
                if self.ready or backoff == 0.05:
                    log.info("redis mirror: %s; reloading when Redis answers", e)
                if is_not_primary(e):  # demoted: reconnect (to the primary) rather than read a replica
                    await self._conn.primary_moved()
                failed = True
            finally:
                self.ready = self.active = False
                self._fail_waiters()
            if failed:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # ------------------------------------------------------------------------------- loading

    async def _load(self) -> None:
        self.loads += 1
        inv: dict[str, dict[str, dict[int, bytes]]] = {}
        for tag in self._tags:
            await self._note_feed_end(tag)
            await self._load_names(tag)
            models = await self._copy_inverted(tag)
            if models is None:
                return  # closing: not ready, nothing to keep
            inv[tag] = models
        self.inv = inv
        self._merge_all()
        self.ready = True
        self._release()

    async def _note_feed_end(self, tag: str) -> None:
        """Note the bucket's epoch, turn its feed on, and note its last entry: the replay starts after it.
        A missing epoch (data lost, no client has set the new one yet) fails the load: retried later."""
        r = self._r
        t0 = time.monotonic()
        epoch: Any = await r.get(f"{tag}:epoch")
        if not epoch:
            raise ConnectionError(f"{tag}:epoch is missing (Redis lost its data; not set again yet)")
        self._epoch[tag], self._confirmed[tag] = epoch, t0
        await r.set(f"{tag}:feedon", b"1")
        last: Any = await r.xrevrange(f"{tag}:feed", count=1)
        if last:
            self._last_id[tag] = last[0][0]
            self.seq[tag] = int(last[0][1][b"s"])
        else:
            self._last_id[tag] = b"0-0"
            self.seq[tag] = int(await r.get(f"{tag}:feedseq") or 0)

    async def _copy_inverted(self, tag: str) -> dict[str, dict[int, bytes]] | None:
        """Per model, the bucket's inverted hash (HSCAN); None when ``close`` stopped the copy."""
        r = self._r
        models: dict[str, dict[int, bytes]] = {}
        # (a Cluster scans every shard for a tag's keys: startup and reloads only)
        prefix = f"{tag}:inv:".encode()
        async for key in r.scan_iter(match=_glob_escape(prefix) + b"*", count=1000):
            copy = models[key[len(prefix) :].decode()] = {}
            async for h, v in r.hscan_iter(key, count=10_000):
                copy[int.from_bytes(h, "big")] = v
            if self._halt:
                return None
        return models

    async def _load_names(self, tag: str) -> None:
        """``T:ver`` and ``T:name`` in one atomic read (the lookup path's ``NAMES`` script)."""
        got = await self._conn.eval(lua.NAMES, tag, "-", self._epoch[tag])
        if lua.epoch_changed(got):
            raise _FeedGap(f"the epoch of {tag} changed (Redis lost its data)")
        self.names[tag] = _Names(got[0] or b"", got[1])

    # ------------------------------------------------------------------------------- merging

    def _merge_all(self) -> None:
        """Build ``merged`` and ``merged_names`` from the per-bucket copies (several buckets only)."""
        tags = self._tags
        if not 1 < len(tags) <= 256:  # a record's first byte names its bucket
            self.merged = None
            return
        merged: dict[str, dict[int, bytes]] = {}
        for b, tag in enumerate(tags):  # in bucket order: appending keeps each string sorted
            for model, copy in self.inv[tag].items():
                into = merged.setdefault(model, {})
                for h, v in copy.items():
                    seg = _rebase(b, v)
                    if seg is None:
                        self.merged = None
                        return
                    into[h] = into.get(h, b"") + seg
        self.merged = merged
        self._merge_names()

    def _merge_names(self) -> None:
        names = _Names(b"", [])
        for b, tag in enumerate(self._tags):
            per = self.names.get(tag)
            if per is None:
                continue
            for lid, loc in per.by_id.items():
                if lid >= _LOCAL_IDS:
                    self.merged = None  # ids past 2**24: walk bucket by bucket from now on
                    return
                names.by_id[b << 24 | lid] = loc
            for name, lid in per.by_name.items():
                names.by_name[name] = b << 24 | lid
        self.merged_names = names

    def _merge_one(self, b: int, model: str, h: int, v: bytes | None) -> None:
        """Bucket ``b``'s holder string of block ``h`` is now ``v`` (None: deleted): its segment of
        the merged string is replaced (records are sorted by global id, so a bucket's are contiguous)."""
        merged = self.merged
        assert merged is not None
        seg = _rebase(b, v) if v is not None else b""
        if seg is None:
            self.merged = None
            return
        into = merged.setdefault(model, {})
        old = into.get(h)
        if old:
            firsts = old[0::5]
            old = old[: 5 * bisect.bisect_left(firsts, b)] + seg + old[5 * bisect.bisect_right(firsts, b) :]
        else:
            old = seg
        if old:
            into[h] = old
        else:
            into.pop(h, None)

    # ------------------------------------------------------------------------------- following

    async def _follow(self) -> None:
        """One reader per bucket (on a Cluster the buckets' feeds live on different shards, and one
        XREAD reads one shard). The first to fail stops the others, by a flag they see when their
        XREAD returns (not by cancelling a read in flight), and the copy reloads."""
        self._halt_readers = False
        readers = [
            asyncio.get_running_loop().create_task(self._follow_one(tag), name=f"redis-mirror-{tag}")
            for tag in self._tags
        ]
        try:
            await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            self._halt_readers = True
            await asyncio.wait(readers, timeout=2 * _FEED_BLOCK / 1000 + 1)
            for t in readers:
                if not t.done():
                    t.cancel()
        failed = [e for t in readers if t.done() and not t.cancelled() and (e := t.exception()) is not None]
        if failed:  # (every reader's exception retrieved: several fail at once when Redis lost its data)
            raise failed[0]

    async def _follow_one(self, tag: str) -> None:
        try:
            await self._follow_feed(tag)
        except BaseException:
            self.ready = False  # at once: the other readers stop only after their current XREAD
            self._halt_readers = True
            raise

    async def _follow_feed(self, tag: str) -> None:
        r = self._r
        feed = f"{tag}:feed"
        while not (self._halt or self._halt_readers):
            sent = time.monotonic()
            got: Any = await r.xread({feed: self._last_id[tag]}, count=_FEED_COUNT, block=_FEED_BLOCK) or []
            n = 0
            for _, entries in got:
                for entry_id, fields in entries:
                    await self._apply(tag, entry_id, fields)
                n += len(entries)
            self._release()
            if n < _FEED_COUNT:  # (a full batch: more entries wait, the copy is behind)
                await self._confirm(tag, sent)
            # Idle: a Redis that lost its data (FLUSHALL, a restart we did not see) lost T:feedon too,
            # and its writers no longer feed: reload rather than serve the old copy.
            if not got and not await r.exists(f"{tag}:feedon"):
                raise _FeedGap(f"{tag}:feedon is gone (Redis lost its data)")

    async def _apply(self, tag: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        seq = int(fields[b"s"])
        if seq != self.seq[tag] + 1:
            raise _FeedGap(f"feed of {tag} jumped from entry {self.seq[tag]} to {seq}")
        models = self.inv[tag]
        bucket = self._bucket_of_tag[tag]
        for f, blob in fields.items():
            if f[:1] != b"i":
                continue
            model = f[1:].decode()
            copy = models.get(model)
            if copy is None:
                copy = models[model] = {}
            self._apply_records(bucket, model, copy, blob)
        if b"n" in fields:
            await self._load_names(tag)
            if self.merged is not None:
                self._merge_names()
        self.seq[tag] = seq
        self._last_id[tag] = entry_id
        self.entries_applied += 1

    def _apply_records(self, bucket: int, model: str, copy: dict[int, bytes], blob: bytes) -> None:
        """One feed field's records (8-byte hash, u32 length, holder string; length 0 deletes)."""
        rec = _FEED_REC
        p, n = 0, len(blob)
        while p < n:
            h, ln = rec.unpack_from(blob, p)
            p += 12
            v = blob[p : p + ln] if ln else None
            p += ln
            if v is not None:
                copy[h] = v
            else:
                copy.pop(h, None)
            if self.merged is not None:
                self._merge_one(bucket, model, h, v)

    # ------------------------------------------------------------------------------- lookups

    def match(
        self, model: str, hashes: Sequence[BlockHash64], want: dict[int, set[bytes]] | None
    ) -> list[NodeMatch]:
        """``RedisIndex.match`` on the copy (``want``: candidate location names per bucket)."""
        self.lookups += 1
        out: list[NodeMatch] = []
        tags = self._tags
        buckets: Iterable[int] = sorted(want) if want is not None else range(len(tags))
        merged = self.merged
        if merged is not None:  # every bucket in one walk
            allowed_all = None
            if want is not None:
                by_name = self.merged_names.by_name
                allowed_all = {i for b in buckets for n in want[b] if (i := by_name.get(n)) is not None}
                if not allowed_all:
                    return out
            copy = merged.get(model)
            if copy:
                out.extend(self._walk(copy, hashes, self.merged_names, allowed_all))
            buckets = ()
        for b in buckets:
            tag = tags[b]
            copy = self.inv[tag].get(model)
            names = self.names.get(tag)
            if not copy or names is None:
                continue
            allowed = None
            if want is not None:
                allowed = {i for n in want[b] if (i := names.by_name.get(n)) is not None}
                if not allowed:
                    continue
            out.extend(self._walk(copy, hashes, names, allowed))
        out.sort(key=_BY_NODE)  # stable sorts: most blocks first, then by (node_id, dp_rank)
        out.sort(key=_BY_BLOCKS, reverse=True)
        return out

    @staticmethod
    def _walk(
        copy: dict[int, bytes], hashes: Sequence[BlockHash64], names: _Names, allowed: set[int] | None
    ) -> list[NodeMatch]:
        walk = _mirror_walk
        found = walk(copy, hashes, names.by_id, allowed, NodeMatch) if walk is not None else None
        if found is None:  # no C walk, or input it leaves to Python: the same errors, the same walk
            try:
                _pack(hashes)
            except struct.error as e:
                raise ValueError(f"query hashes must be uint64 ints: {e}") from e
            found = _walk_runs(_holder_runs(copy, hashes), names, allowed)
        return found
