if epoch_changed() then return -2 end
if fenced(ARGV[3], ARGV[4]) then return -1 end
local id = redis.call('INCR', tag .. ':next')
redis.call('HSET', tag .. ':pend', id, ARGV[2])
redis.call('SADD', tag .. ':node:' .. ARGV[3], id)
return id
