-- Idempotent backend writes, in Celery's own format (key `celery-task-meta-<id>`, the same value
-- PUBLISHed on that key for pub/sub waiters, as RedisBackend.set does). SET NX keeps Celery's rule
-- "a stored result is never overwritten by a later execution" without its extra GET round trip.
-- KEYS: result keys; ARGV[1] expiry in seconds (0: none), ARGV[2..] the encoded meta of each key.
-- Returns the number of results stored now.
local stored = 0
for i = 1, #KEYS do
  local set
  if tonumber(ARGV[1]) > 0 then
    set = redis.call('SET', KEYS[i], ARGV[i + 1], 'NX', 'EX', ARGV[1])
  else
    set = redis.call('SET', KEYS[i], ARGV[i + 1], 'NX')
  end
  if set then
    redis.call('PUBLISH', KEYS[i], ARGV[i + 1])
    stored = stored + 1
  end
end
return stored
