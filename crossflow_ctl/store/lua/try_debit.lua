-- Check room on every credit and record a HELD reservation with a GRANT notice, atomically, for
-- each of one or more debits on ONE node, in order (each sees the ones before it).
-- KEYS[1] info HASH, KEYS[2] lease HASH, KEYS[3] reservations HASH, KEYS[4] notices STREAM,
-- KEYS[5] reservation expiries ZSET.
-- KEYS[6..] request record STRINGs (standalone Redis only: they lie in other slots).
-- ARGV[1] now_ms, ARGV[2] the credits' shares "s1,s2,s3,s4,s5" (each 0..1, exact float text;
-- ``packed_shares`` in crossflow_ctl/store/redis_debit.py), ARGV[3] hold expires_at_ms,
-- ARGV[4] notices MAXLEN, then ONE packed argument per debit (``DebitCall.packed`` in
-- crossflow_ctl/store/redis_debit.py): "rid,c1,c2,c3,c4,c5,us,p,r,ttl,nq,no,nh:" then the
-- request id (nq bytes), the owner (the granted router's identity, '' without authentication;
-- no bytes), the record's head (nh bytes) and its tail (the rest): rid the reservation id, c1..c5
-- the debit, us the node microseconds behind its compute ('0': untimed), p the prefix tokens
-- its kv_transfer pulls in (its GRANT notice's 'p'; '': left out), r the index of its
-- request record's key in KEYS ('0': none), ttl the record's TTL in
-- ms; a grant records head .. '"lease_epoch":E,"lease_version":V' .. tail. The header holds no
-- ':' (ids and numbers only).
-- Returns one reply per debit, in order: {refusal} for an unknown node; {refusal, epoch,
-- version} for cordoned, no_lease, expired, zero_lease; {'recorded', epoch, version, record,
-- open} when its request record already exists (nothing debited); {'short', epoch, version,
-- 'i,i', open} (1-based credit indexes); {'granted', epoch, version, grant_seq, open}, where
-- open is the node's open debits after that debit, "c1,c2,c3,c4,c5,count,us,timed" (exact at
-- now_ms: expired reservations are purged first), so the replica can refresh its cached view of
-- the node without reading it again.
-- Safety is crossflow_ctl/domain/safety.py's: open + debit <= floor(lease x share), per credit
-- at that credit's share, the compute of the open debits with the debit in the lease's unit
-- (cf_compute_after at the lease's 'rate': the state after the grant, never the debit's own ceil
-- against the room).
local info, lease, res, notices, exp = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now, expires, maxlen = ARGV[1], ARGV[3], ARGV[4]
local share = {string.match(ARGV[2], '^([^,]*),([^,]*),([^,]*),([^,]*),([^,]*)$')}
local count = #ARGV - 4

-- One packed debit: its header fields (h[1] reservation id, h[2..6] c1..c5, h[7] us, h[8]
-- pulled tokens, h[9] record key index, h[10] record TTL) and its request id, owner, record head
-- and record tail. The header is read by one pattern match (one C call, not one iteration per
-- field).
local HEADER = '^([^,]*),([^,]*),([^,]*),([^,]*),([^,]*),([^,]*),([^,]*),([^,]*),([^,]*),'
  .. '([^,]*),(%d+),(%d+),(%d+):()'
local function unpack_debit(packed)
  local h = {string.match(packed, HEADER)}
  local owner_at = h[14] + tonumber(h[11])
  local head_at = owner_at + tonumber(h[12])
  local tail_at = head_at + tonumber(h[13])
  return h, string.sub(packed, h[14], owner_at - 1), string.sub(packed, owner_at, head_at - 1),
    string.sub(packed, head_at, tail_at - 1), string.sub(packed, tail_at)
end

local function each(reply)
  local out = {}
  for i = 1, count do
    out[i] = reply
  end
  return out
end

local node = redis.call('HMGET', info, 'role', 'cordoned', 'open')
if not node[1] then
  return each({'unknown_node'})
end
local open = cf_totals_of(node[3])
local purged = cf_purge_expired(info, res, exp, notices, maxlen, now, open)
local l = redis.call('HMGET', lease, 'epoch', 'version', 'exp', 'zero', 'c1', 'c2', 'c3', 'c4', 'c5',
  'rate')
local epoch, version = l[1] or '0', l[2] or '0'
local refusal = nil
if node[2] == '1' then
  refusal = 'cordoned'
elseif not l[1] then
  refusal = 'no_lease'
elseif tonumber(l[3]) <= tonumber(now) then
  refusal = 'expired'
elseif l[4] ~= '' then
  refusal = 'zero_lease'
end
if refusal then
  if purged > 0 then
    cf_set_totals(info, open)
  end
  return each({refusal, epoch, version})
end
local limit = {}
for c = 1, 5 do
  limit[c] = math.floor(tonumber(l[4 + c]) * tonumber(share[c]))
end
local rate = tonumber(l[10] or '0')
local out = {}
local granted = false
local totals = nil
for i = 1, count do
  local h, request_id, owner, head, tail = unpack_debit(ARGV[4 + i])
  local us = tonumber(h[7])
  local r = tonumber(h[9])
  local record_key = r > 0 and KEYS[5 + r] or nil
  local recorded = record_key and redis.call('GET', record_key)
  local short = {}
  if cf_compute_after(open, tonumber(h[2]), us, rate) > limit[1] then
    short[1] = '1'
  end
  for c = 2, 5 do
    if tonumber(h[1 + c]) > limit[c] - open[c] then
      short[#short + 1] = tostring(c)
    end
  end
  if recorded then
    totals = cf_totals_text(open)
    out[#out + 1] = {'recorded', epoch, version, recorded, totals}
  elseif #short > 0 then
    totals = cf_totals_text(open)
    out[#out + 1] = {'short', epoch, version, table.concat(short, ','), totals}
  else
    local f = {'held', expires, '0', h[2], h[3], h[4], h[5], h[6], now, '0', epoch, version,
      owner, request_id, us = h[7]}
    local seq = cf_notice(info, notices, maxlen, 'grant', h[1], f, now, h[8])
    f[10] = seq
    cf_put(info, res, exp, h[1], f, false)
    cf_add(open, f, 1)
    granted = true
    if record_key then
      redis.call('SET', record_key, head .. '"lease_epoch":' .. epoch .. ',"lease_version":'
        .. version .. tail, 'PX', h[10])
    end
    totals = cf_totals_text(open)
    out[#out + 1] = {'granted', epoch, version, seq, totals}
  end
end
if granted or purged > 0 then
  redis.call('HSET', info, 'open', totals) -- the last reply's totals: the node's after all
end
return out
