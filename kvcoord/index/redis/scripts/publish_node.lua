-- KEYS[1]: the node directory hash. ARGV: per record, node id, owner, heard, fence, record (JSON with
-- owner, heard, fence). A record of another owner that outranks the new one is kept: the higher fencing
-- token when both have one, else the later heard.
for i = 1, #ARGV, 5 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  local write = true
  if cur then
    local ok, c = pcall(cjson.decode, cur)
    if ok and type(c) == 'table' and c.owner ~= ARGV[i + 1] then
      local cf, f = tonumber(c.fence or 0) or 0, tonumber(ARGV[i + 3])
      if cf > 0 and f > 0 and cf ~= f then
        write = f > cf
      else
        write = not (tonumber(c.heard or 0) > tonumber(ARGV[i + 2]))
      end
    end
  end
  if write then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 4]) end
end
return 1
