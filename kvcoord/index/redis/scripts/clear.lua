if epoch_changed() then return -2 end
if fenced(ARGV[3], ARGV[4]) then return -1 end
local id = redis.call('HGET', tag .. ':loc', ARGV[2])
if not id then return 0 end
local n = retire(id, ARGV[2], ARGV[3])
feed_flush()
return n
