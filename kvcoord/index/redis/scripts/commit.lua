if epoch_changed() then return -2 end
local lf, node, id = ARGV[2], ARGV[3], ARGV[4]
if fenced(node, ARGV[5]) then return -1 end
if redis.call('HEXISTS', tag .. ':pend', id) == 0 then return 0 end
local old = redis.call('HGET', tag .. ':loc', lf)
if old then retire(old, lf, node) end
redis.call('HDEL', tag .. ':pend', id)
redis.call('HSET', tag .. ':loc', lf, id)
redis.call('HSET', tag .. ':name', id, lf)
bump()
feed_flush()
return 1
