-- Consumers of the dispatcher group that hold nothing and have been idle past TICKETQ_DELIVER_CLAIM_IDLE_S
-- (dispatchers that stopped: earlier names, another host's), deleted. Checked and deleted in one
-- step, so no consumer that took an entry in between loses it (DELCONSUMER drops its pending).
-- A live dispatcher deleted by mistake costs nothing: its next XREADGROUP creates it again.
-- KEYS[1] the results stream; ARGV[1] the group, ARGV[2] idle ms, ARGV[3] the caller's own name.
-- Returns the names deleted.
local deleted = {}
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local field = {}
  for i = 1, #consumer, 2 do field[consumer[i]] = consumer[i + 1] end
  if field['pending'] == 0 and field['idle'] > tonumber(ARGV[2]) and field['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], field['name'])
    deleted[#deleted + 1] = field['name']
  end
end
return deleted
