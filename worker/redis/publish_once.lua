-- Idempotent publish of one forward batch's results, checked against the message they belong to:
-- the first final result for (task, slot) goes to the stream, repeats do not, and a message whose
-- task id already streamed results of another payload (its digest differs) writes nothing: its
-- results are named as conflicts. A result flagged for review is copied to the review stream
-- with its first publication only, its ticket's text beside it (field `text`: a reviewer reads
-- it; the result alone does not hold it). One call per forward batch, one BITFIELD per message in it.
-- The call itself is idempotent too: its answer is kept under its own key, and the same call
-- repeated (its reply lost to a timeout or a partition) gets that answer again, not "all repeats";
-- a call its caller cancelled (it gave up before the call ran) does nothing.
-- A failure kept by a requeue (`ticketq dead requeue`: bit <slot> left set, the failure's reason
-- in the message's failed key) is not streamed again when the re-sent ticket fails for the same
-- reason; its answer, or another failure, is streamed once, and the kept reason goes.
-- KEYS[1] results stream; KEYS[2..m+1] each message's done key (bit <slot> set once published);
-- KEYS[m+2..2m+1] each message's digest key; KEYS[2m+2..3m+1] each message's failed key (hash
-- <slot> -> reason of a failure kept by a requeue); KEYS[3m+2] this call's key; KEYS[3m+3] the
-- review stream; KEYS[3m+4] the epoch marker (ticketq.epoch: its id goes into each entry's 'epoch'
-- field, read here so that it is the marker of the Redis written to); KEYS[3m+5..] attempts keys to delete.
-- ARGV[1] stream MAXLEN (approximate), ARGV[2] key expiry in seconds, ARGV[3] m, ARGV[4] the call
-- key's expiry in seconds, ARGV[5] the positions (1-based, comma-separated) of the results to
-- review, ARGV[6..m+5] each message's slots, comma-separated; ARGV[m+6..2m+5] each message's digest
-- ('' = not checked); ARGV[2m+6..] the result JSON of each of those slots, message by message, in
-- the same order; then, last, the ticket text of each result to review, in the order of ARGV[5].
-- Returns {repeats, conflicts}: positions (1-based, in that order) of results published before by
-- the same message (re-executions), and of results of another message under a used task id.
local m = tonumber(ARGV[3])
local call_key = KEYS[3 * m + 2]
local answered = redis.call('GET', call_key)
if answered == 'cancelled' then  -- the caller gave up on this call (Outbox.landed): a late copy
  return redis.error_reply('ticketq: publish call cancelled by its caller')
elseif answered then
  return cjson.decode(answered)
end
-- A result for a (task, slot) whose failure a requeue kept: new (streamed, and the kept reason
-- dropped) unless it is the same failure again. Only repeats get here, so the hot path never does.
local function anew(failed_key, slot, data)
  local kept = redis.call('HGET', failed_key, slot)
  if not kept then
    return false
  end
  local ok, result = pcall(cjson.decode, data)
  if ok and type(result) == 'table' and result.status == 'failed' and result.reason == kept then
    return false
  end
  redis.call('HDEL', failed_key, slot)
  return true
end
local entry = {'data', ''}  -- each stream entry's fields: the result, and the epoch when there is one
do
  local marker = redis.call('GET', KEYS[3 * m + 4])
  local ok, decoded = pcall(cjson.decode, marker or '')
  if ok and type(decoded) == 'table' and decoded.id then
    entry = {'data', '', 'epoch', tostring(decoded.id)}
  end
end
local review, reviewed, positions = {}, false, {}
for at in string.gmatch(ARGV[5], '%d+') do
  positions[#positions + 1] = tonumber(at)
end
for k, at in ipairs(positions) do  -- position -> its ticket's text (the last #positions arguments)
  review[at] = ARGV[#ARGV - #positions + k]
end
local result, position, repeats, conflicts = 2 * m + 6, 1, {}, {}
for i = 1, m do
  local fields, slots = {}, {}
  for slot in string.gmatch(ARGV[i + 5], '%d+') do
    local n = #fields
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'SET', 'u1', '#' .. slot, 1
    slots[#slots + 1] = slot
  end
  local digest_key, digest = KEYS[m + 1 + i], ARGV[m + 5 + i]
  local known = false  -- the digest stored by an earlier call, where it differs from this one
  if digest ~= '' and not redis.call('SET', digest_key, digest, 'NX', 'EX', ARGV[2]) then
    known = redis.call('GET', digest_key)  -- only for a task id seen before: a repeat, or a conflict
    -- a digest of another format (an older worker's) cannot be compared: never a conflict
    known = known ~= digest and string.sub(known, 1, 2) == string.sub(digest, 1, 2) and known
  end
  if known then
    for _ = 1, #fields / 4 do
      conflicts[#conflicts + 1] = position
      result, position = result + 1, position + 1
    end
  else
    for first = 1, #fields, 4000 do  -- unpack() has a limit on values
      local old = redis.call('BITFIELD', KEYS[i + 1], unpack(fields, first, math.min(first + 3999, #fields)))
      for j, bit in ipairs(old) do
        if bit == 1 then  -- published before: a repeat, unless it answers a failure a requeue kept
          bit = anew(KEYS[2 * m + 1 + i], slots[(first - 1) / 4 + j], ARGV[result]) and 0 or 1
        end
        if bit == 0 then
          entry[2] = ARGV[result]
          redis.call('XADD', KEYS[1], '*', unpack(entry))
          if review[position] then
            redis.call('XADD', KEYS[3 * m + 3], '*', 'data', ARGV[result], 'text', review[position])
            reviewed = true
          end
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
if reviewed then
  redis.call('XTRIM', KEYS[3 * m + 3], 'MAXLEN', '~', ARGV[1])
end
for i = 3 * m + 5, #KEYS do
  redis.call('DEL', KEYS[i])
end
-- cjson writes an empty table as {}; the caller reads a missing list as empty either way.
redis.call('SET', call_key, cjson.encode({repeats, conflicts}), 'EX', ARGV[4])
return {repeats, conflicts}
