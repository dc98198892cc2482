-- KEYS[1]: the owner records hash. ARGV: instance id, replica: drops the owner record if it is this replica's.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, c = pcall(cjson.decode, cur)
  if ok and type(c) == 'table' and c.replica == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end
end
return 1
