-- KEYS[1]: the owner records hash. ARGV: instance id, replica, status, now (Redis time), lease seconds.
-- 1 if this replica owns the instance now, 0 if another replica's record has not expired.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local now = tonumber(ARGV[4])
if cur then
  local ok, c = pcall(cjson.decode, cur)
  if ok and type(c) == 'table' and c.replica ~= ARGV[2] and tonumber(c.expires or 0) > now then return 0 end
end
local rec = {replica = ARGV[2], status = ARGV[3], expires = now + tonumber(ARGV[5])}
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
return 1
