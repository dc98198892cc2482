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
``T:ver``                 str    version token of ``T:name``, new on every change (lookups cache names)
``T:node:<node>``         set    the node's location ids (live and pending): ``remove_node`` reads only it
``T:inv:<model>``         hash   block hash (8 bytes, big-endian) -> holders: 5-byte records ``(location
                                 id u32, tier mask u8)`` sorted by id: the inverted index lookups walk
``T:fwd:<id>``            hash   block hash -> tier mask: one location's blocks (clear, export, reclaim)
``T:cnt``                 hash   ``<id>:<tier>`` -> entries, so ``stats`` never counts entries one by one
``T:dead`` / ``T:cur``    list   retired location ids waiting for reclaim, and their HSCAN cursors
========================  =====  ====================================================================

A lookup runs one read-only script per bucket that walks the query's hashes through ``T:inv:<model>``,
keeping the set of locations still in the run, and stops at the first block no live candidate holds.
Consecutive blocks held by the same locations have byte-identical holder strings (records are kept
sorted by id, whatever order the stores came in), and Lua interns strings, so a long shared prefix
costs a slice of an HMGET and one pointer compare per block; the holder list is decoded (and unseen
ids' liveness fetched with one HMGET) only where it changes.

On plain TCP to a standalone Redis the lookup does not run that script: per bucket it sends one
``MULTI`` holding a tiny script (``T:name`` only if ``T:ver`` differs from the client's cached token)
and a raw ``HMGET`` of the whole query, every bucket in one write, one round trip, and walks the
holder strings in Python by the same rule. Redis's Lua pays ~0.6-1 us per block to turn query bytes
and reply elements into Lua strings; a raw HMGET costs ~0.2 us per field and hiredis parses the reply
in C. The price is reading the query's tail past the stop (a few hundred bytes at most per block).
The ``T:ver`` token is a counter plus the server time, so a Redis restarted empty never repeats one.

Ingest: ``apply`` validates and packs a batch in Python (consecutive same-tier events merge into one
op), then queues it on its bucket. One write call per bucket is in flight at a time and takes every
batch queued meanwhile (up to ``_WRITE_COALESCE_BLOCKS``): one EVALSHA applies many nodes' batches in
queue order, so per-node order holds, and a script is atomic, so each batch is applied whole. Each op
costs one HMGET (of the inverted hash: the location's own record there is its tier mask) and two
HSETs (or HDELs) whatever its size.

On plain TCP to a standalone Redis, scripts go over one pipelined connection of our own (hiredis
packs commands and parses replies) rather than through redis-py's pool: a PING round trip costs ~20 us
that way and ~100 us through redis-py on the test VM. TLS, unix sockets and Cluster use redis-py.

With plain Redis there is one bucket by default
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

Lookup mirror (``?mirror=1``): while a bucket's ``T:feedon`` exists, every write script
also appends the holder strings it set (and whether ``T:name`` changed) to the bucket's stream ``T:feed``,
in the same atomic call, numbered by ``T:feedseq``. A mirroring client copies ``T:name`` and the inverted
hashes once, then replays the feed, and walks its copy for lookups (in C when built): no round trip, no
per-block Redis work. The copy is eventually consistent with Redis (a feed entry arrives within a
millisecond or so), and a client's own writes are visible to its next lookup (``apply`` waits for its
entry). See :class:`_Mirror` for loading, gaps and outages.

Entries are only ever lost if Redis loses them: run Redis with ``maxmemory-policy noeviction`` (an
evicted ``T:inv`` field would silently hide a block that a node still holds; with ``noeviction`` a
full Redis rejects writes, the coordinator sees the error, keeps the agents' batches unacked and
reports NOT_SERVING). Location ids are 32-bit in holder records.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import operator
import struct
import time
import uuid
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import hiredis
import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection as _PlainConnection

from kvcoord.events import KVEvent, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index import validate
from kvcoord.index.base import (
    ApplyResult,
    IndexStats,
    NodeKey,
    NodeMatch,
    SnapshotEntry,
)
from kvcoord.index.uri import parse_redis_uri

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_DISTINCT_LIMIT = 2_000_000
"""Summed entries past which the exact distinct-block count gives up and reports the sum (a bound)."""
FEED_MAX_ENTRIES = 1_000
"""Entries a bucket's change feed keeps (``XADD MAXLEN ~``): a mirror further behind than this reloads.
An entry is one write call: ~40 bytes per changed block, up to ``_WRITE_COALESCE_BLOCKS`` blocks (so a
few MB typically, 80 MB at most); a mirror replays ~1M blocks/s, several times Redis's write rate."""
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
    """(block, location) pairs of retired locations dropped by reclaim (any tiers count once)."""
    up: bool = True
    mirror: Any = None
    """The lookup mirror (``ready``, ``loads``, ``entries_applied``, ``lookups``), or None."""

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
-- globals are slow in Redis's sandbox (a protected table): bind what the hot loops use to locals
local call, sub, find, byte, char, spack, sunpack, unpack, min, floor = redis.call, string.sub,
  string.find, string.byte, string.char, struct.pack, struct.unpack, unpack, math.min, math.floor
local function model_of(lf)
  local c = find(lf, ':', 1, true)
  local n = tonumber(sub(lf, 1, c - 1))
  return sub(lf, c + 1, c + n)
end
-- holder records: 5 bytes each (location id u32 BE, tier mask u8), sorted by id; mask 0 deletes.
-- Sorted, so that blocks held by the same locations (on the same tiers) have byte-identical holder
-- strings however their stores interleaved: the lookup walk then compares one interned string per block.
local function holders_set(s, id, m)
  local key = spack('>I4', id)
  if not s then
    if m == 0 then return nil end
    return key .. char(m)
  end
  local lo, hi = 0, #s / 5
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if sunpack('>I4', s, mid * 5 + 1) < id then lo = mid + 1 else hi = mid end
  end
  local p = lo * 5 + 1
  if p <= #s and sub(s, p, p + 3) == key then
    if m == 0 then
      if #s == 5 then return nil end
      return sub(s, 1, p - 1) .. sub(s, p + 5)
    end
    return sub(s, 1, p - 1) .. key .. char(m) .. sub(s, p + 5)
  end
  if m == 0 then return s end
  return sub(s, 1, p - 1) .. key .. char(m) .. sub(s, p)
end
-- The change feed (only while T:feedon exists, i.e. a client mirrors this bucket): every holder
-- string this call set or deleted, and whether T:name changed, as one XADD to T:feed at the end of the
-- call (so the feed's order is the order of the changes). Entry fields: 's' the feed's sequence
-- number (T:feedseq, consecutive: a reader detects what it missed), 'n' if T:name changed, and per
-- inverted hash 'i<model>' -> records (8-byte hash, u32 length, holder string; length 0 deletes).
local FEED = call('EXISTS', tag .. ':feedon') == 1
local feed_keys, feed_recs, feed_names = {}, {}, false
local function feed_inv(inv, h, s)
  if not FEED then return end
  local t = feed_recs[inv]
  if not t then t = {}; feed_recs[inv] = t; feed_keys[#feed_keys + 1] = inv end
  t[#t + 1] = h .. spack('>I4', s and #s or 0) .. (s or '')
end
local function feed_flush()
  if not FEED or (#feed_keys == 0 and not feed_names) then return 0 end
  local seq = call('INCR', tag .. ':feedseq')
  local args = {tag .. ':feed', 'MAXLEN', '~', 'FEED_MAX', '*', 's', seq}
  if feed_names then args[#args + 1] = 'n'; args[#args + 1] = '1' end
  local skip = #tag + 6  -- '<tag>:inv:' prefix of the inverted hash's key
  for k = 1, #feed_keys do
    local inv = feed_keys[k]
    args[#args + 1] = 'i' .. sub(inv, skip)
    args[#args + 1] = table.concat(feed_recs[inv])
  end
  call('XADD', unpack(args))
  feed_keys, feed_recs, feed_names = {}, {}, false
  return seq
end
-- HMGET / HSET / HDEL in slices (Lua's unpack is bounded by the C stack)
local function mget(key, fields, out)
  local n = #fields
  if n <= 1000 then
    local part = call('HMGET', key, unpack(fields))
    for j = 1, n do out[j] = part[j] end
    return
  end
  for i = 1, n, 1000 do
    local part = call('HMGET', key, unpack(fields, i, min(i + 999, n)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
end
local function flush_hash(key, order, final, feed_it)
  local sets, dels = {}, {}
  for k = 1, #order do
    local h = order[k]
    local v = final[h]
    if v then sets[#sets + 1] = h; sets[#sets + 1] = v else dels[#dels + 1] = h end
    if feed_it then feed_inv(key, h, v) end
  end
  for i = 1, #sets, 1000 do call('HSET', key, unpack(sets, i, min(i + 999, #sets))) end
  for i = 1, #dels, 1000 do call('HDEL', key, unpack(dels, i, min(i + 999, #dels))) end
end
local function put_holders(inv, h, s)
  if s then call('HSET', inv, h, s) else call('HDEL', inv, h) end
  feed_inv(inv, h, s)
end
-- T:name changed: a new version token (a counter plus the server time, so that a Redis restarted
-- empty never repeats a token a client cached), which lookups compare to their cached id -> name map
local function bump()
  local t = call('TIME')
  call('SET', tag .. ':ver', call('INCR', tag .. ':vn') .. ':' .. t[1] .. '.' .. t[2])
  feed_names = true
end
-- retire a location id: invisible to readers at once, entries reclaimed later from T:dead
local function retire(id, lf, node)
  id = tostring(id)
  if call('HDEL', tag .. ':name', id) == 1 then bump() end
  call('HDEL', tag .. ':pend', id)
  if call('HGET', tag .. ':loc', lf) == id then call('HDEL', tag .. ':loc', lf) end
  local c = call('HMGET', tag .. ':cnt', id .. ':0', id .. ':1', id .. ':2')
  call('HDEL', tag .. ':cnt', id .. ':0', id .. ':1', id .. ':2')
  call('SREM', tag .. ':node:' .. node, id)
  call('RPUSH', tag .. ':dead', id .. ':' .. lf)
  return (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
end
""".replace("FEED_MAX", str(FEED_MAX_ENTRIES))

# ARGV: tag, then one or more batches, each: location name, node, mode ('A' apply to the live location,
# or a pending id to fill), op count, then (op, blob) pairs: 'S<tier>' store, 'R<tier>' or
# 'R<tier>:<group>' remove (blob = packed 8-byte hashes), 'G<group>' remember a non-indexable group of
# this location, 'C' AllBlocksCleared. Batches apply in order; returns 6 counts per batch.
_LUA_WRITE = _LUA_COMMON + r"""
local band = bit.band
-- a fill whose pending location is gone is refused before anything is written
local a = 2
while a <= #ARGV do
  local mode = ARGV[a + 2]
  if mode ~= 'A' and call('HEXISTS', tag .. ':pend', mode) == 0 then
    return redis.error_reply('ABORTED pending location gone')
  end
  a = a + 4 + 2 * tonumber(ARGV[a + 3])
end
local out = {}
local function apply_batch(a)
  local lf, node, mode = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local last = a + 3 + 2 * tonumber(ARGV[a + 3])
  local inv = tag .. ':inv:' .. model_of(lf)
  local skipkey = tag .. ':skip:' .. node
  local id, fwd
  if mode == 'A' then id = call('HGET', tag .. ':loc', lf) else id = mode end
  if id then id = tonumber(id); fwd = tag .. ':fwd:' .. id end
  local new, dup, removed, unknown, cleared, skipped = 0, 0, 0, 0, 0, 0
  local dcnt = {0, 0, 0}
  local skip = nil
  local function flush()
    if not id then return end
    for t = 1, 3 do
      if dcnt[t] ~= 0 then call('HINCRBY', tag .. ':cnt', id .. ':' .. (t - 1), dcnt[t]); dcnt[t] = 0 end
    end
  end
  -- One op over its hashes with one HMGET (of the inverted hash: this location's record there is its
  -- tier mask, so the forward hash is only written) and a few HSET/HDELs. b > 0 sets tier bit b,
  -- b < 0 clears bit -b. Returns (blocks changed, noops + blocks left alone).
  local function batch_op(blob, b, noop)
    local hs = {}
    for p = 1, #blob, 8 do hs[#hs + 1] = sub(blob, p, p + 7) end
    local iv = {}
    mget(inv, hs, iv)
    local ff, fi, order = {}, {}, {}
    local changed = 0
    local bb = b > 0 and b or -b
    local setting = b > 0
    local key = spack('>I4', id)
    for i = 1, #hs do
      local h = hs[i]
      local s = fi[h]
      local first = s == nil
      if first then s = iv[i] or false end
      -- this location's place in the block's sorted holder records, and its tier mask there (0: absent)
      local p, m = 1, 0
      if s then
        local lo, hi = 0, #s / 5
        while lo < hi do
          local mid = floor((lo + hi) / 2)
          if sunpack('>I4', s, mid * 5 + 1) < id then lo = mid + 1 else hi = mid end
        end
        p = lo * 5 + 1
        if p <= #s and sub(s, p, p + 3) == key then m = byte(s, p + 4) end
      end
      if setting == (band(m, bb) ~= 0) then
        noop = noop + 1
      else
        local had = m
        if setting then m = m + bb else m = m - bb end
        if first then order[#order + 1] = h end
        ff[h] = m > 0 and char(m) or false
        if had == 0 then
          fi[h] = s and (sub(s, 1, p - 1) .. key .. char(m) .. sub(s, p)) or (key .. char(m))
        elseif m == 0 then
          fi[h] = #s > 5 and (sub(s, 1, p - 1) .. sub(s, p + 5)) or false
        else
          fi[h] = sub(s, 1, p - 1) .. key .. char(m) .. sub(s, p + 5)
        end
        changed = changed + 1
      end
    end
    flush_hash(fwd, order, ff, false)
    flush_hash(inv, order, fi, true)
    return changed, noop
  end
  for o = a + 4, last, 2 do
    local op, blob = ARGV[o], ARGV[o + 1]
    local kind = sub(op, 1, 1)
    if kind == 'C' then
      if id then flush(); cleared = cleared + retire(id, lf, node); id = nil; fwd = nil end
    elseif kind == 'G' then
      if skip == nil then skip = call('HGET', skipkey, lf) or ',' end
      local g = sub(op, 2) .. ','
      if not find(skip, ',' .. g, 1, true) then
        skip = skip .. g
        call('HSET', skipkey, lf, skip)
      end
    elseif kind == 'S' then
      local t = tonumber(sub(op, 2))
      if not id and #blob > 0 then
        id = call('INCR', tag .. ':next')
        call('HSET', tag .. ':loc', lf, id)
        call('HSET', tag .. ':name', id, lf)
        bump()
        call('SADD', tag .. ':node:' .. node, id)
        fwd = tag .. ':fwd:' .. id
      end
      local added
      added, dup = batch_op(blob, 2 ^ t, dup)
      new = new + added; dcnt[t + 1] = dcnt[t + 1] + added
    else
      local t = tonumber(sub(op, 2, 2))
      local skipped_here = false
      if #op > 2 then
        if skip == nil then skip = call('HGET', skipkey, lf) or ',' end
        skipped_here = find(skip, ',' .. sub(op, 4) .. ',', 1, true) ~= nil
      end
      if skipped_here then
        skipped = skipped + #blob / 8
      elseif id then
        local done
        done, unknown = batch_op(blob, -(2 ^ t), unknown)
        removed = removed + done; dcnt[t + 1] = dcnt[t + 1] - done
      else
        unknown = unknown + #blob / 8
      end
    end
  end
  flush()
  local n = #out
  out[n + 1] = new; out[n + 2] = dup; out[n + 3] = removed
  out[n + 4] = unknown; out[n + 5] = cleared; out[n + 6] = skipped
  return last + 1
end
a = 2
while a <= #ARGV do a = apply_batch(a) end
if FEED then out[#out + 1] = feed_flush() end  -- the feed seq of these changes (0: none), last
return out
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
bump()
feed_flush()
return 1
"""

# ARGV: tag, location name, node. AllBlocksCleared for one location: returns the entries it dropped.
_LUA_CLEAR = _LUA_COMMON + r"""
local id = redis.call('HGET', tag .. ':loc', ARGV[2])
if not id then return 0 end
local n = retire(id, ARGV[2], ARGV[3])
feed_flush()
return n
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
feed_flush()
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
local done = 0
for i = 1, #kv, 2 do
  local h = kv[i]
  -- HSCAN may return a field twice (the hash shrinks as we delete): count only real deletions
  if redis.call('HDEL', fwd, h) == 1 then
    put_holders(inv, h, holders_set(redis.call('HGET', inv, h) or nil, nid, 0))
    done = done + 1
  end
end
if r[1] == '0' then
  redis.call('DEL', fwd)
  redis.call('HDEL', tag .. ':cur', id)
  redis.call('LPOP', dead)
else
  redis.call('HSET', tag .. ':cur', id, r[1])
end
feed_flush()
return {done, redis.call('LLEN', dead)}
"""

# ARGV: tag, model, packed query hashes, '1' if restricted to candidates, then candidate location names.
# Returns a flat list: location name, run length, GPU, CPU, STORAGE blocks of the run, ... (each block
# counted once, in its fastest tier, as the memory backend does).
_LUA_LOOKUP = (
    "#!lua flags=no-writes\n"
    + r"""
local call, sub, sunpack, unpack, min = redis.call, string.sub, struct.unpack, unpack, math.min
local tag, model, blob = ARGV[1], ARGV[2], ARGV[3]
local inv = tag .. ':inv:' .. model
local names = tag .. ':name'
local allowed = nil
if ARGV[4] == '1' then
  allowed = {}
  local any = false
  for s = 5, #ARGV, 1000 do
    local ids = call('HMGET', tag .. ':loc', unpack(ARGV, s, min(s + 999, #ARGV)))
    for a = 1, #ids do
      if ids[a] then allowed[tonumber(ids[a])] = true; any = true end
    end
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
-- a block whose holder string differs from the previous one: decode it, learn unseen ids' liveness
-- with one HMGET, and keep the locations still in the run; false stops the walk
local function change(i, v)
  flush()
  local ids, ms, unseen = {}, {}, {}
  for p = 1, #v, 5 do
    local id, m = sunpack('>I4B', v, p)
    if (i == 1 or cur[id]) and (allowed == nil or allowed[id]) then
      ids[#ids + 1] = id; ms[#ms + 1] = m
      if live[id] == nil then unseen[#unseen + 1] = id end
    end
  end
  for s = 1, #unseen, 1000 do
    local last = min(s + 999, #unseen)
    local nm = call('HMGET', names, unpack(unseen, s, last))
    for k = s, last do live[unseen[k]] = nm[k - s + 1] end
  end
  local nxt, any = {}, false
  for k = 1, #ids do
    local id = ids[k]
    if live[id] then
      nxt[id] = ms[k]; any = true
      if i == 1 then run[id] = 0; tiers[id] = {0, 0, 0} end
    end
  end
  if not any then return false end
  cur, prev = nxt, v
  return true
end
-- HMGET the query in growing slices: short walks stay cheap, long ones cost few calls
local n, i, width = #blob / 8, 1, 64
local going = true
while going and i <= n do
  local last = min(n, i + width - 1)
  local fs = {}
  for k = i, last do fs[k - i + 1] = sub(blob, k * 8 - 7, k * 8) end
  local vs = call('HMGET', inv, unpack(fs))
  for k = 1, #fs do
    local v = vs[k]
    if not v then going = false; break end
    if v ~= prev and not change(i + k - 1, v) then going = false; break end
    seg = seg + 1
  end
  i = last + 1
  width = min(width * 8, 1000)
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


def _command(*args: object) -> bytes:
    """A RESP command, packed by hiredis (its stub types the argument as a 1-tuple)."""
    packed: bytes = hiredis.pack_command(args)  # type: ignore[arg-type]
    return packed


class _Pipelined(asyncio.Protocol):
    """One RESP connection with any number of requests in flight, answered in order (Redis's guarantee).

    Why not redis-py for the hot path: its asyncio client takes a pooled connection, builds the command
    and parses the reply through several layers per call (~100 us here, more than the Lua walk of a
    lookup). This sends pre-packed commands (``hiredis.pack_command``) and feeds replies to
    ``hiredis.Reader``; concurrent callers share the socket, so their requests pipeline, and requests
    sent on one connection run in the order sent (the write queue relies on that). A request with no
    reply for ``timeout`` seconds aborts the connection; every waiter then gets ``ConnectionError``.
    """

    def __init__(self, timeout: float) -> None:
        self._reader = hiredis.Reader(replyError=rexc.ResponseError, protocolError=rexc.InvalidResponse)
        self._waiting: deque[asyncio.Future[Any] | None] = deque()
        """One entry per expected reply, in order; ``None`` for a reply nobody waits for."""
        self._transport: asyncio.Transport | None = None
        self._timeout = timeout
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        self._last = time.monotonic()
        while (reply := self._reader.gets()) is not False:
            fut = self._waiting.popleft()
            if fut is None or fut.done():
                continue
            if isinstance(reply, rexc.ResponseError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
        while self._waiting:
            fut = self._waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(rexc.ConnectionError(f"redis connection lost: {exc or 'closed'}"))

    def request(self, packed: bytes, skip: int = 0) -> asyncio.Future[Any]:
        """Send ``packed`` (``skip + 1`` commands); the future gets the last reply (MULTI ... EXEC)."""
        if self.lost or self._transport is None:
            raise rexc.ConnectionError("redis connection lost")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._waiting:
            self._last = time.monotonic()
        self._waiting.extend([None] * skip)
        self._waiting.append(fut)
        self._transport.write(packed)
        if self._timer is None:
            self._timer = loop.call_later(self._timeout, self._check)
        return fut

    def _check(self) -> None:
        """Abort when requests wait and nothing arrived for ``timeout`` seconds (Redis hung or gone)."""
        self._timer = None
        if not self._waiting or self.lost:
            return
        idle = time.monotonic() - self._last
        if idle >= self._timeout:
            assert self._transport is not None
            self._transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(self._timeout - idle, self._check)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class _FastPath:
    """Lazily (re)connected :class:`_Pipelined` connection to a standalone Redis over plain TCP."""

    __slots__ = (
        "_conn",
        "_connect_timeout",
        "_db",
        "_host",
        "_lock",
        "_password",
        "_port",
        "_timeout",
        "_username",
    )

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._host: str = kwargs.get("host", "localhost")
        self._port: int = int(kwargs.get("port", 6379))
        self._db: int = int(kwargs.get("db", 0) or 0)
        self._username: str | None = kwargs.get("username")
        self._password: str | None = kwargs.get("password")
        self._timeout: float = float(kwargs.get("socket_timeout") or 5.0)
        self._connect_timeout: float = float(kwargs.get("socket_connect_timeout") or self._timeout)
        self._conn: _Pipelined | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def for_client(cls, client: aredis.Redis | RedisCluster) -> _FastPath | None:
        """Only for a plain TCP standalone client (TLS, unix sockets and Cluster keep redis-py)."""
        if isinstance(client, RedisCluster):
            return None
        pool = client.connection_pool
        if pool.connection_class is not _PlainConnection:
            return None
        return cls(dict(pool.connection_kwargs))

    async def _connect(self) -> _Pipelined:
        async with self._lock:
            if self._conn is not None and not self._conn.lost:
                return self._conn
            loop = asyncio.get_running_loop()
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Pipelined(self._timeout), self._host, self._port),
                self._connect_timeout,
            )
            try:
                if self._password is not None:
                    auth = (self._username, self._password) if self._username else (self._password,)
                    await conn.request(_command("AUTH", *auth))
                if self._db:
                    await conn.request(_command("SELECT", self._db))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            return conn

    async def call(self, packed: bytes, skip: int = 0) -> Any:
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connect()
        return await conn.request(packed, skip)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None



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
_NAMES = _Script(
    "#!lua flags=no-writes\n"
    "local v = redis.call('GET', ARGV[1] .. ':ver') or ''\n"
    "if v == ARGV[2] then return 0 end\n"
    "return {v, redis.call('HGETALL', ARGV[1] .. ':name')}\n"
)
"""ARGV: tag, the client's cached ``T:ver``: 0 if unchanged, else ``{ver, T:name as a flat list}``."""
_EPOCH = _Script(
    "local k = ARGV[1] .. ':epoch'\nredis.call('SET', k, ARGV[2], 'NX')\nreturn redis.call('GET', k)\n"
)

_TIER_BITS = tuple((t, 1 << t) for t in Tier)
_REPLACE_CHUNK = 20_000
"""Entries per script call when filling a replacement (bounds how long one script blocks Redis)."""
_RECLAIM_CHUNK = 1_000
_LAYOUT = "v3"
"""Keyspace format, stored with the bucket count in ``{<prefix>}:conf``; v2 keeps holder records sorted,
v3 bumps ``T:ver`` whenever ``T:name`` changes (the lookup fast path caches ``T:name`` by it)."""
_WRITE_COALESCE_BLOCKS = 2048
"""A coalesced write call takes queued batches up to this many blocks (one batch always goes, however
big): it bounds how long one script holds Redis, and so how long a lookup can wait behind it."""
_DEFAULT_CLUSTER_BUCKETS = 16


_MULTI = _command("MULTI")
_EXEC = _command("EXEC")
_FIELD = b"$8\r\n" + bytes(8) + b"\r\n"
_HOLDER = struct.Struct(">IB")


def _hmget_command(key: bytes, blob: bytes) -> bytes:
    """``HMGET key h1 h2 ...`` in RESP for the packed 8-byte hashes ``blob``: eight strided copies
    instead of one Python object per hash (a 512-block query packs in a few microseconds)."""
    n = len(blob) >> 3
    buf = bytearray(_FIELD * n)
    for j in range(8):
        buf[4 + j :: 14] = blob[j::8]
    return b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (n + 2, len(key), key) + buf


class _Names:
    """A bucket's live locations as of the version token ``ver`` (``T:ver``); ids are never reused."""

    __slots__ = ("by_id", "by_name", "ver")

    def __init__(self, ver: bytes, flat: list[bytes]) -> None:
        self.ver = ver
        self.by_id: dict[int, tuple[str, str, int]] = {}
        self.by_name: dict[bytes, int] = {}
        for i in range(0, len(flat), 2):
            lid = int(flat[i])
            self.by_id[lid] = _parse_loc_name(flat[i + 1])
            self.by_name[flat[i + 1]] = lid


def _walk(holders: list[bytes | None], names: _Names, allowed: set[int] | None) -> list[NodeMatch]:
    """The lookup script's walk over one bucket's holder strings (``None`` = no holder: the walk stops)."""
    return _walk_runs(_runs_of(holders), names, allowed)


def _walk_runs(
    holder_runs: Iterable[tuple[bytes, int]], names: _Names, allowed: set[int] | None
) -> list[NodeMatch]:
    """``_walk`` over runs ``(holder string, consecutive blocks holding it)``, up to the stop."""
    live = names.by_id
    cur: dict[int, int] | None = None
    runs: dict[int, list[int]] = {}
    for v, seg in holder_runs:
        nxt = {
            lid: m
            for lid, m in _HOLDER.iter_unpack(v)
            if (cur is None or lid in cur) and lid in live and (allowed is None or lid in allowed)
        }
        if not nxt:
            break
        for lid, m in nxt.items():
            r = runs.get(lid)
            if r is None:
                r = runs[lid] = [0, 0, 0, 0]
            r[0] += seg
            r[1 if m & 1 else 2 if m & 2 else 3] += seg
        cur = nxt
    out = []
    for lid, (run, g, c, st) in runs.items():
        _, node_id, rank = live[lid]
        out.append(NodeMatch(node_id, rank, run, (g, c, st)))
    return out


def _holder_runs(copy: dict[int, bytes], hashes: Sequence[int]) -> list[tuple[bytes, int]]:
    """The copy's holder strings of ``hashes`` as runs (``_walk_runs``' input): the walk without C."""
    get = copy.get
    return _runs_of([get(h) for h in hashes])


def _runs_of(holders: list[bytes | None]) -> list[tuple[bytes, int]]:
    """Runs of equal consecutive holder strings, up to the first block no one holds."""
    try:
        stop = holders.index(None)
    except ValueError:
        stop = len(holders)
    groups = itertools.groupby(cast("list[bytes]", holders[:stop]))
    return [(v, len(list(same))) for v, same in groups]


try:
    from kvcoord._wirescan import mirror_walk as _mirror_walk
except ImportError:  # pragma: no cover - built whenever a compiler is present (CI requires it)
    _mirror_walk = None  # type: ignore[assignment]


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


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


def compile_events(events: Sequence[KVEvent]) -> tuple[list[tuple[str, bytes]], int]:
    """Validate a whole batch and turn it into write-script ops; returns ``(ops, skipped_store_blocks)``.

    Raises ``InvalidEvent`` before anything is sent, so a bad event never half-applies a batch. Group
    rules are the memory backend's: a non-full-attention store is counted and skipped, and its
    ``group_idx`` is remembered for the location so that the group's later removals are skipped too.
    """
    ops: list[tuple[str, list[bytes]]] = []
    skipped = 0

    def add(op: str, blob: bytes) -> None:
        # consecutive store (or removal) events of one tier become one op: the script then pays its
        # per-command costs once for the run (an op handles a hash repeated within it like two ops)
        if ops and ops[-1][0] == op and op[0] in "SR":
            ops[-1][1].append(blob)
        else:
            ops.append((op, [blob]))

    for kind, tier, hashes, group, indexable in validate.ops_of(events):
        if kind == validate.STORE:
            if not indexable:
                skipped += len(hashes)
                if group is not None:
                    add(f"G{group}", b"")
            elif hashes:
                add(f"S{tier}", _pack(hashes))
        elif kind == validate.REMOVE:
            if hashes:
                add(f"R{tier}" if group is None else f"R{tier}:{group}", _pack(hashes))
        else:
            add("C", b"")
    return [(op, blobs[0] if len(blobs) == 1 else b"".join(blobs)) for op, blobs in ops], skipped


def _is_connection_error(e: BaseException) -> bool:
    return isinstance(
        e, rexc.ConnectionError | rexc.TimeoutError | rexc.ClusterDownError | OSError | asyncio.TimeoutError
    ) or (isinstance(e, rexc.RedisClusterException) and "connect" in str(e).lower())


class _FeedGap(Exception):
    """The mirror missed feed entries (trimmed, or Redis lost the feed): it must reload."""


_FEED_REC = struct.Struct(">QI")
_FEED_BLOCK = 250
"""Milliseconds a feed reader's XREAD blocks: also how soon it notices that it should stop."""
_BY_NODE = operator.itemgetter(0, 1)
_BY_BLOCKS = operator.itemgetter(2)


class _Mirror:
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
    """

    def __init__(self, index: RedisIndex) -> None:
        self._ix = index
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
        self._bucket_of_tag = {tag: b for b, tag in enumerate(index._tags)}
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
                failed = True
            finally:
                self.ready = self.active = False
                self._fail_waiters()
            if failed:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _load(self) -> None:
        r = self._ix._r
        self.loads += 1
        inv: dict[str, dict[str, dict[int, bytes]]] = {}
        for tag in self._ix._tags:
            await r.set(f"{tag}:feedon", b"1")
            last: Any = await r.xrevrange(f"{tag}:feed", count=1)
            if last:
                self._last_id[tag] = last[0][0]
                self.seq[tag] = int(last[0][1][b"s"])
            else:
                self._last_id[tag] = b"0-0"
                self.seq[tag] = int(await r.get(f"{tag}:feedseq") or 0)
            await self._load_names(tag)
            models: dict[str, dict[int, bytes]] = {}
            # (a Cluster scans every shard for a tag's keys: startup and reloads only)
            prefix = f"{tag}:inv:".encode()
            async for key in r.scan_iter(match=_glob_escape(prefix) + b"*", count=1000):
                copy = models[key[len(prefix) :].decode()] = {}
                async for h, v in r.hscan_iter(key, count=10_000):
                    copy[int.from_bytes(h, "big")] = v
                if self._halt:
                    return  # closing: not ready, nothing to keep
            inv[tag] = models
        self.inv = inv
        self._merge_all()
        self.ready = True
        self._release()

    def _merge_all(self) -> None:
        """Build ``merged`` and ``merged_names`` from the per-bucket copies (several buckets only)."""
        tags = self._ix._tags
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
        for b, tag in enumerate(self._ix._tags):
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

    async def _load_names(self, tag: str) -> None:
        """``T:ver`` and ``T:name`` in one atomic read (the lookup path's ``_NAMES`` script)."""
        got = await self._ix._eval(_NAMES, tag, "-")
        self.names[tag] = _Names(got[0] or b"", got[1])

    async def _follow(self) -> None:
        """One reader per bucket (on a Cluster the buckets' feeds live on different shards, and one
        XREAD reads one shard). The first to fail stops the others, by a flag they see when their
        XREAD returns (not by cancelling a read in flight), and the copy reloads."""
        self._halt_readers = False
        readers = [
            asyncio.get_running_loop().create_task(self._follow_one(tag), name=f"redis-mirror-{tag}")
            for tag in self._ix._tags
        ]
        try:
            await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            self._halt_readers = True
            await asyncio.wait(readers, timeout=2 * _FEED_BLOCK / 1000 + 1)
            for t in readers:
                if not t.done():
                    t.cancel()
        for t in readers:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise cast(BaseException, t.exception())

    async def _follow_one(self, tag: str) -> None:
        try:
            await self._follow_feed(tag)
        except BaseException:
            self.ready = False  # at once: the other readers stop only after their current XREAD
            self._halt_readers = True
            raise

    async def _follow_feed(self, tag: str) -> None:
        r = self._ix._r
        feed = f"{tag}:feed"
        while not (self._halt or self._halt_readers):
            got: Any = await r.xread({feed: self._last_id[tag]}, count=1000, block=_FEED_BLOCK) or []
            for _, entries in got:
                for entry_id, fields in entries:
                    await self._apply(tag, entry_id, fields)
            self._release()
            # Idle: a Redis that lost its data (FLUSHALL, a restart we did not see) lost T:feedon too,
            # and its writers no longer feed: reload rather than serve the old copy.
            if not got and not await r.exists(f"{tag}:feedon"):
                raise _FeedGap(f"{tag}:feedon is gone (Redis lost its data)")

    async def _apply(self, tag: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        seq = int(fields[b"s"])
        if seq != self.seq[tag] + 1:
            raise _FeedGap(f"feed of {tag} jumped from entry {self.seq[tag]} to {seq}")
        models = self.inv[tag]
        rec = _FEED_REC
        bucket = self._bucket_of_tag[tag]
        for f, blob in fields.items():
            if f[:1] != b"i":
                continue
            model = f[1:].decode()
            copy = models.get(model)
            if copy is None:
                copy = models[model] = {}
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
        if b"n" in fields:
            await self._load_names(tag)
            if self.merged is not None:
                self._merge_names()
        self.seq[tag] = seq
        self._last_id[tag] = entry_id
        self.entries_applied += 1

    def match(
        self, model: str, hashes: Sequence[BlockHash64], want: dict[int, set[bytes]] | None
    ) -> list[NodeMatch]:
        """``RedisIndex.match`` on the copy (``want``: candidate location names per bucket)."""
        self.lookups += 1
        out: list[NodeMatch] = []
        tags = self._ix._tags
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


_LOCAL_IDS = 1 << 24
"""Location ids a bucket may reach while the mirror merges buckets (ids are never reused)."""


def _rebase(bucket: int, v: bytes) -> bytes | None:
    """Bucket-local holder records with each id made global (its top byte set to the bucket); None
    when an id is already past 2**24."""
    if v[0::5].count(0) != len(v) // 5:
        return None
    out = bytearray(v)
    out[0::5] = bytes((bucket,)) * (len(v) // 5)
    return bytes(out)


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` as a literal in a SCAN MATCH pattern (bucket tags hold braces, which are literals)."""
    out = bytearray()
    for c in raw:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)


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
        self._layout_lock = asyncio.Lock()
        self._reclaim_interval = reclaim_interval
        self._reclaim_wake = asyncio.Event()
        self._reclaim_task: asyncio.Task[None] | None = None
        self._closed = False
        self._retired_gen = 0
        self._reclaimed_gen = 0
        self._fast = _FastPath.for_client(client)
        self._wq: list[deque[tuple[list[object], int, asyncio.Future[list[int]]]]] = [
            deque() for _ in range(self.buckets)
        ]
        self._wq_tasks: list[asyncio.Task[None] | None] = [None] * self.buckets
        """Retirements this client made, and how many of them a finished reclaim pass has covered."""
        self._names: dict[str, _Names] = {}
        """Per bucket tag: ``T:name`` as of a ``T:ver`` (the fast lookup path's cache)."""
        self._mirror = _Mirror(self) if mirror else None
        self.metrics.mirror = self._mirror
        """Lookups from an in-memory copy fed by the buckets' change feeds (``?mirror=1``), or None."""

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    def from_uri(cls, uri: str, *, key_prefix: str = "kvcoord") -> RedisIndex:
        """``redis://host:port/db`` (also ``rediss://``, ``unix://``) or ``redis+cluster://h:p,h:p``.

        Query parameters read here: ``buckets`` (see the module docstring), ``timeout`` (socket
        timeout in seconds, default 5), ``prefix`` (overrides ``key_prefix``), ``mirror`` (``1``:
        answer lookups from an in-memory copy kept current by Redis's change feed; see
        :class:`_Mirror`). Does not connect.
        """
        parsed = parse_redis_uri(uri)
        return cls(parsed.client(), key_prefix=parsed.prefix or key_prefix, buckets=parsed.buckets,
                   mirror=parsed.mirror)

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
        fast = self._fast
        if fast is not None:

            async def go_fast() -> Any:
                try:
                    return await fast.call(_command("EVALSHA", script.sha, 1, key, tag, *args))
                except rexc.ResponseError as e:
                    if not str(e).startswith("NOSCRIPT"):
                        raise
                    return await fast.call(_command("EVAL", script.src, 1, key, tag, *args))

            return await self._rt(go_fast)

        async def go() -> Any:
            try:
                return await self._r.evalsha(script.sha, 1, key, tag, *args)  # type: ignore[arg-type]
            except rexc.NoScriptError:
                return await self._r.eval(script.src, 1, key, tag, *args)  # type: ignore[arg-type]

        return await self._rt(go)

    async def _write(self, bucket: int, batch: list[object], blocks: int) -> list[int]:
        """Queue one batch's write-script arguments for ``bucket``; returns its 6 counts once applied,
        and the change feed's sequence number of the call (0 when the feed is off).

        Batches that arrive while the bucket's previous write call is in flight are coalesced into
        the next call (one EVALSHA for many nodes' batches): Redis's per-call cost is paid once, and
        the client's too. The bucket's calls run one at a time, in queue order, so a node's batches
        (a node lives in one bucket) apply in the order ``apply`` was called. Each batch was validated
        before it was queued, and one script call is atomic, so a batch is applied whole or not at all.
        """
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._wq[bucket].append((batch, blocks, fut))
        task = self._wq_tasks[bucket]
        if task is None or task.done():
            self._wq_tasks[bucket] = asyncio.get_running_loop().create_task(
                self._drain(bucket), name=f"redis-write-{bucket}"
            )
        return await fut

    async def _drain(self, bucket: int) -> None:
        queue, tag = self._wq[bucket], self._tags[bucket]
        while queue:
            args: list[object] = []
            taken: list[asyncio.Future[list[int]]] = []
            size = 0
            while queue and (not taken or size + queue[0][1] <= _WRITE_COALESCE_BLOCKS):
                batch, blocks, fut = queue.popleft()
                if fut.done():  # the caller was cancelled before the batch was sent: not applied
                    continue
                args.extend(batch)
                taken.append(fut)
                size += blocks
            if not taken:
                break
            try:
                flat = await self._eval(_WRITE, tag, *args)
            except BaseException as e:
                err = IndexUnavailable("redis index closed") if isinstance(e, asyncio.CancelledError) else e
                for fut in taken:
                    if not fut.done():
                        fut.set_exception(err)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            seq = int(flat[6 * len(taken)]) if len(flat) > 6 * len(taken) else 0  # the feed's, if on
            for k, fut in enumerate(taken):
                if not fut.done():
                    fut.set_result([int(x) for x in flat[6 * k : 6 * k + 6]] + [seq])

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

        stored = await self._rt(go)
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
        self._layout_checked = True

    # ---------------------------------------------------------------------------------- the protocol

    async def apply(self, model: str, node_id: str, dp_rank: int, events: Sequence[KVEvent]) -> ApplyResult:
        validate.check_target(model, node_id, dp_rank)
        ops, skipped = compile_events(events)
        result = ApplyResult(skipped_group=skipped)
        if not ops:
            return result
        await self._check_layout()
        batch: list[object] = [_loc_name(model, node_id, dp_rank), node_id, "A", len(ops)]
        blocks = 0
        for op, blob in ops:
            batch.append(op)
            batch.append(blob)
            blocks += len(blob) >> 3
        bucket = self.bucket_of(node_id)
        new, _dup, removed, unknown, cleared, skipped_removals, seq = await self._write(bucket, batch, blocks)
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

    async def match(
        self,
        model: str,
        hashes: Sequence[BlockHash64],
        candidates: Collection[NodeKey] | None = None,
    ) -> list[NodeMatch]:
        if not hashes:
            return []
        mirror = self._mirror
        if mirror is not None:
            mirror.start()
            if mirror.ready:  # (hashes are checked by the walk: the same error as below)
                want: dict[int, set[bytes]] | None = None
                if candidates is not None:
                    want = {}
                    for node_id, rank in candidates:
                        want.setdefault(self.bucket_of(node_id), set()).add(
                            _loc_name(model, node_id, rank).encode()
                        )
                return mirror.match(model, hashes, want)
        try:
            blob = _pack(hashes)
        except struct.error as e:
            raise ValueError(f"query hashes must be uint64 ints: {e}") from e
        if self._fast is not None:
            return await self._match_fast(model, blob, candidates)
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

    async def _match_fast(
        self, model: str, blob: bytes, candidates: Collection[NodeKey] | None
    ) -> list[NodeMatch]:
        """``match`` on the fast path: per bucket, one MULTI with ``_NAMES`` and a raw HMGET of the whole
        query's holder strings, all buckets in one write and one round trip; the walk runs here.

        Why not the Lua walk: Redis's Lua turns each HMGET reply element into a Lua string and each
        query hash into a substring, ~0.6-1 us per block, several times the in-process walk; a raw
        HMGET costs Redis ~0.1 us per field and hiredis parses the reply in C. The walk itself is the
        Lua script's (same stop rule, same counts); consecutive blocks held by the same locations have
        equal holder strings, so it decodes only where they change (``itertools.groupby``). MULTI makes
        the names and the holders one atomic read, as one script would be.
        """
        fast = self._fast
        assert fast is not None
        if candidates is not None:
            want: dict[int, set[bytes]] = {}
            for node_id, rank in candidates:
                want.setdefault(self.bucket_of(node_id), set()).add(_loc_name(model, node_id, rank).encode())
            if not want:
                return []
            buckets = sorted(want)
        else:
            buckets = list(range(self.buckets))
        tags = [self._tags[b] for b in buckets]
        hmgets = [_hmget_command(f"{tag}:inv:{model}".encode(), blob) for tag in tags]

        async def go(retry: bool = True) -> list[Any]:
            parts = [_MULTI]
            for tag, hm in zip(tags, hmgets, strict=True):
                cached = self._names.get(tag)
                ver = cached.ver if cached is not None else b"-"
                parts.append(_command("EVALSHA", _NAMES.sha, 1, tag + ":loc", tag, ver))
                parts.append(hm)
            parts.append(_EXEC)
            res: list[Any] = await fast.call(b"".join(parts), skip=1 + 2 * len(tags))
            for r in res:
                if isinstance(r, rexc.ResponseError):
                    if retry and str(r).startswith("NOSCRIPT"):
                        await fast.call(_command("SCRIPT", "LOAD", _NAMES.src))
                        return await go(False)
                    raise r
            return res

        res = await self._rt(go)
        out: list[NodeMatch] = []
        for k, tag in enumerate(tags):
            got = res[2 * k]
            names = self._names.get(tag)
            if got != 0 or names is None:
                names = self._names[tag] = _Names(got[0], got[1])
            allowed = None
            if candidates is not None:
                allowed = {i for n in want[buckets[k]] if (i := names.by_name.get(n)) is not None}
                if not allowed:
                    continue
            out.extend(_walk(res[2 * k + 1], names, allowed))
        out.sort(key=lambda m: (-m.matched_blocks, m.node_id, m.dp_rank))
        return out

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        validate.check_target(model, node_id, dp_rank)
        if await self._eval(_CLEAR, self.tag_of(node_id), _loc_name(model, node_id, dp_rank), node_id):
            self._wake_reclaimer()
        await self._mirror_sync(self.tag_of(node_id))

    async def remove_node(self, node_id: str) -> None:
        if await self._eval(_REMOVE_NODE, self.tag_of(node_id), node_id):
            self._wake_reclaimer()
        await self._mirror_sync(self.tag_of(node_id))

    async def _mirror_sync(self, tag: str) -> None:
        """Read-your-writes for a change whose feed seq the script did not return: wait for the copy
        to reach the feed's current end."""
        mirror = self._mirror
        if mirror is None or not mirror.ready:
            return
        seq = await self._rt(lambda: self._r.get(f"{tag}:feedseq"))
        if seq:
            await mirror.caught_up(tag, int(seq))

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        validate.check_target(model, node_id, dp_rank)
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
        validate.check_target(model, node_id, dp_rank)
        per_tier = validate.snapshot_per_tier(entries)
        await self._check_layout()
        tag = self.tag_of(node_id)
        lf = _loc_name(model, node_id, dp_rank)
        pending = int(await self._eval(_BEGIN, tag, lf, node_id))
        try:
            for t, hs in enumerate(per_tier):
                for s in range(0, len(hs), _REPLACE_CHUNK):
                    blob = _pack(hs[s : s + _REPLACE_CHUNK])
                    await self._eval(_WRITE, tag, lf, node_id, str(pending), 1, f"S{t}", blob)
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
        await self._mirror_sync(tag)
        if not committed:
            log.info("replace_node %s/%s/%d lost to a concurrent remove_node", model, node_id, dp_rank)

    async def stats(self) -> IndexStats:
        """Exact for this client's retirements (it reclaims them first); others' are reclaimed in the
        background by whichever replica gets there, and until then their blocks may still count.

        Distinct blocks of a model spread over several buckets (Cluster) are counted by HSCAN of
        their inverted hashes: up to millions of fields. Periodic gauges use :meth:`quick_stats`."""
        if self._reclaimed_gen < self._retired_gen:
            await self.reclaim()
        return await self._stats(exact=True)

    async def quick_stats(self) -> IndexStats:
        """One script call per bucket, no scan, no reclaim: ``blocks`` is the per-bucket sum, an upper
        bound when a model spans several buckets (a block held in two buckets counts twice); then
        ``blocks_upper_bound`` is set."""
        return await self._stats(exact=False)

    async def _stats(self, *, exact: bool) -> IndexStats:
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
        if exact:
            blocks_by_model = await self._distinct_blocks(per_bucket)
            bound = any(
                sum(c.values()) > _DISTINCT_LIMIT and sum(1 for n in c.values() if n) > 1
                for c in per_bucket.values()
            )
        else:
            blocks_by_model = {m: sum(c.values()) for m, c in per_bucket.items() if any(c.values())}
            bound = any(sum(1 for n in c.values() if n) > 1 for c in per_bucket.values())
        return IndexStats(
            entries=entries,
            blocks=sum(blocks_by_model.values()),
            nodes=len(nodes),
            bytes=nbytes,
            entries_by_model_tier=by_model_tier,
            blocks_by_model=blocks_by_model,
            blocks_upper_bound=bound,
        )

    async def _distinct_blocks(
        self, per_bucket: dict[str, dict[str, int]], limit: int = _DISTINCT_LIMIT
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

    async def mirror_ready(self, timeout: float = 10.0) -> bool:
        """Start the lookup mirror (``?mirror=1``) if not running, and wait until it is loaded."""
        mirror = self._mirror
        if mirror is None:
            return False
        mirror.start()
        deadline = time.monotonic() + timeout
        while not mirror.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return mirror.ready

    async def ping(self) -> bool:
        if self._mirror is not None:
            self._mirror.start()  # the coordinator pings at start: load the copy before lookups come
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

    async def generation(self) -> str:
        """A token that changes when Redis lost the index (restarted empty, flushed, failed over badly).

        Each bucket keeps a random marker, set when missing (one script per bucket, one round trip);
        the coordinator compares the token over time and asks every agent for a snapshot when it
        changed. Raises :class:`IndexUnavailable` when Redis cannot be reached.
        """
        tokens = await self._eval_many(_EPOCH, [(tag, [uuid.uuid4().hex]) for tag in self._tags])
        return hashlib.sha1(b"|".join(t if isinstance(t, bytes) else b"" for t in tokens)).hexdigest()[:16]

    async def data_epoch(self) -> str:
        """Alias of :meth:`generation` (the name this module used first)."""
        return await self.generation()

    async def close(self) -> None:
        self._closed = True
        if self._mirror is not None:
            await self._mirror.close()
        for wtask in self._wq_tasks:
            if wtask is not None and not wtask.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(wtask), 1.0)
                wtask.cancel()
        for q in self._wq:
            while q:
                _, _, fut = q.popleft()
                if not fut.done():
                    fut.set_exception(IndexUnavailable("redis index closed"))
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
        if self._fast is not None:
            self._fast.close()
        with contextlib.suppress(Exception):
            await self._r.aclose()
        if self._mirror is not None:
            await self._mirror.reap()

    # ------------------------------------------------------------------------------------- reclaim

    async def reclaim(self) -> int:
        """Reclaim every retired location's entries now; returns how many (block, location) were dropped."""
        total = 0
        gen = self._retired_gen
        pending = list(self._tags)
        while pending and not self._closed:
            res = await self._eval_many(_RECLAIM, [(tag, [_RECLAIM_CHUNK]) for tag in pending])
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
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reclaim_wake.wait(), self._reclaim_interval)


# ARGV: tag, location name, node, pending id: abandons a replace_node fill that failed midway.
_REMOVE_PENDING_BY_NODE = _Script(
    _LUA_COMMON
    + r"""
if redis.call('HEXISTS', tag .. ':pend', ARGV[4]) == 1 then retire(ARGV[4], ARGV[2], ARGV[3]) end
feed_flush()
return 1
"""
)
