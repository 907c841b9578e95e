-- Idempotent publish of one forward batch's results, checked against the message they belong to:
-- the first final result for (task, slot) goes to the stream, repeats do not, and a message whose
-- task id already streamed results of another payload (its digest differs) writes nothing: its
-- results are named as conflicts. One call per forward batch, one BITFIELD per message in it.
-- KEYS[1] results stream; KEYS[2..m+1] each message's done key (bit <slot> set once published);
-- KEYS[m+2..2m+1] each message's digest key; KEYS[2m+2..] attempts keys to delete.
-- ARGV[1] stream MAXLEN (approximate), ARGV[2] key expiry in seconds, ARGV[3] m, ARGV[4..m+3] each
-- message's slots, comma-separated; ARGV[m+4..2m+3] each message's digest ('' = not checked);
-- ARGV[2m+4..] the result JSON of each of those slots, message by message, in the same order.
-- Returns {repeats, conflicts}: positions (1-based, in that order) of results published before by
-- the same message (re-executions), and of results of another message under a used task id.
local m = tonumber(ARGV[3])
local result, position, repeats, conflicts = 2 * m + 4, 1, {}, {}
for i = 1, m do
  local fields = {}
  for slot in string.gmatch(ARGV[i + 3], '%d+') do
    local n = #fields
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'SET', 'u1', '#' .. slot, 1
  end
  local digest_key, digest = KEYS[m + 1 + i], ARGV[m + 3 + i]
  local known = false  -- the digest stored by an earlier call, where it differs from this one
  if digest ~= '' and not redis.call('SET', digest_key, digest, 'NX', 'EX', ARGV[2]) then
    known = redis.call('GET', digest_key)  -- only for a task id seen before: a repeat, or a conflict
    known = known ~= digest and known
  end
  if known then
    for _ = 1, #fields / 4 do
      conflicts[#conflicts + 1] = position
      result, position = result + 1, position + 1
    end
  else
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
end
redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[1])  -- once per call, not per entry
for i = 2 * m + 2, #KEYS do
  redis.call('DEL', KEYS[i])
end
return {repeats, conflicts}
