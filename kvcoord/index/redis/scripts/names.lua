#!lua flags=no-writes
-- ARGV[3]: the client's accepted T:epoch: -2 when the bucket's differs (it lost its data)
if redis.call('GET', ARGV[1] .. ':epoch') ~= ARGV[3] then return -2 end
local v = redis.call('GET', ARGV[1] .. ':ver') or ''
if v == ARGV[2] then return 0 end
return {v, redis.call('HGETALL', ARGV[1] .. ':name')}
