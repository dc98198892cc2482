#!lua flags=no-writes
-- ARGV[2]: the client's accepted T:epoch: -2 when the bucket's differs (it lost its data); then
-- taken out, so the rest reads ARGV as before
if redis.call('GET', ARGV[1] .. ':epoch') ~= ARGV[2] then return -2 end
table.remove(ARGV, 2)

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
