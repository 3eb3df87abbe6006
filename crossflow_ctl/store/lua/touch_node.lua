-- Mark a registered node as heard of now (a prefill agent's pool load; leases do it themselves).
-- KEYS[1] info HASH.
-- ARGV[1] now_ms.
-- Returns 1 when the node is registered, else 0 (and nothing is written: no ghost node).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'seen', ARGV[1])
return 1
