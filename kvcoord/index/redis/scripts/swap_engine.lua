-- KEYS[1]: the registrations hash. ARGV: instance id, the registration expected now ('': none), the new
-- one ('': delete). 1 if swapped, 0 if the registration changed meanwhile.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if (ARGV[2] == '' and not cur) or cur == ARGV[2] then
  if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1])
  else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
  return 1
end
return 0
