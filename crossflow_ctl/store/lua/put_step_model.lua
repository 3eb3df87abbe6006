-- Store a registered node's latest step model (its agent's online calibration, JSON).
-- KEYS[1] info HASH.
-- ARGV[1] the report JSON.
-- Returns 1 when the node is registered, else 0 (and nothing is written: no ghost node).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'stepmodel', ARGV[1])
return 1
