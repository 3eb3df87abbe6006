-- HELD -> COMMITTED with a new expiry and a COMMIT notice; committing twice changes nothing.
-- KEYS[1] info HASH, KEYS[2] reservations HASH, KEYS[3] notices STREAM,
-- KEYS[4] reservation expiries ZSET.
-- ARGV[1] now_ms, ARGV[2] reservation id, ARGV[3] commit expires_at_ms, ARGV[4] notices MAXLEN,
-- ARGV[5] the owner the reservation must have ('*': any).
-- Returns {'not_found'}, {'expired'} (the reservation is purged with an EXPIRE notice),
-- {'not_owner'} (nothing changed),
-- {'released', record} or {'ok', record} (the record as stored after the call).
local info, res, notices, exp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, rid, maxlen = ARGV[1], ARGV[2], ARGV[4]

local f, rec = cf_live_reservation(info, res, exp, notices, maxlen, now, rid)
if not f then
  return {rec}
end
if ARGV[5] ~= '*' and f[13] ~= ARGV[5] then
  return {'not_owner'}
end
if f[1] == 'released' then
  return {'released', rec}
end
if f[1] == 'committed' then
  return {'ok', rec}
end
f[1] = 'committed'
f[2] = ARGV[3]
rec = cf_format(f)
cf_put(info, res, exp, rid, f, false)
cf_notice(info, notices, maxlen, 'commit', rid, f, now)
return {'ok', rec}
