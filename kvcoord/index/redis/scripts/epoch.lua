local k = ARGV[1] .. ':epoch'
redis.call('SET', k, ARGV[2], 'NX')
return redis.call('GET', k)
