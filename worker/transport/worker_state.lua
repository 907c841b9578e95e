-- The atomic fetch's and the leases' Redis state: every change a consumer makes to it, or a live
-- worker makes to a dead consumer's, is one command of this script (worker/transport/state.py).
--
-- KEYS, the same positions for every command (a command leaves alone those it does not use):
--   KEYS[1]  unacked_index                  zset    kombu's: delivery tag -> unix time recorded
--   KEYS[2]  unacked                        hash    kombu's: delivery tag -> [message, exchange, routing key]
--   KEYS[3]  ticketq:owned:<c>              set     the delivery tags consumer <c> holds unacked
--   KEYS[4]  ticketq:fetching:<c>:<queue>   list    messages between their fetch (BLMOVE) and their record
--   KEYS[5]  ticketq:alive:<c>              string  <c>'s lease: exists while it beats (TTL TICKETQ_LEASE_S)
--   KEYS[6]  ticketq:consumers              hash    consumer -> {host, pid, queues, since}: whom recovery checks
--   KEYS[7]  <queue>                        list    the queue
--   KEYS[8…] restore only: the lists a restored message goes to (kombu's per-priority lists)
--
-- ARGV[1] the command, ARGV[2] the consumer <c>, then its arguments:
--   claim    (tag, record, item)…        record fetched messages unacked (at Redis's TIME) and owned by
--                                        <c>, each taken from <c>'s fetching list (item '' when not
--                                        fetched); an item no longer there and not <c>'s already
--                                        (recovered by another worker) is not recorded
--   ack      tag…                        forget acked messages <c> still owns (deletions only: a full
--                                        Redis runs it)
--   beat     ttl_ms, info                renew <c>'s lease and its consumer entry
--   requeue                              <c>'s fetching list back to the queue, at its consuming end
--   release                              drop <c>'s lease; forget <c> when it owns nothing
--   restore  tag, (op, payload)…         put one unacked message of <c> back (op: lpush or rpush on
--                                        KEYS[8…], in order), only while <c> still owns it and its
--                                        record exists; the tag leaves <c>'s set either way
--   forget                               drop <c>'s owned set and consumer entry (after its recovery)
-- claim returns one flag per record (1: recorded); the others a count: messages acked, moved or
-- restored (1 for release, forget; for beat 1 when <c> was not registered: its first beat, or it
-- was recovered as dead meanwhile).

local command, consumer = ARGV[1], ARGV[2]

if command == 'claim' then
  -- Redis's clock, not the worker's: the visibility sweep compares these with Redis's TIME too.
  local time = redis.call('TIME')
  local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
  local claimed = {}
  for i = 3, #ARGV, 3 do
    local tag, record, item = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    -- Already <c>'s: this call is a retry of one whose reply was lost (redis-py retries on a timeout).
    if item == '' or redis.call('LREM', KEYS[4], 1, item) == 1 or redis.call('SISMEMBER', KEYS[3], tag) == 1 then
      redis.call('ZADD', KEYS[1], string.format('%.6f', now), tag)
      redis.call('HSET', KEYS[2], tag, record)
      redis.call('SADD', KEYS[3], tag)
      claimed[#claimed + 1] = 1
    else
      claimed[#claimed + 1] = 0
    end
  end
  return claimed

elseif command == 'ack' then
  -- Only what <c> still owns: a message another worker took over (restored when <c>'s lease
  -- ran out, perhaps fetched again under the same tag) is the new owner's to ack.
  local acked = 0
  for i = 3, #ARGV do
    if redis.call('SREM', KEYS[3], ARGV[i]) == 1 then
      redis.call('ZREM', KEYS[1], ARGV[i])
      redis.call('HDEL', KEYS[2], ARGV[i])
      acked = acked + 1
    end
  end
  return acked

elseif command == 'beat' then
  redis.call('SET', KEYS[5], ARGV[4], 'PX', ARGV[3])
  return redis.call('HSET', KEYS[6], consumer, ARGV[4])

elseif command == 'requeue' then
  local moved = 0
  while redis.call('LMOVE', KEYS[4], KEYS[7], 'RIGHT', 'RIGHT') do
    moved = moved + 1
  end
  return moved

elseif command == 'release' then
  redis.call('DEL', KEYS[5])
  if redis.call('SCARD', KEYS[3]) == 0 then
    redis.call('HDEL', KEYS[6], consumer)
  end
  return 1

elseif command == 'restore' then
  local tag = ARGV[3]
  local owned = redis.call('SREM', KEYS[3], tag) == 1
  if not owned or redis.call('HEXISTS', KEYS[2], tag) == 0 then
    return 0
  end
  redis.call('ZREM', KEYS[1], tag)
  redis.call('HDEL', KEYS[2], tag)
  local target = 8
  for i = 4, #ARGV, 2 do
    redis.call(ARGV[i], KEYS[target], ARGV[i + 1])
    target = target + 1
  end
  return 1

elseif command == 'forget' then
  redis.call('DEL', KEYS[3])
  redis.call('HDEL', KEYS[6], consumer)
  return 1
end

return redis.error_reply('worker_state: unknown command ' .. tostring(command))
