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
