if epoch_changed() then return -2 end
-- ARGV[4] '1': reclaiming a dead owner's node, only while its token is still exactly ARGV[3]; the
-- token is then fenced out (a new one is issued), so that owner can never write for the node again
if ARGV[4] == '1' then
  if redis.call('GET', tag .. ':fence:' .. ARGV[2]) ~= ARGV[3] then return -1 end
  new_token(ARGV[2])
elseif fenced(ARGV[2], ARGV[3]) then
  return -1
end
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
