-- Store a lease if (epoch, version) is newer than the stored one; purge reservations.
-- KEYS[1] info HASH, KEYS[2] lease HASH, KEYS[3] reservations HASH, KEYS[4] notices STREAM,
-- KEYS[5] lease history LIST, KEYS[6] node events LIST, KEYS[7] reservation expiries ZSET
-- (all one node, one hash tag).
-- ARGV[1] now_ms (broker clock), ARGV[2] the lease as one history entry (JSON: the history LIST
-- is a log of past leases, read whole by lease_history, so it stays one JSON per entry),
-- ARGV[3] history cap, ARGV[4] events cap, ARGV[5] notices MAXLEN,
-- ARGV[6..] the lease HASH as field/value pairs (every field, see LEASE_FIELDS in
-- crossflow_ctl/store/redis_codec.py): the one stored form of the current lease. The script
-- reads ev ("<epoch:020d><version:020d>", 40 digits compared as text so 63-bit values stay
-- exact), epoch, version, zero ('' when the lease lends) and nseq (last_notice_seq) from them.
-- An accepted lease also marks the node as heard of now (info 'seen', read by node expiry).
-- Returns {-1} for an unregistered node; {0, stored_epoch, stored_version, 0} for a stale lease
-- (nothing changed); {1, epoch, version, purged, cordoned(0/1)} when stored.
local info, lease, res, notices, history, events = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local exp = KEYS[7]
local now, maxlen = ARGV[1], ARGV[5]
local new = {}
for i = 6, #ARGV - 1, 2 do
  new[ARGV[i]] = ARGV[i + 1]
end
local ev, epoch, zero, last_seen = new.ev, new.epoch, new.zero, tonumber(new.nseq)

if redis.call('EXISTS', info) == 0 then
  return {-1}
end
local old = redis.call('HMGET', lease, 'ev', 'epoch', 'version', 'exp', 'zero')
if old[1] and ev <= old[1] then
  return {0, old[2], old[3], 0}
end

local purged = cf_purge_expired(info, res, exp, notices, maxlen, now)
local all = redis.call('HGETALL', res)
for i = 1, #all, 2 do
  local f = cf_parse(all[i + 1])
  if f[1] == 'released' and tonumber(f[3]) <= last_seen then
    cf_drop(info, res, exp, all[i], f)
    purged = purged + 1
  end
end

local function event(kind, message)
  redis.call('LPUSH', events, now .. '|' .. kind .. '|' .. message)
end
if not old[1] or old[2] ~= epoch then
  event('new_epoch', 'new epoch ' .. epoch)
end
if zero ~= '' and (not old[1] or old[5] == '') then
  event('lease_zeroed', 'lease zeroed: ' .. zero)
elseif zero == '' and old[1] and (old[5] ~= '' or tonumber(old[4]) <= tonumber(now)) then
  event('lease_restored', 'lease restored')
end
redis.call('LTRIM', events, 0, tonumber(ARGV[4]) - 1)

-- Replace the hash whole, so no field of an older layout (such as a JSON copy) outlives it.
redis.call('DEL', lease)
redis.call('HSET', lease, unpack(ARGV, 6))
redis.call('HSET', info, 'seen', now)
redis.call('LPUSH', history, ARGV[2])
redis.call('LTRIM', history, 0, tonumber(ARGV[3]) - 1)
local cordoned = 0
if redis.call('HGET', info, 'cordoned') == '1' then
  cordoned = 1
end
return {1, epoch, new.version, purged, cordoned}
