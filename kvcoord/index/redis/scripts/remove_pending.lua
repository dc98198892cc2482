if epoch_changed() then return -2 end
if redis.call('HEXISTS', tag .. ':pend', ARGV[4]) == 1 then retire(ARGV[4], ARGV[2], ARGV[3]) end
feed_flush()
return 1
