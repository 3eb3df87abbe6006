-- Write the shared policy if its stored version is the expected one (compare-and-set).
-- KEYS[1] policy HASH (fields 'version' and 'json').
-- ARGV[1] expected version ('0': none stored), ARGV[2] new version, ARGV[3] policy JSON.
-- Returns {1, new version} when written, {0, stored version} when refused (nothing changed).
local stored = redis.call('HGET', KEYS[1], 'version') or '0'
if stored ~= ARGV[1] then
  return {0, stored}
end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'json', ARGV[3])
return {1, ARGV[2]}
