"""The Redis backend: one index shared by coordinator replicas, on Redis or a Redis Cluster.

Keyspace and slot placement
---------------------------
Nodes are spread over ``B`` *buckets* by ``crc32(node_id) % B``; every key of a bucket carries the hash
tag ``{<prefix>:<b>}``, so a bucket lives on one Cluster slot and therefore one shard, and every Lua
script touches one bucket only. A bucket holds whole nodes (all their models and DP ranks). In a bucket:

========================  =====  ====================================================================
``T:loc``                 hash   location name ``<len(model)>:<model><rank>:<node>`` -> live location id
``T:name``                hash   live location id -> location name (a reader sees only these ids)
``T:pend``                hash   location id being filled by ``replace_node``, not yet visible
``T:next``                str    location id counter (an id is never reused: ids are generations)
``T:node:<node>``         set    the node's location ids (live and pending): ``remove_node`` reads only it
``T:inv:<model>``         hash   block hash (8 bytes, big-endian) -> holders, sorted 5-byte records
                                 ``(location id u32, tier mask u8)``: the inverted index a lookup walks
``T:fwd:<id>``            hash   block hash -> tier mask: one location's blocks (clear, export, reclaim)
``T:cnt``                 hash   ``<id>:<tier>`` -> entries, so ``stats`` never counts entries one by one
``T:dead`` / ``T:cur``    list   retired location ids waiting for reclaim, and their HSCAN cursors
========================  =====  ====================================================================

A lookup runs one read-only script per bucket that walks the query's hashes through ``T:inv:<model>``,
keeping the set of locations still in the run, and stops at the first block no live candidate holds.
Consecutive blocks held by the same locations have byte-identical holder strings (records are sorted),
and Lua interns strings, so a long shared prefix costs one HGET and one pointer compare per block; the
holder list is decoded only where it changes. With plain Redis there is one bucket by default
(``?buckets=1``): one round trip per lookup. On a Cluster the default is 16 buckets, and a lookup sends
one script per bucket in one pipeline, which redis-py splits per shard and sends to the shards in
parallel: one round trip per shard, each shard walking only its own nodes. A single hash tag per
model would put a whole model on one shard and defeat scale-out; a tag per node would need one script
per node per lookup. Buckets are the middle ground; ``B`` should be at least a few times the shard
count, and is fixed for a keyspace (stored in ``{<prefix>}:conf``; a mismatching client is refused).

Clear and node removal retire location ids: they drop the id from ``T:loc``/``T:name`` (readers stop
seeing it at once, O(locations of the node), never a keyspace scan) and queue it on ``T:dead``. A
background task reclaims a dead id's entries in chunks by HSCAN over its own ``T:fwd:<id>`` only. A
re-added node gets fresh ids, so old entries never resurrect. ``replace_node`` fills a pending id that
readers cannot see, then swaps it in with one script.

Entries are only ever lost if Redis loses them: run Redis with ``maxmemory-policy noeviction`` (an
evicted ``T:inv`` field would silently hide a block that a node still holds; with ``noeviction`` a
full Redis rejects writes, the coordinator sees the error, keeps the agents' batches unacked and
reports NOT_SERVING). Location ids are 32-bit in holder records.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import struct
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier, normalize_medium
from kvcoord.hashing import UINT64_MASK, BlockHash64, to_block_hash64
from kvcoord.index.base import (
    ApplyResult,
    IndexStats,
    InvalidEvent,
    NodeKey,
    NodeMatch,
    SnapshotEntry,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_NTIERS = len(Tier)
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of the round-trip latency histogram in :class:`RedisMetrics`."""


class IndexUnavailable(ConnectionError):
    """Redis could not be reached (or timed out). Nothing is known to be applied; retry later."""


@dataclass(slots=True)
class RedisMetrics:
    """Plain counters the coordinator exports (it owns Prometheus; this module does not import it)."""

    round_trips: int = 0
    """Completed Redis round trips (a pipeline over several shards counts once)."""
    round_trip_seconds: float = 0.0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    """Round trips per ``LATENCY_BUCKETS`` bound (non-cumulative; the last slot is +Inf)."""
    errors: int = 0
    """Failed round trips (connection errors, timeouts, server errors)."""
    connection_errors: int = 0
    reconnects: int = 0
    """Times a round trip succeeded after Redis had been unreachable."""
    reclaimed_entries: int = 0
    up: bool = True

    def observe(self, seconds: float) -> None:
        self.round_trips += 1
        self.round_trip_seconds += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_counts[i] += 1
                return
        self.latency_counts[-1] += 1


# ---------------------------------------------------------------------------------------------- Lua

_LUA_COMMON = r"""
local tag = ARGV[1]
local function model_of(lf)
  local c = string.find(lf, ':', 1, true)
  local n = tonumber(string.sub(lf, 1, c - 1))
  return string.sub(lf, c + 1, c + n)
end
-- holder records: 5 bytes each (location id u32 BE, tier mask u8), sorted by id; mask 0 deletes
local function holders_set(s, id, m)
  local rec = struct.pack('>I4B', id, m)
  if not s then
    if m == 0 then return nil end
    return rec
  end
  for p = 1, #s, 5 do
    local rid = struct.unpack('>I4', s, p)
    if rid == id then
      if m == 0 then
        if #s == 5 then return nil end
        return string.sub(s, 1, p - 1) .. string.sub(s, p + 5)
      end
      return string.sub(s, 1, p - 1) .. rec .. string.sub(s, p + 5)
    elseif rid > id then
      if m == 0 then return s end
      return string.sub(s, 1, p - 1) .. rec .. string.sub(s, p)
    end
  end
  if m == 0 then return s end
  return s .. rec
end
local function put_holders(inv, h, s)
  if s then redis.call('HSET', inv, h, s) else redis.call('HDEL', inv, h) end
end
-- retire a location id: invisible to readers at once, entries reclaimed later from T:dead
local function retire(id, lf, node)
  id = tostring(id)
  redis.call('HDEL', tag .. ':name', id)
  redis.call('HDEL', tag .. ':pend', id)
  if redis.call('HGET', tag .. ':loc', lf) == id then redis.call('HDEL', tag .. ':loc', lf) end
  local c = redis.call('HMGET', tag .. ':cnt', id .. ':0', id .. ':1', id .. ':2')
  redis.call('HDEL', tag .. ':cnt', id .. ':0', id .. ':1', id .. ':2')
  redis.call('SREM', tag .. ':node:' .. node, id)
  redis.call('RPUSH', tag .. ':dead', id .. ':' .. lf)
  return (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
end
"""

# ARGV: tag, location name, node, mode ('A' apply to the live location, or a pending id to fill),
# then (op, blob) pairs: 'S<tier>' store, 'R<tier>' or 'R<tier>:<group>' remove (blob = packed 8-byte
# hashes), 'G<group>' remember a non-indexable group of this location, 'C' AllBlocksCleared.
_LUA_WRITE = _LUA_COMMON + r"""
local lf, node, mode = ARGV[2], ARGV[3], ARGV[4]
local inv = tag .. ':inv:' .. model_of(lf)
local skipkey = tag .. ':skip:' .. node
local id, fwd
if mode == 'A' then
  id = redis.call('HGET', tag .. ':loc', lf)
else
  id = mode
  if redis.call('HEXISTS', tag .. ':pend', id) == 0 then
    return redis.error_reply('ABORTED pending location gone')
  end
end
if id then id = tonumber(id); fwd = tag .. ':fwd:' .. id end
local new, dup, removed, unknown, cleared, skipped = 0, 0, 0, 0, 0, 0
local dcnt = {0, 0, 0}
local skip = nil
local function flush()
  if not id then return end
  for t = 1, 3 do
    if dcnt[t] ~= 0 then redis.call('HINCRBY', tag .. ':cnt', id .. ':' .. (t - 1), dcnt[t]); dcnt[t] = 0 end
  end
end
for a = 5, #ARGV, 2 do
  local op, blob = ARGV[a], ARGV[a + 1]
  local kind = string.sub(op, 1, 1)
  if kind == 'C' then
    if id then flush(); cleared = cleared + retire(id, lf, node); id = nil; fwd = nil end
  elseif kind == 'G' then
    if skip == nil then skip = redis.call('HGET', skipkey, lf) or ',' end
    local g = string.sub(op, 2) .. ','
    if not string.find(skip, ',' .. g, 1, true) then
      skip = skip .. g
      redis.call('HSET', skipkey, lf, skip)
    end
  elseif kind == 'S' then
    local t = tonumber(string.sub(op, 2)); local b = 2 ^ t
    if not id and #blob > 0 then
      id = redis.call('INCR', tag .. ':next')
      redis.call('HSET', tag .. ':loc', lf, id)
      redis.call('HSET', tag .. ':name', id, lf)
      redis.call('SADD', tag .. ':node:' .. node, id)
      fwd = tag .. ':fwd:' .. id
    end
    for p = 1, #blob, 8 do
      local h = string.sub(blob, p, p + 7)
      local v = redis.call('HGET', fwd, h)
      local m = v and string.byte(v) or 0
      if bit.band(m, b) ~= 0 then
        dup = dup + 1
      else
        m = m + b
        redis.call('HSET', fwd, h, string.char(m))
        put_holders(inv, h, holders_set(redis.call('HGET', inv, h) or nil, id, m))
        new = new + 1; dcnt[t + 1] = dcnt[t + 1] + 1
      end
    end
  else
    local t = tonumber(string.sub(op, 2, 2)); local b = 2 ^ t
    local skipped_here = false
    if #op > 2 then
      if skip == nil then skip = redis.call('HGET', skipkey, lf) or ',' end
      skipped_here = string.find(skip, ',' .. string.sub(op, 4) .. ',', 1, true) ~= nil
    end
    if skipped_here then
      skipped = skipped + #blob / 8
    else
      for p = 1, #blob, 8 do
        local h = string.sub(blob, p, p + 7)
        local v = id and redis.call('HGET', fwd, h)
        local m = v and string.byte(v) or 0
        if bit.band(m, b) == 0 then
          unknown = unknown + 1
        else
          m = m - b
          if m == 0 then redis.call('HDEL', fwd, h) else redis.call('HSET', fwd, h, string.char(m)) end
          put_holders(inv, h, holders_set(redis.call('HGET', inv, h) or nil, id, m))
          removed = removed + 1; dcnt[t + 1] = dcnt[t + 1] - 1
        end
      end
    end
  end
end
flush()
return {new, dup, removed, unknown, cleared, skipped}
"""

# ARGV: tag, location name, node. Starts a pending (invisible) location for replace_node.
_LUA_BEGIN = _LUA_COMMON + r"""
local id = redis.call('INCR', tag .. ':next')
redis.call('HSET', tag .. ':pend', id, ARGV[2])
redis.call('SADD', tag .. ':node:' .. ARGV[3], id)
return id
"""

# ARGV: tag, location name, node, pending id. Swaps the pending location in, retiring the old one.
_LUA_COMMIT = _LUA_COMMON + r"""
local lf, node, id = ARGV[2], ARGV[3], ARGV[4]
if redis.call('HEXISTS', tag .. ':pend', id) == 0 then return 0 end
local old = redis.call('HGET', tag .. ':loc', lf)
if old then retire(old, lf, node) end
redis.call('HDEL', tag .. ':pend', id)
redis.call('HSET', tag .. ':loc', lf, id)
redis.call('HSET', tag .. ':name', id, lf)
return 1
"""

# ARGV: tag, location name, node. AllBlocksCleared for one location: returns the entries it dropped.
_LUA_CLEAR = _LUA_COMMON + r"""
local id = redis.call('HGET', tag .. ':loc', ARGV[2])
if not id then return 0 end
return retire(id, ARGV[2], ARGV[3])
"""

# ARGV: tag, node. Retires every location (all models, ranks, pending fills) of one node.
_LUA_REMOVE_NODE = _LUA_COMMON + r"""
local key = tag .. ':node:' .. ARGV[2]
local ids = redis.call('SMEMBERS', key)
for i = 1, #ids do
  local lf = redis.call('HGET', tag .. ':name', ids[i]) or redis.call('HGET', tag .. ':pend', ids[i])
  if lf then retire(ids[i], lf, ARGV[2]) end
end
redis.call('DEL', key)
redis.call('DEL', tag .. ':skip:' .. ARGV[2])
return #ids
"""

# ARGV: tag, count. Reclaims up to ~count entries of the oldest retired location; returns {done, left}.
_LUA_RECLAIM = _LUA_COMMON + r"""
local dead = tag .. ':dead'
local item = redis.call('LINDEX', dead, 0)
if not item then return {0, 0} end
local c = string.find(item, ':', 1, true)
local id = string.sub(item, 1, c - 1)
local inv = tag .. ':inv:' .. model_of(string.sub(item, c + 1))
local fwd = tag .. ':fwd:' .. id
local nid = tonumber(id)
local cur = redis.call('HGET', tag .. ':cur', id) or '0'
local r = redis.call('HSCAN', fwd, cur, 'COUNT', ARGV[2])
local kv = r[2]
for i = 1, #kv, 2 do
  local h = kv[i]
  put_holders(inv, h, holders_set(redis.call('HGET', inv, h) or nil, nid, 0))
  redis.call('HDEL', fwd, h)
end
if r[1] == '0' then
  redis.call('DEL', fwd)
  redis.call('HDEL', tag .. ':cur', id)
  redis.call('LPOP', dead)
else
  redis.call('HSET', tag .. ':cur', id, r[1])
end
return {#kv / 2, redis.call('LLEN', dead)}
"""

# ARGV: tag, model, packed query hashes, '1' if restricted to candidates, then candidate location names.
# Returns a flat list: location name, run length, GPU, CPU, STORAGE blocks of the run, ... (each block
# counted once, in its fastest tier, as the memory backend does).
_LUA_LOOKUP = (
    "#!lua flags=no-writes\n"
    + r"""
local tag, model, blob = ARGV[1], ARGV[2], ARGV[3]
local inv = tag .. ':inv:' .. model
local names = tag .. ':name'
local allowed = nil
if ARGV[4] == '1' then
  allowed = {}
  local any = false
  for a = 5, #ARGV do
    local id = redis.call('HGET', tag .. ':loc', ARGV[a])
    if id then allowed[tonumber(id)] = true; any = true end
  end
  if not any then return {} end
end
local live, run, tiers = {}, {}, {}
local cur, prev, seg = nil, nil, 0
local function flush()
  if seg == 0 then return end
  for id, m in pairs(cur) do
    run[id] = run[id] + seg
    local t = tiers[id]
    if m % 2 == 1 then t[1] = t[1] + seg elseif m % 4 >= 2 then t[2] = t[2] + seg else t[3] = t[3] + seg end
  end
  seg = 0
end
for i = 1, #blob / 8 do
  local v = redis.call('HGET', inv, string.sub(blob, i * 8 - 7, i * 8))
  if not v then break end
  if v ~= prev then
    flush()
    local nxt, any = {}, false
    for p = 1, #v, 5 do
      local id, m = struct.unpack('>I4B', v, p)
      if (i == 1 or cur[id]) and (allowed == nil or allowed[id]) then
        local nm = live[id]
        if nm == nil then nm = redis.call('HGET', names, id); live[id] = nm end
        if nm then
          nxt[id] = m; any = true
          if i == 1 then run[id] = 0; tiers[id] = {0, 0, 0} end
        end
      end
    end
    if not any then break end
    cur, prev = nxt, v
  end
  seg = seg + 1
end
flush()
local out = {}
for id, r in pairs(run) do
  if r > 0 then
    local t = tiers[id]
    out[#out + 1] = live[id]; out[#out + 1] = r
    out[#out + 1] = t[1]; out[#out + 1] = t[2]; out[#out + 1] = t[3]
  end
end
return out
"""
)

# ARGV: tag. Live locations with per-tier entry counts, models' block counts, and the bucket's bytes.
_LUA_STATS = (
    "#!lua flags=no-writes\n"
    + _LUA_COMMON
    + r"""
local names = redis.call('HGETALL', tag .. ':name')
local out, models, bytes = {}, {}, 0
local function mem(k)
  bytes = bytes + (redis.call('MEMORY', 'USAGE', k) or 0)
end
for i = 1, #names, 2 do
  local id, lf = names[i], names[i + 1]
  local c = redis.call('HMGET', tag .. ':cnt', id .. ':0', id .. ':1', id .. ':2')
  out[#out + 1] = lf
  for t = 1, 3 do out[#out + 1] = tonumber(c[t]) or 0 end
  models[model_of(lf)] = true
  mem(tag .. ':fwd:' .. id)
end
for _, k in ipairs({'loc', 'name', 'pend', 'next', 'cnt', 'dead', 'cur'}) do mem(tag .. ':' .. k) end
local mb = {}
for m, _ in pairs(models) do
  mb[#mb + 1] = m; mb[#mb + 1] = redis.call('HLEN', tag .. ':inv:' .. m)
  mem(tag .. ':inv:' .. m)
end
return {out, mb, bytes}
"""
)


class _Script:
    """A Lua script run by EVALSHA, falling back to EVAL (which caches it) after a Redis restart."""

    __slots__ = ("sha", "src")

    def __init__(self, src: str) -> None:
        self.src = src
        self.sha = hashlib.sha1(src.encode()).hexdigest()


_WRITE = _Script(_LUA_WRITE)
_BEGIN = _Script(_LUA_BEGIN)
_COMMIT = _Script(_LUA_COMMIT)
_CLEAR = _Script(_LUA_CLEAR)
_REMOVE_NODE = _Script(_LUA_REMOVE_NODE)
_RECLAIM = _Script(_LUA_RECLAIM)
_LOOKUP = _Script(_LUA_LOOKUP)
_STATS = _Script(_LUA_STATS)

_OP_CLEAR = ("C", b"")
_TIER_BITS = tuple((t, 1 << t) for t in Tier)
_REPLACE_CHUNK = 20_000
"""Entries per script call when filling a replacement (bounds how long one script blocks Redis)."""
_RECLAIM_CHUNK = 1_000
_DEFAULT_CLUSTER_BUCKETS = 16


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


def _hashes64(raw: object, what: str) -> list[int]:
    """Validate and reduce an event's hashes (the memory backend's rules); in-range ints take a fast path."""
    if not isinstance(raw, tuple | list):
        raise InvalidEvent(f"{what}: block_hashes must be a list, not {type(raw).__name__}")
    if all(type(h) is int and 0 <= h <= UINT64_MASK for h in raw):
        return list(raw)
    out: list[int] = []
    for i, h in enumerate(raw):
        if isinstance(h, bytes | bytearray | memoryview) and len(h) == 0:
            raise InvalidEvent(f"{what}: block_hashes[{i}] is an empty digest")
        try:
            out.append(to_block_hash64(h))
        except (TypeError, ValueError) as e:
            raise InvalidEvent(f"{what}: block_hashes[{i}]: {e}") from None
    return out


def _tier(medium: object, what: str) -> Tier:
    if medium is not None and not isinstance(medium, str):
        raise InvalidEvent(f"{what}: medium must be a string, not {type(medium).__name__}")
    try:
        return normalize_medium(medium)
    except ValueError as e:
        raise InvalidEvent(f"{what}: {e}") from None


def _group(group_idx: object, what: str) -> int | None:
    if group_idx is None:
        return None
    if isinstance(group_idx, bool) or not isinstance(group_idx, int) or group_idx < 0:
        raise InvalidEvent(f"{what}: group_idx must be a non-negative int, not {group_idx!r}")
    return group_idx


def _loc_name(model: str, node_id: str, dp_rank: int) -> str:
    return f"{len(model.encode())}:{model}{dp_rank}:{node_id}"


def _parse_loc_name(raw: bytes) -> tuple[str, str, int]:
    """``(model, node_id, dp_rank)`` from a location name."""
    c = raw.index(b":")
    n = int(raw[:c])
    model = raw[c + 1 : c + 1 + n].decode()
    rest = raw[c + 1 + n :]
    r = rest.index(b":")
    return model, rest[r + 1 :].decode(), int(rest[:r])


def _check_location(model: object, node_id: object, dp_rank: object) -> None:
    if not isinstance(model, str):
        raise InvalidEvent(f"model must be a string, not {type(model).__name__}")
    if not isinstance(node_id, str) or not node_id:
        raise InvalidEvent(f"node_id must be a non-empty string, not {node_id!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise InvalidEvent(f"dp_rank must be a non-negative int, not {dp_rank!r}")


def compile_events(events: Sequence[KVEvent]) -> tuple[list[tuple[str, bytes]], int]:
    """Validate a whole batch and turn it into write-script ops; returns ``(ops, skipped_store_blocks)``.

    Raises ``InvalidEvent`` before anything is sent, so a bad event never half-applies a batch. Group
    rules are the memory backend's: a non-full-attention store is counted and skipped, and its
    ``group_idx`` is remembered for the location so that the group's later removals are skipped too.
    """
    if not isinstance(events, Sequence) or isinstance(events, str | bytes):
        raise InvalidEvent(f"events must be a sequence, not {type(events).__name__}")
    ops: list[tuple[str, bytes]] = []
    skipped = 0
    for i, ev in enumerate(events):
        what = f"event {i}"
        if isinstance(ev, BlockStored):
            kind = ev.kv_cache_spec_kind
            if kind is not None and not isinstance(kind, str):
                raise InvalidEvent(f"{what}: kv_cache_spec_kind must be a string")
            tier = _tier(ev.medium, what)
            hashes = _hashes64(ev.block_hashes, what)
            group = _group(ev.group_idx, what)
            if not ev.is_prefix_indexable():
                skipped += len(hashes)
                if group is not None:
                    ops.append((f"G{group}", b""))
            elif hashes:
                ops.append((f"S{tier.value}", _pack(hashes)))
        elif isinstance(ev, BlockRemoved):
            tier = _tier(ev.medium, what)
            hashes = _hashes64(ev.block_hashes, what)
            group = _group(ev.group_idx, what)
            if hashes:
                op = f"R{tier.value}" if group is None else f"R{tier.value}:{group}"
                ops.append((op, _pack(hashes)))
        elif isinstance(ev, AllBlocksCleared):
            ops.append(_OP_CLEAR)
        else:
            raise InvalidEvent(f"{what}: not a KV event: {type(ev).__name__}")
    return ops, skipped


def _snapshot_per_tier(entries: Iterable[SnapshotEntry]) -> list[list[int]]:
    """Validate snapshot entries (the memory backend's rules) and group their hashes by tier."""
    per_tier: list[list[int]] = [[] for _ in Tier]
    try:
        items = list(entries)
    except TypeError as e:
        raise InvalidEvent(f"snapshot entries must be iterable: {e}") from None
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidEvent(f"snapshot entry {i} must be (hash, tier), not {item!r}")
        h, t = item
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _NTIERS:
            raise InvalidEvent(f"snapshot entry {i}: tier must be a Tier, not {t!r}")
        per_tier[t].extend(_hashes64((h,), f"snapshot entry {i}"))
    return per_tier


def _is_connection_error(e: BaseException) -> bool:
    return isinstance(
        e, rexc.ConnectionError | rexc.TimeoutError | rexc.ClusterDownError | OSError | asyncio.TimeoutError
    ) or (isinstance(e, rexc.RedisClusterException) and "connect" in str(e).lower())


class RedisIndex:
    """The :class:`~kvcoord.index.base.Index` protocol on Redis (``backend='redis'``) or Redis Cluster."""

    def __init__(
        self,
        client: aredis.Redis | RedisCluster,
        *,
        key_prefix: str = "kvcoord",
        buckets: int | None = None,
        reclaim_interval: float = 5.0,
    ) -> None:
        self._r = client
        self._cluster = isinstance(client, RedisCluster)
        self.backend = "redis-cluster" if self._cluster else "redis"
        self.key_prefix = key_prefix
        self.buckets = buckets if buckets is not None else (_DEFAULT_CLUSTER_BUCKETS if self._cluster else 1)
        if self.buckets < 1:
            raise ValueError("buckets must be >= 1")
        self._tags = [f"{{{key_prefix}:{b}}}" for b in range(self.buckets)]
        self._conf_key = f"{{{key_prefix}}}:conf"
        self.metrics = RedisMetrics()
        self._layout_checked = False
        self._reclaim_interval = reclaim_interval
        self._reclaim_wake = asyncio.Event()
        self._reclaim_task: asyncio.Task[None] | None = None
        self._closed = False
        self._retired_gen = 0
        self._reclaimed_gen = 0
        """Retirements this client made, and how many of them a finished reclaim pass has covered."""

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    def from_uri(cls, uri: str, *, key_prefix: str = "kvcoord") -> RedisIndex:
        """``redis://host:port/db`` (also ``rediss://``, ``unix://``) or ``redis+cluster://h:p,h:p``.

        Query parameters read here: ``buckets`` (see the module docstring), ``timeout`` (socket
        timeout in seconds, default 5), ``prefix`` (overrides ``key_prefix``). Does not connect.
        """
        parts = urlsplit(uri)
        query = dict(parse_qsl(parts.query))
        buckets = int(query.pop("buckets")) if "buckets" in query else None
        timeout = float(query.pop("timeout", "5"))
        key_prefix = query.pop("prefix", key_prefix)
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": min(timeout, 2.0),
            "decode_responses": False,
        }
        if parts.scheme == "redis+cluster":
            nodes: list[ClusterNode] = []
            for hp in parts.netloc.rsplit("@", 1)[-1].split(","):
                host, _, port = hp.strip().rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"bad cluster node {hp!r} in {uri!r}: want host:port")
                nodes.append(ClusterNode(host.strip("[]"), int(port)))
            if not nodes:
                raise ValueError(f"no cluster nodes in {uri!r}")
            if query:
                raise ValueError(f"unknown redis+cluster option(s) {sorted(query)} in {uri!r}")
            client: aredis.Redis | RedisCluster = RedisCluster(
                startup_nodes=nodes, username=parts.username, password=parts.password, **common
            )
        else:
            rest = urlunsplit(parts._replace(query=urlencode(query)))
            client = aredis.Redis.from_url(rest, **common)
        return cls(client, key_prefix=key_prefix, buckets=buckets)

    def bucket_of(self, node_id: str) -> int:
        """The bucket (hence hash tag, slot and shard) holding every key of ``node_id``."""
        return zlib.crc32(node_id.encode()) % self.buckets

    def tag_of(self, node_id: str) -> str:
        return self._tags[self.bucket_of(node_id)]

    # ---------------------------------------------------------------------------------- round trips

    async def _rt(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """One timed round trip; connection failures become :class:`IndexUnavailable`."""
        t0 = time.perf_counter()
        try:
            res = await fn()
        except Exception as e:
            self.metrics.errors += 1
            if _is_connection_error(e):
                self.metrics.connection_errors += 1
                self.metrics.up = False
                raise IndexUnavailable(f"redis unavailable: {e}") from e
            raise
        self.metrics.observe(time.perf_counter() - t0)
        if not self.metrics.up:
            self.metrics.up = True
            self.metrics.reconnects += 1
        return res

    async def _eval(self, script: _Script, tag: str, *args: object) -> Any:
        """Run ``script`` on the bucket ``tag`` (its ``:loc`` key routes it on a Cluster)."""
        key = tag + ":loc"

        async def go() -> Any:
            try:
                return await self._r.evalsha(script.sha, 1, key, tag, *args)  # type: ignore[arg-type]
            except rexc.NoScriptError:
                return await self._r.eval(script.src, 1, key, tag, *args)  # type: ignore[arg-type]

        return await self._rt(go)

    async def _eval_many(self, script: _Script, calls: list[tuple[str, list[object]]]) -> list[Any]:
        """Run ``script`` on several buckets in one pipeline (per shard, in parallel, on a Cluster)."""
        if len(calls) == 1:
            tag, args = calls[0]
            return [await self._eval(script, tag, *args)]

        async def go() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            for tag, args in calls:
                # execute_command: redis-py's cluster pipeline refuses the evalsha() method by name, but
                # routes EVALSHA by its key like any single-slot command.
                pipe.execute_command("EVALSHA", script.sha, 1, tag + ":loc", tag, *args)  # type: ignore[arg-type]
            res: list[Any] = await pipe.execute(raise_on_error=False)
            for i, r in enumerate(res):
                if isinstance(r, rexc.NoScriptError):
                    tag, args = calls[i]
                    res[i] = await self._r.eval(script.src, 1, tag + ":loc", tag, *args)  # type: ignore[arg-type]
                elif isinstance(r, Exception):
                    raise r
            return res

        return await self._rt(go)

    async def _check_layout(self) -> None:
        """Refuse to share a keyspace with a client that spreads nodes over a different bucket count."""
        if self._layout_checked:
            return

        async def go() -> Any:
            await self._r.set(self._conf_key, str(self.buckets), nx=True)
            return await self._r.get(self._conf_key)

        stored = await self._rt(go)
        if stored is not None and int(stored) != self.buckets:
            raise ValueError(
                f"the Redis keyspace {self.key_prefix!r} uses {int(stored)} buckets, "
                f"this client {self.buckets}"
            )
        self._layout_checked = True

    # ---------------------------------------------------------------------------------- the protocol

    async def apply(self, model: str, node_id: str, dp_rank: int, events: Sequence[KVEvent]) -> ApplyResult:
        _check_location(model, node_id, dp_rank)
        ops, skipped = compile_events(events)
        result = ApplyResult(skipped_group=skipped)
        if not ops:
            return result
        await self._check_layout()
        args: list[object] = [_loc_name(model, node_id, dp_rank), node_id, "A"]
        for op, blob in ops:
            args.append(op)
            args.append(blob)
        new, _dup, removed, unknown, cleared, skipped_removals = await self._eval(
            _WRITE, self.tag_of(node_id), *args
        )
        result.stored = int(new)
        result.skipped_group += int(skipped_removals)
        result.removed = int(removed)
        result.removed_unknown = int(unknown)
        result.cleared = int(cleared)
        if cleared:
            self._wake_reclaimer()
        return result

    async def match(
        self,
        model: str,
        hashes: Sequence[BlockHash64],
        candidates: Collection[NodeKey] | None = None,
    ) -> list[NodeMatch]:
        if not hashes:
            return []
        try:
            blob = _pack(hashes)
        except struct.error as e:
            raise ValueError(f"query hashes must be uint64 ints: {e}") from e
        calls: list[tuple[str, list[object]]]
        if candidates is None:
            calls = [(tag, [model, blob, "0"]) for tag in self._tags]
        else:
            per: dict[int, list[object]] = {}
            for node_id, rank in candidates:
                per.setdefault(self.bucket_of(node_id), [model, blob, "1"]).append(
                    _loc_name(model, node_id, rank)
                )
            if not per:
                return []
            calls = [(self._tags[b], a) for b, a in per.items()]
        out: list[NodeMatch] = []
        for flat in await self._eval_many(_LOOKUP, calls):
            for i in range(0, len(flat), 5):
                _, node_id, rank = _parse_loc_name(flat[i])
                tiers = (int(flat[i + 2]), int(flat[i + 3]), int(flat[i + 4]))
                out.append(NodeMatch(node_id, rank, int(flat[i + 1]), tiers))
        out.sort(key=lambda m: (-m.matched_blocks, m.node_id, m.dp_rank))
        return out

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        _check_location(model, node_id, dp_rank)
        if await self._eval(_CLEAR, self.tag_of(node_id), _loc_name(model, node_id, dp_rank), node_id):
            self._wake_reclaimer()

    async def remove_node(self, node_id: str) -> None:
        if await self._eval(_REMOVE_NODE, self.tag_of(node_id), node_id):
            self._wake_reclaimer()

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        _check_location(model, node_id, dp_rank)
        tag = self.tag_of(node_id)
        loc_id = await self._rt(lambda: self._r.hget(tag + ":loc", _loc_name(model, node_id, dp_rank)))
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

        entries = await self._rt(scan)
        entries.sort()
        return entries

    async def replace_node(
        self, model: str, node_id: str, dp_rank: int, entries: Iterable[SnapshotEntry]
    ) -> None:
        _check_location(model, node_id, dp_rank)
        per_tier = _snapshot_per_tier(entries)
        await self._check_layout()
        tag = self.tag_of(node_id)
        lf = _loc_name(model, node_id, dp_rank)
        pending = int(await self._eval(_BEGIN, tag, lf, node_id))
        try:
            for t, hs in enumerate(per_tier):
                for s in range(0, len(hs), _REPLACE_CHUNK):
                    blob = _pack(hs[s : s + _REPLACE_CHUNK])
                    await self._eval(_WRITE, tag, lf, node_id, str(pending), f"S{t}", blob)
            committed = await self._eval(_COMMIT, tag, lf, node_id, str(pending))
        except rexc.ResponseError as e:
            if "ABORTED" not in str(e):
                raise
            committed = 0  # the node was removed while we filled: its pending entries are being reclaimed
        except BaseException:
            with contextlib.suppress(Exception):
                await self._eval(_REMOVE_PENDING_BY_NODE, tag, lf, node_id, str(pending))
            raise
        self._wake_reclaimer()
        if not committed:
            log.info("replace_node %s/%s/%d lost to a concurrent remove_node", model, node_id, dp_rank)

    async def stats(self) -> IndexStats:
        """Exact for this client's retirements (it reclaims them first); others' are reclaimed in the
        background by whichever replica gets there, and until then their blocks may still count."""
        if self._reclaimed_gen < self._retired_gen:
            await self.reclaim()
        res = await self._eval_many(_STATS, [(tag, []) for tag in self._tags])
        entries = 0
        nbytes = 0
        nodes: set[str] = set()
        by_model_tier: dict[tuple[str, Tier], int] = {}
        per_bucket: dict[str, dict[str, int]] = {}
        for tag, (locs, model_blocks, b) in zip(self._tags, res, strict=True):
            nbytes += int(b)
            for i in range(0, len(locs), 4):
                model, node_id, _ = _parse_loc_name(locs[i])
                counts = [int(x) for x in locs[i + 1 : i + 4]]
                if sum(counts):
                    nodes.add(node_id)
                for t in Tier:
                    if counts[t]:
                        by_model_tier[(model, t)] = by_model_tier.get((model, t), 0) + counts[t]
                        entries += counts[t]
            for i in range(0, len(model_blocks), 2):
                per_bucket.setdefault(model_blocks[i].decode(), {})[tag] = int(model_blocks[i + 1])
        blocks_by_model = await self._distinct_blocks(per_bucket)
        return IndexStats(
            entries=entries,
            blocks=sum(blocks_by_model.values()),
            nodes=len(nodes),
            bytes=nbytes,
            entries_by_model_tier=by_model_tier,
            blocks_by_model=blocks_by_model,
        )

    async def _distinct_blocks(
        self, per_bucket: dict[str, dict[str, int]], limit: int = 2_000_000
    ) -> dict[str, int]:
        """Distinct blocks per model over buckets (a block held in two buckets counts once).

        ``per_bucket`` is model -> tag -> that bucket's block count. Exact (HSCAN of the inverted
        hashes of the buckets that have the model) up to ``limit`` summed entries; past that the sum,
        an upper bound, so that stats never pulls a huge index to the client.
        """
        out: dict[str, int] = {}
        for model, counts in per_bucket.items():
            tags = [tag for tag, n in counts.items() if n]
            total = sum(counts.values())
            if not tags:
                continue
            if len(tags) == 1 or total > limit:
                out[model] = total
                continue
            seen: set[bytes] = set()
            for tag in tags:
                await self._rt(functools.partial(self._scan_fields, f"{tag}:inv:{model}", seen))
            out[model] = len(seen)
        return out

    async def _scan_fields(self, key: str, into: set[bytes]) -> None:
        async for h, _ in self._r.hscan_iter(key, count=10_000):
            into.add(h)

    async def ping(self) -> bool:
        try:
            if self._cluster:
                await asyncio.wait_for(self._r.ping(target_nodes=RedisCluster.PRIMARIES), 2.0)
            else:
                await asyncio.wait_for(self._r.ping(), 2.0)
        except Exception:
            self.metrics.errors += 1
            self.metrics.up = False
            return False
        if not self.metrics.up:
            self.metrics.up = True
            self.metrics.reconnects += 1
        return True

    async def data_epoch(self) -> str:
        """A token that changes when Redis lost the index (restarted empty, flushed, failed over badly).

        Each bucket keeps a random marker; the coordinator compares the token before and after an
        outage and asks every agent for a snapshot when it changed.
        """

        async def go() -> str:
            tokens = []
            for tag in self._tags:
                await self._r.set(tag + ":epoch", uuid.uuid4().hex, nx=True)
                token = await self._r.get(tag + ":epoch")
                tokens.append(token if isinstance(token, bytes) else b"")
            return hashlib.sha1(b"|".join(tokens)).hexdigest()[:16]

        return await self._rt(go)

    async def close(self) -> None:
        self._closed = True
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
        with contextlib.suppress(Exception):
            await self._r.aclose()

    # ------------------------------------------------------------------------------------- reclaim

    async def reclaim(self) -> int:
        """Reclaim every retired location's entries now; returns how many entries were dropped."""
        total = 0
        gen = self._retired_gen
        pending = list(self._tags)
        while pending and not self._closed:
            res = await self._eval_many(_RECLAIM, [(tag, [_RECLAIM_CHUNK]) for tag in pending])
            total += sum(int(done) for done, _ in res)
            pending = [tag for tag, (done, left) in zip(pending, res, strict=True) if int(left) or int(done)]
        if not pending:
            self._reclaimed_gen = max(self._reclaimed_gen, gen)
        self.metrics.reclaimed_entries += total
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
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reclaim_wake.wait(), self._reclaim_interval)


# ARGV: tag, location name, node, pending id: abandons a replace_node fill that failed midway.
_REMOVE_PENDING_BY_NODE = _Script(
    _LUA_COMMON
    + r"""
if redis.call('HEXISTS', tag .. ':pend', ARGV[4]) == 1 then retire(ARGV[4], ARGV[2], ARGV[3]) end
return 1
"""
)
