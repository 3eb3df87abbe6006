-- HELD/COMMITTED -> RELEASED with a RELEASE notice whose sequence becomes release_seq; the
-- reservation keeps counting until a lease with last_notice_seq >= release_seq purges it.
-- KEYS[1] info HASH, KEYS[2] reservations HASH, KEYS[3] notices STREAM,
-- KEYS[4] reservation expiries ZSET.
-- ARGV[1] now_ms, ARGV[2] reservation id, ARGV[3] notices MAXLEN, ARGV[4] the owner the
-- reservation must have ('*': any).
-- Returns {'not_found'}, {'expired'} (purged with an EXPIRE notice), {'not_owner'} (nothing
-- changed) or {'ok', record}.
local info, res, notices, exp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, rid, maxlen = ARGV[1], ARGV[2], ARGV[3]

local f, rec = cf_live_reservation(info, res, exp, notices, maxlen, now, rid)
if not f then
  return {rec}
end
if ARGV[4] ~= '*' and f[13] ~= ARGV[4] then
  return {'not_owner'}
end
if f[1] == 'released' then
  return {'ok', rec}
end
local seq = cf_notice(info, notices, maxlen, 'release', rid, f, now)
f[1] = 'released'
f[3] = seq
rec = cf_format(f)
cf_put(info, res, exp, rid, f, false)
return {'ok', rec}
