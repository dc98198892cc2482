local tag = ARGV[1]
-- globals are slow in Redis's sandbox (a protected table): bind what the hot loops use to locals
local call, sub, find, byte, char, spack, sunpack, unpack, min, floor = redis.call, string.sub,
  string.find, string.byte, string.char, struct.pack, struct.unpack, unpack, math.min, math.floor
-- The bucket's lifetime marker T:epoch (set when missing by the EPOCH script, lost with the data): a
-- write script's ARGV[2] is the marker its client last accepted, taken out of ARGV here so that the
-- script's own arguments keep their places. A script that checks it (epoch_changed() first, before
-- its fencing check) refuses the whole call with -2 when the marker differs or is gone: nothing is
-- written on top of a keyspace that lost its data until the client has re-read the generation.
local epoch_arg = table.remove(ARGV, 2)
local function epoch_changed()
  return call('GET', tag .. ':epoch') ~= epoch_arg
end
local function model_of(lf)
  local c = find(lf, ':', 1, true)
  local n = tonumber(sub(lf, 1, c - 1))
  return sub(lf, c + 1, c + n)
end
-- holder records: 5 bytes each (location id u32 BE, tier mask u8), sorted by id; mask 0 deletes.
-- Sorted, so that blocks held by the same locations (on the same tiers) have byte-identical holder
-- strings however their stores interleaved: the lookup walk then compares one interned string per block.
-- holder_find: where location `id` (its packed id `key`) sits or would sit in holder string `s`, and
-- its tier mask there (0: absent; a record never stores mask 0). The one search of the records: the
-- write script's per-block loop calls it too.
local function holder_find(s, id, key)
  local lo, hi = 0, #s / 5
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if sunpack('>I4', s, mid * 5 + 1) < id then lo = mid + 1 else hi = mid end
  end
  local p = lo * 5 + 1
  if p <= #s and sub(s, p, p + 3) == key then return p, byte(s, p + 4) end
  return p, 0
end
local function holders_set(s, id, m)
  local key = spack('>I4', id)
  if not s then
    if m == 0 then return nil end
    return key .. char(m)
  end
  local p, had = holder_find(s, id, key)
  if had ~= 0 then
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
-- Fencing tokens, one per node (T:fence:<node>): a client claims a node with a token above any issued
-- before (at least the server time in microseconds, so a Redis restarted empty still issues higher
-- ones), and every write for the node carries its token; an older token is refused (the script
-- answers -1 and changes nothing). '0' is unfenced (a client that never claimed the node). A key lost
-- with Redis's data is adopted by the first fenced writer; the highest token wins from then on.
local function new_token(node)
  local k = tag .. ':fence:' .. node
  local t = call('TIME')
  local tok = math.max((tonumber(call('GET', k)) or 0) + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
  local s = string.format('%.0f', tok)
  call('SET', k, s)
  return s
end
local function fenced(node, tok)
  if tok == '0' then return false end
  local k = tag .. ':fence:' .. node
  local cur, mine = tonumber(call('GET', k)) or 0, tonumber(tok)
  if mine < cur then return true end
  if mine > cur then call('SET', k, tok) end
  return false
end
