-- Register a node on agent Hello, keeping its identity: a registered node that is not cordoned
-- keeps its role and pool (a Hello naming others is refused and changes nothing).
-- KEYS[1] info HASH.
-- ARGV[1] role, ARGV[2] pool, ARGV[3] labels JSON, ARGV[4] now_ms (when it was last heard of,
-- and when it was first registered: 'registered' is set once).
-- Returns {'identity', stored role, stored pool} when refused, else {'ok', info fields as a
-- flat HGETALL list}.
local info = KEYS[1]
local cur = redis.call('HMGET', info, 'role', 'pool', 'cordoned')
if cur[1] and cur[3] ~= '1' and (cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2]) then
  return {'identity', cur[1], cur[2] or ''}
end
redis.call('HSET', info, 'role', ARGV[1], 'pool', ARGV[2], 'labels', ARGV[3], 'seen', ARGV[4])
redis.call('HSETNX', info, 'cordoned', '0')
redis.call('HSETNX', info, 'cordon_reason', '')
redis.call('HSETNX', info, 'seq', '0')
redis.call('HSETNX', info, 'registered', ARGV[4])
return {'ok', redis.call('HGETALL', info)}
