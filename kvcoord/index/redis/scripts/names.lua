#!lua flags=no-writes
local v = redis.call('GET', ARGV[1] .. ':ver') or ''
if v == ARGV[2] then return 0 end
return {v, redis.call('HGETALL', ARGV[1] .. ':name')}
