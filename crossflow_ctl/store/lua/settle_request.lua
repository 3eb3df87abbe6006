-- Settle a request record: store the outcome only if the record is still pending, so that of a
-- call and a retry that gives up on it exactly one outcome wins.
-- KEYS[1] request record STRING.
-- ARGV[1] the pending marker, ARGV[2] outcome, ARGV[3] TTL (ms).
-- Returns {1} when written, else {0, what is stored ('' when nothing: expired or never claimed)}.
local stored = redis.call('GET', KEYS[1])
if stored ~= ARGV[1] then
  return {0, stored or ''}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1}
