-- Drop one lender index bucket's expired lenders, then draw some of the rest (a renewal of the
-- admission view sends one call per bucket: half the commands of a ZREMRANGEBYSCORE and a
-- ZRANDMEMBER each, and half the replies to parse).
-- KEYS[1] lender bucket ZSET (node id -> lease expiry ms).
-- ARGV[1] now_ms, ARGV[2] how many to draw.
-- Returns the drawn lenders as a flat list {node id, expiry, node id, expiry, ...}.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
return redis.call('ZRANDMEMBER', KEYS[1], ARGV[2], 'WITHSCORES')
