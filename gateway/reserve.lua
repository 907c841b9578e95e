-- A POST's room in the queue, checked and reserved in one step (gateway.capacity), with the
-- markers of its tickets read in the same step (which of them were accepted before).
-- KEYS[1]: the reservations (gateway.keys.RESERVED_KEY), a sorted set: member `<uuid>:<count>`,
--          score the unix ms it lapses at (a gateway that died between reserve and release).
-- KEYS[2 .. 1+ARGV[1]]: the queue's lists (ticketq.names.queue_lists).
-- KEYS[2+ARGV[1] ..]: the POST's ticket markers (gateway.keys.TICKET_KEY).
-- ARGV[1]: how many queue lists; ARGV[2]: the bound (TICKETQ_GATEWAY_MAX_QUEUE_DEPTH);
-- ARGV[3]: a reservation's lifetime, ms; ARGV[4]: this POST's uuid.
-- Returns {depth, new, granted, marker...}: depth = waiting messages + live reservations before this
-- POST; new = its tickets without a marker; granted = 1 when `<uuid>:<new>` was reserved (new > 0 and
-- depth + new <= bound), else 0; each marker's value or false.
local lists = tonumber(ARGV[1])
local markers, new = {}, 0
for i = 2 + lists, #KEYS do
  local marker = redis.call('GET', KEYS[i])
  markers[#markers + 1] = marker
  if not marker then new = new + 1 end
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local depth = 0
for i = 2, 1 + lists do depth = depth + redis.call('LLEN', KEYS[i]) end
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  depth = depth + tonumber(string.match(member, ':(%d+)$'))
end
local granted = 0
if new > 0 and depth + new <= tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[4] .. ':' .. new)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  granted = 1
end
return {depth, new, granted, unpack(markers)}
