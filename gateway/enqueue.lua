-- A POST's new tickets into the queue in one atomic step (gateway.enqueue): which of its tickets were
-- accepted before (their markers), the hard bound on the queue's depth, the packed message pushed and
-- a marker written for each ticket it carries. Nothing is written unless all of it is.
-- KEYS[1]: the list the message goes to (the queue's own, ticketq.names.queue_lists(queue)[1]).
-- KEYS[2 .. ARGV[1]]: the queue's other lists (kombu's priority steps): counted, never written.
-- KEYS[ARGV[1] + 1]: the gateway's ledger of the messages it queued (gateway.keys.QUEUED_KEY): a list,
--          newest first, of `<running total of tickets>:<tickets of that message>`.
-- KEYS[ARGV[1] + 2 ..]: the POST's ticket markers (gateway.keys.TICKET_KEY), one per ticket.
-- ARGV[1]: how many queue lists; ARGV[2]: the bound (TICKETQ_GATEWAY_MAX_QUEUE_DEPTH, in tickets);
-- ARGV[3]: a marker's lifetime, s; ARGV[4]: the message; ARGV[5]: which tickets it carries, '1' or
-- '0' per marker; ARGV[6 ..]: the marker of each ticket it carries, in order.
-- Returns {outcome, depth, marker...}, each marker as it was before this step (or false):
--   1 pushed; 0 every ticket had a marker (nothing to send); -1 the tickets without a marker are not
--   those the message carries (a concurrent POST took some: build it again); -2 the depth before
--   this POST plus its new tickets would pass the bound. Nothing is written unless 1.
--
-- The depth, in tickets: waiting messages are the newest ones (a FIFO list), so with the gateway as
-- the only sender they are its newest LLEN ledger entries, summed from two running totals. Another
-- sender's message counts as one ticket (as LLEN counts it), and a gateway message taken while a
-- younger one of another sender waits is still counted: never less than what waits.
local lists = tonumber(ARGV[1])
local ledger = KEYS[lists + 1]
local markers, new, same = {}, 0, true
for i = lists + 2, #KEYS do
  local marker = redis.call('GET', KEYS[i])
  local n = #markers + 1
  markers[n] = marker
  if not marker then new = new + 1 end
  if (marker and '0' or '1') ~= string.sub(ARGV[5], n, n) then same = false end
end
if new == 0 then return {0, 0, unpack(markers)} end
if not same then return {-1, 0, unpack(markers)} end
local waiting = 0
for i = 1, lists do waiting = waiting + redis.call('LLEN', KEYS[i]) end
local length = redis.call('LLEN', ledger)
local kept = math.min(length, waiting)
local total, depth = 0, waiting
if length > 0 then total = tonumber(string.match(redis.call('LINDEX', ledger, 0), '^(%d+):')) end
if kept > 0 then  -- the oldest entry still waiting, indexed from the tail: near it, the list is trimmed each push
  local before, size = string.match(redis.call('LINDEX', ledger, kept - 1 - length), '^(%d+):(%d+)$')
  depth = total - tonumber(before) + tonumber(size) + waiting - kept
end
if depth + new > tonumber(ARGV[2]) then return {-2, depth, unpack(markers)} end
-- The push first: on a full Redis (noeviction) it is the step's first write, refused before any other.
redis.call('LPUSH', KEYS[1], ARGV[4])
local record = 6
for i = 1, #markers do
  if not markers[i] then
    redis.call('SET', KEYS[lists + 1 + i], ARGV[record], 'EX', ARGV[3])
    record = record + 1
  end
end
redis.call('LPUSH', ledger, (total + new) .. ':' .. new)
redis.call('LTRIM', ledger, 0, waiting)
return {1, depth, unpack(markers)}
