-- Delete one node's keys: by hand (DeleteNode), or when it has gone away (node expiry).
-- KEYS[1] info HASH, KEYS[2] lease HASH, KEYS[3] reservations HASH, KEYS[4] notices STREAM,
-- KEYS[5] lease history LIST, KEYS[6] node events LIST, KEYS[7] reservation expiries ZSET
-- (all one node, one hash tag).
-- ARGV[1] now_ms, ARGV[2] '1' to delete whatever the reservations ('force'), else '0',
-- ARGV[3] seen cutoff (ms): delete only when the node was last heard of before it ('' for any).
-- Returns {'not_found'}; {'recent', seen} when heard of since the cutoff; {'open', count}
-- when reservations still count at now and force is '0'; {'ok', count} once deleted (count:
-- the reservations that still counted).
local info = KEYS[1]
local now, force, cutoff = tonumber(ARGV[1]), ARGV[2], ARGV[3]
if redis.call('EXISTS', info) == 0 then
  return {'not_found'}
end
local seen = redis.call('HGET', info, 'seen') or '0'
if cutoff ~= '' and tonumber(seen) >= tonumber(cutoff) then
  return {'recent', seen}
end
local open = 0
local all = redis.call('HGETALL', KEYS[3])
for i = 2, #all, 2 do
  local bar = string.find(all[i], '|', 1, true)
  local rest = string.sub(all[i], bar + 1)
  local exp = tonumber(string.sub(rest, 1, string.find(rest, '|', 1, true) - 1))
  if exp > now then
    open = open + 1
  end
end
if open > 0 and force ~= '1' then
  return {'open', open}
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
return {'ok', open}
