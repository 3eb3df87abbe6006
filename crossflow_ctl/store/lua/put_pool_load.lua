-- Record one prefill server's load report with the pool's next ingest sequence, and drop the
-- pool's expired reports.
-- KEYS[1] pool reports HASH, KEYS[2] pool report expiries ZSET, KEYS[3] pool ingest sequence
-- STRING (INCR counter); one hash tag: one pool, one slot.
-- ARGV[1] now_ms, ARGV[2] reporting node id, ARGV[3] stored report JSON, a compact object
-- without "seq" (the sequence is spliced in as its last member), ARGV[4] expires_at_ms.
-- Returns the number of expired reports dropped.
local reports, expiries = KEYS[1], KEYS[2]
local seq = redis.call('INCR', KEYS[3])
local report = string.sub(ARGV[3], 1, -2) .. ',"seq":' .. seq .. '}'
redis.call('HSET', reports, ARGV[2], report)
redis.call('ZADD', expiries, ARGV[4], ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', expiries, '-inf', ARGV[1])
for i = 1, #gone do
  redis.call('HDEL', reports, gone[i])
end
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', expiries, '-inf', ARGV[1])
end
return #gone
