if epoch_changed() then return -2 end
local band = bit.band
-- a fill whose pending location is gone is refused before anything is written
local a = 2
while a <= #ARGV do
  local mode = ARGV[a + 2]
  if mode ~= 'A' and call('HEXISTS', tag .. ':pend', mode) == 0 then
    return redis.error_reply('ABORTED pending location gone')
  end
  a = a + 5 + 2 * tonumber(ARGV[a + 4])
end
local out = {}
local function apply_batch(a)
  local lf, node, mode = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local last = a + 4 + 2 * tonumber(ARGV[a + 4])
  if fenced(node, ARGV[a + 3]) then  -- another client claimed the node since: nothing of it applies
    local n = #out
    out[n + 1] = -1; out[n + 2] = 0; out[n + 3] = 0; out[n + 4] = 0; out[n + 5] = 0; out[n + 6] = 0
    return last + 1
  end
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
      if s then p, m = holder_find(s, id, key) end
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
  for o = a + 5, last, 2 do
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
