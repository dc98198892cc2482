#!lua flags=no-writes
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
