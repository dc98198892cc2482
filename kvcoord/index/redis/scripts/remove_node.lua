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
