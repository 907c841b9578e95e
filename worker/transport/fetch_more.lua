-- Up to ARGV[1] more messages from the queue (KEYS[1]) into the fetching list (KEYS[2]), oldest
-- first, returned in that order: the rest of a batch after the blocking fetch of its first.
local items = {}
for i = 1, tonumber(ARGV[1]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not item then break end
  items[i] = item
end
return items
