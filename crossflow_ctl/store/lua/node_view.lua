-- Read one node as admission sees it (read only): info, stored lease, open debits at now.
-- KEYS[1] info HASH, KEYS[2] lease HASH, KEYS[3] reservations HASH,
-- KEYS[4] reservation expiries ZSET.
-- ARGV[1] now_ms.
-- Returns {} for an unknown node, else {{role, pool, labels, cordoned, cordon_reason, registered,
-- seq} (info
-- fields in this order, HMGET), the lease HASH as a flat HGETALL list ({} when none), c1, c2,
-- c3, c4, c5, count, us, timed}: the debits and number of reservations counting at now, and the
-- node time behind their compute with the timed debits' compute tokens (running totals less the
-- expired ones no write has purged yet).
local info, lease, res, exp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('EXISTS', info) == 0 then
  return {}
end
local t = cf_totals(info)
local expired = cf_expired(res, exp, ARGV[1])
for i = 1, #expired do
  cf_add(t, expired[i], -1)
end
local fields = redis.call(
  'HMGET', info, 'role', 'pool', 'labels', 'cordoned', 'cordon_reason', 'registered', 'seq'
)
for i = 1, 7 do
  fields[i] = fields[i] or ''
end
local out = {fields, redis.call('HGETALL', lease)}
for i = 1, 8 do
  out[#out + 1] = cf_int(t[i])
end
return out
