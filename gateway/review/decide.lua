-- Write a reviewer's decision on one review item once: the first decision wins. The item must be
-- pending under its tenant's consumer (sort.lua put it there); the decision acks it (XACK), goes to
-- the labelled stream, and is kept under the item's decision key so that a later reviewer is told
-- who decided it and when. A second decision finds the key (or the item no longer pending) and
-- writes nothing. Optionally the corrected result is added to the results stream, where the
-- dispatcher delivers it like any result.
-- KEYS[1] the review stream, KEYS[2] the labelled stream (names.LABELLED_STREAM), KEYS[3] the item's
-- decision key (gateway.keys.REVIEW_DECISION_KEY), KEYS[4] the results stream (names.RESULTS_STREAM).
-- ARGV[1] the consumer group, ARGV[2] the item's entry id, ARGV[3] its tenant's consumer, ARGV[4] the
-- decision record JSON (ticketq.labelled), ARGV[5] the decision key's expiry in seconds, ARGV[6] the
-- corrected result JSON to deliver ('' = none), ARGV[7] the results stream's MAXLEN (approximate).
-- Returns {1, labelled entry id} when written; {0, the first decision JSON} when decided before;
-- {0} when the item is not pending for this tenant (another tenant's, or gone).
local first = redis.call('GET', KEYS[3])
if first then
  return {0, first}
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #pending == 0 then
  return {0}
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
local written = redis.call('XADD', KEYS[2], '*', 'data', ARGV[4])
redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[5])
if ARGV[6] ~= '' then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[6])
end
return {1, written}
