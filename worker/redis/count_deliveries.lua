-- One delivery more for each message (KEYS: attempts keys, ARGV[1] their expiry in seconds);
-- returns the new counts.
local counts = {}
for i = 1, #KEYS do
  counts[i] = redis.call('INCR', KEYS[i])
  redis.call('EXPIRE', KEYS[i], ARGV[1])
end
return counts
