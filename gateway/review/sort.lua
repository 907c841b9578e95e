-- Hand the review stream's new entries to their tenants: each entry the review group has not read
-- yet is read (XREADGROUP '>') and claimed at once by the consumer of its ticket's tenant, where it
-- stays pending until a reviewer decides it (decide.lua acks it). One script: no entry can be read
-- and left unclaimed by a crash in between, so no tenant's item is ever stranded.
-- The tenant is the gateway's (`gateway.intake.Intake.wire_id`): with several tenants the result's
-- `id` is `tenant:id`; an id without ':' (a ticket sent past the gateway), or one tenant, is `default`.
-- KEYS[1] the review stream (names.REVIEW_STREAM).
-- ARGV[1] the consumer group (names.REVIEW_GROUP), ARGV[2] the reading consumer's name, ARGV[3] the
-- most entries to read, ARGV[4] '1' with several tenants, ARGV[5] the prefix of a tenant's consumer.
-- Returns the number of entries handed out.
local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if not read then
  return 0
end
local handed = 0
for _, entry in ipairs(read[1][2]) do
  local id, fields, tenant = entry[1], entry[2], 'default'
  for i = 1, #fields, 2 do
    if fields[i] == 'data' and ARGV[4] == '1' then
      local ok, result = pcall(cjson.decode, fields[i + 1])
      if ok and type(result) == 'table' and type(result.id) == 'string' then
        tenant = string.match(result.id, '^([^:]+):') or 'default'
      end
    end
  end
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[5] .. tenant, 0, id, 'JUSTID')
  handed = handed + 1
end
return handed
