-- Check room on every credit and record a HELD reservation with a GRANT notice, atomically.
-- KEYS[1] info HASH, KEYS[2] lease HASH, KEYS[3] reservations HASH, KEYS[4] notices STREAM,
-- KEYS[5] reservation expiries ZSET.
-- ARGV[1] now_ms, ARGV[2] share (0..1, exact float text), ARGV[3] hold expires_at_ms,
-- ARGV[4] reservation id, ARGV[5] request id, ARGV[6..10] debit c1..c5, ARGV[11] notices MAXLEN,
-- ARGV[12] owner (the granted router's identity, '' without authentication).
-- Returns {refusal} for an unknown node; {refusal, epoch, version} for cordoned, no_lease,
-- expired, zero_lease; {'short', epoch, version, 'name,name'} (1-based credit indexes);
-- {'granted', epoch, version, grant_seq}.
local info, lease, res, notices, exp = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now, share, maxlen = ARGV[1], tonumber(ARGV[2]), ARGV[11]

if redis.call('EXISTS', info) == 0 then
  return {'unknown_node'}
end
local _, open = cf_purge_expired(info, res, exp, notices, maxlen, now)
local l = redis.call('HMGET', lease, 'epoch', 'version', 'exp', 'zero', 'c1', 'c2', 'c3', 'c4', 'c5')
local epoch, version = l[1] or '0', l[2] or '0'
if redis.call('HGET', info, 'cordoned') == '1' then
  return {'cordoned', epoch, version}
end
if not l[1] then
  return {'no_lease', epoch, version}
end
if tonumber(l[3]) <= tonumber(now) then
  return {'expired', epoch, version}
end
if l[4] ~= '' then
  return {'zero_lease', epoch, version}
end
open = open or cf_totals(info)
local short = {}
for c = 1, 5 do
  local room = math.floor(tonumber(l[4 + c]) * share) - open[c]
  if tonumber(ARGV[5 + c]) > room then
    short[#short + 1] = tostring(c)
  end
end
if #short > 0 then
  return {'short', epoch, version, table.concat(short, ',')}
end
local f = {'held', ARGV[3], '0', ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], now, '0', epoch,
  version, ARGV[12], ARGV[5]}
local seq = cf_notice(info, notices, maxlen, 'grant', ARGV[4], f, now)
f[10] = seq
cf_put(info, res, exp, ARGV[4], f, false)
cf_add(open, f, 1)
cf_set_totals(info, open)
return {'granted', epoch, version, seq}
