-- Store answers in the answer cache, bounded in entries (dispatched by worker.redis.answer_cache).
-- KEYS[1]: the index, a sorted set: entry key -> the time it was written (ms)
-- ARGV[1]: each entry's TTL (ms); ARGV[2]: the most entries the cache holds; ARGV[3]: now (ms);
-- ARGV[4..]: entry key, answer JSON, entry key, answer JSON, ...
-- Entries past their TTL leave the index; past the bound the oldest are deleted with theirs.
-- Returns the number of entries evicted by the bound.
local ttl, bound, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #ARGV, 2 do
  redis.call('SET', ARGV[i], ARGV[i + 1], 'PX', ttl)
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local over = redis.call('ZCARD', KEYS[1]) - bound
local evicted = 0
while over > 0 do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, math.min(over, 500) - 1)
  redis.call('DEL', unpack(oldest))
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #oldest - 1)
  over, evicted = over - #oldest, evicted + #oldest
end
return evicted
