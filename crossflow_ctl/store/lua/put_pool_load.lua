-- Record one prefill server's load report and drop the pool's expired reports.
-- KEYS[1] pool reports HASH, KEYS[2] pool report expiries ZSET (same hash tag: one pool).
-- ARGV[1] now_ms, ARGV[2] reporting node id, ARGV[3] stored report JSON, ARGV[4] expires_at_ms.
-- Returns the number of expired reports dropped.
local reports, expiries = KEYS[1], KEYS[2]
redis.call('HSET', reports, ARGV[2], ARGV[3])
redis.call('ZADD', expiries, ARGV[4], ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', expiries, '-inf', ARGV[1])
for i = 1, #gone do
  redis.call('HDEL', reports, gone[i])
end
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', expiries, '-inf', ARGV[1])
end
return #gone
