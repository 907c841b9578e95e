-- Idempotent publish of one forward batch's results: the first final result for (task, slot) goes
-- to the stream, repeats do not; the attempts keys of the messages it finishes are dropped. One
-- call per forward batch, one BITFIELD per message in it (not a key per ticket: per-ticket SET NX
-- was a third of Redis's time at 10k tickets/s).
-- KEYS[1] results stream; KEYS[2..m+1] the done key of each message (DONE_KEY, bit <slot> set once
-- that slot is published); KEYS[m+2..] attempts keys to delete.
-- ARGV[1] stream MAXLEN (approximate), ARGV[2] key expiry in seconds, ARGV[3] m, ARGV[4..m+3] each
-- message's slots in this call, comma-separated; ARGV[m+4..] the result JSON of each of those
-- slots, message by message, in the same order.
-- Returns the positions (1-based, in that order) of results published before (re-executions).
local m = tonumber(ARGV[3])
local result, position, repeats = m + 4, 1, {}
for i = 1, m do
  local fields = {}
  for slot in string.gmatch(ARGV[i + 3], '%d+') do
    local n = #fields
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'SET', 'u1', '#' .. slot, 1
  end
  for first = 1, #fields, 4000 do  -- unpack() has a limit on values
    local old = redis.call('BITFIELD', KEYS[i + 1], unpack(fields, first, math.min(first + 3999, #fields)))
    for _, bit in ipairs(old) do
      if bit == 0 then
        redis.call('XADD', KEYS[1], '*', 'data', ARGV[result])
      else
        repeats[#repeats + 1] = position
      end
      result, position = result + 1, position + 1
    end
  end
  redis.call('EXPIRE', KEYS[i + 1], ARGV[2])
end
redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[1])  -- once per call, not per entry
for i = m + 2, #KEYS do
  redis.call('DEL', KEYS[i])
end
return repeats
