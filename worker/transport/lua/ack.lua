-- Remove the records of acked messages (ARGV: their delivery tags) from kombu's unacked index
-- (KEYS[1], zset) and record (KEYS[2], hash) and from this consumer's owned set (KEYS[3]).
-- Deletions only: a full Redis (noeviction) still runs it, where a MULTI of the same commands is
-- refused whole, so acks go through, and free memory, while new writes wait.
local step = 1000 -- unpack() is bounded by Lua's stack
for first = 1, #ARGV, step do
  local last = math.min(first + step - 1, #ARGV)
  redis.call('ZREM', KEYS[1], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[2], unpack(ARGV, first, last))
  redis.call('SREM', KEYS[3], unpack(ARGV, first, last))
end
return #ARGV
