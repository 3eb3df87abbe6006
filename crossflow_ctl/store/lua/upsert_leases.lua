-- Store each of a batch of leases if its (epoch, version) is newer than the node's stored one;
-- purge the node's expired and acknowledged-released reservations. One call per batch (per
-- Cluster slot: every node of a call shares the slot), each lease checked on its own and a
-- failing lease (say a key of the wrong type) failing only itself.
-- KEYS: K per lease (ARGV[5]: 7 or 8), lease i (from 0) at K*i+1..K*i+K: info HASH, lease
-- HASH, reservations HASH, notices STREAM, lease history LIST, node events LIST, reservation
-- expiries ZSET (all one node, one hash tag); with K = 8 also the node's lender index bucket
-- ZSET (another hash tag: a standalone Redis only, never a Cluster), which a stored lease then
-- updates in the same step: member node_id scored by the lease expiry when the lease lends and
-- the node is not cordoned, removed otherwise (best effort: an index write that fails leaves
-- the stored lease stored and accepted).
-- ARGV[1] history cap, ARGV[2] events cap, ARGV[3] notices MAXLEN, ARGV[4] the lease HASH's
-- field names joined by '|' (LEASE_FIELDS in crossflow_ctl/store/redis_codec.py, 'detail'
-- last), ARGV[5] K; then two per lease, lease i at ARGV[6+2i] and ARGV[7+2i]:
--   changed: '' to write every field, else one byte per field (1: changed, 0: not) followed by
--     the ev and recv values of the lease the bytes compare against (redis_ingest.py: the last
--     lease this replica sent for the node). Only the changed fields are written when the
--     hash holds that lease (its ev and recv, which no other lease shares, and all its fields);
--     otherwise every field is, as with ''.
--   packed: the lease HASH's values in that order, joined by '\31' (only the last, the
--     free-text detail, may hold that byte): the lease's one serialized form, also pushed whole
--     onto the history LIST (a log of past leases, read by lease_history).
-- The script reads ev ("<epoch:020d><version:020d>", 40 digits compared as text so 63-bit
-- values stay exact), epoch, version, exp (the expiry, broker clock), zero ('' when the lease
-- lends), node, nseq (last_notice_seq) and recv (when the broker received it: "now" for that
-- lease, broker clock) from them.
-- An accepted lease also marks the node as heard of at recv (info 'seen', read by node expiry).
-- Returns one reply per lease, in order: {-1} for an unregistered node; {0, stored_epoch,
-- stored_version, 0} for a stale lease (nothing changed); {1, epoch, version, purged,
-- cordoned(0/1)} when stored; {-2, error} when a command failed for that lease.
local history_cap, events_cap, maxlen = tonumber(ARGV[1]), tonumber(ARGV[2]) - 1, ARGV[3]
-- The history LIST is trimmed back to its cap once it holds HISTORY_SLACK more (one LTRIM per
-- that many leases, not one each); lease_history reads no more than the cap.
local HISTORY_SLACK = 8
local stride = tonumber(ARGV[5])
local names = {}
for name in string.gmatch(ARGV[4], '[^|]+') do
  names[#names + 1] = name
end
local count = #names
local at = {}
for i = 1, count do
  at[names[i]] = i
end
local I_EV, I_EPOCH, I_VERSION, I_EXP, I_ZERO = at.ev, at.epoch, at.version, at.exp, at.zero
local I_NODE, I_NSEQ, I_RECV = at.node, at.nseq, at.recv
-- The open totals of a node with no reservation stored.
local NONE_OPEN = cf_totals_text(cf_totals_of(nil))
-- One lease's values in one pattern match (one C call, not a find and a sub per field): the
-- last, free text, takes the rest. Lua allows 32 captures, so at most 32 fields (a test holds
-- LEASE_FIELDS to that).
local VALUES = '^' .. string.rep('([^\31]*)\31', count - 1) .. '(.*)$'

local function upsert(base, changed, packed)
  local info, lease, res, notices = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local history, events, exp = KEYS[base + 5], KEYS[base + 6], KEYS[base + 7]
  local node = redis.call('HMGET', info, 'role', 'cordoned', 'open')
  if not node[1] then
    return {-1}
  end
  local v = {string.match(packed, VALUES)}
  if #v ~= count then
    error('malformed lease values')
  end
  local ev, epoch, zero, last_seen = v[I_EV], v[I_EPOCH], v[I_ZERO], tonumber(v[I_NSEQ])
  local now = v[I_RECV]
  local old = redis.call('HMGET', lease, 'ev', 'epoch', 'version', 'exp', 'zero', 'recv')
  if old[1] and ev <= old[1] then
    return {0, old[2], old[3], 0}
  end

  -- No reservation stored (the open totals count every record, released ones too: all zero
  -- or never set): nothing to purge, so neither the expiries nor the records are read.
  local purged = 0
  if node[3] and node[3] ~= NONE_OPEN then
    purged = cf_purge_expired(info, res, exp, notices, maxlen, now)
    local all = redis.call('HGETALL', res)
    for i = 1, #all, 2 do
      local f = cf_parse(all[i + 1])
      if f[1] == 'released' and tonumber(f[3]) <= last_seen then
        cf_drop(info, res, exp, all[i], f)
        purged = purged + 1
      end
    end
  end

  local logged = false
  local function event(kind, message)
    redis.call('LPUSH', events, now .. '|' .. kind .. '|' .. message)
    logged = true
  end
  if not old[1] or old[2] ~= epoch then
    event('new_epoch', 'new epoch ' .. epoch)
  end
  if zero ~= '' and (not old[1] or old[5] == '') then
    event('lease_zeroed', 'lease zeroed: ' .. zero)
  elseif zero == '' and old[1] and (old[5] ~= '' or tonumber(old[4]) <= tonumber(now)) then
    event('lease_restored', 'lease restored')
  end
  if logged then
    redis.call('LTRIM', events, 0, events_cap)
  end

  -- HSET replaces the hash's values in place (no DEL and re-create per lease): only the changed
  -- ones when the hash holds the lease they were compared against, else every one; a hash of
  -- another layout (say with a JSON copy) is deleted first, so none of its fields outlives it.
  local fields, n = {}, 0
  local whole = redis.call('HLEN', lease) == count
  local base_ = changed ~= '' and old[1] and old[6] and old[1] .. old[6]
  if whole and base_ and string.sub(changed, count + 1) == base_ then
    local at_ = string.find(changed, '\1', 1, true)
    while at_ and at_ <= count do
      fields[n + 1], fields[n + 2] = names[at_], v[at_]
      n = n + 2
      at_ = string.find(changed, '\1', at_ + 1, true)
    end
  else
    if not whole then
      redis.call('DEL', lease)
    end
    for i = 1, count do
      fields[2 * i - 1], fields[2 * i] = names[i], v[i]
    end
    n = 2 * count
  end
  if n > 0 then
    redis.call('HSET', lease, unpack(fields))
  end
  redis.call('HSET', info, 'seen', now)
  if redis.call('LPUSH', history, packed) > history_cap + HISTORY_SLACK then
    redis.call('LTRIM', history, 0, history_cap - 1)
  end
  local cordoned = 0
  if node[2] == '1' then
    cordoned = 1
  end
  if stride == 8 then  -- best effort (pcall): the index only steers sampling
    if zero == '' and cordoned == 0 then
      redis.pcall('ZADD', KEYS[base + 8], v[I_EXP], v[I_NODE])
    else
      redis.pcall('ZREM', KEYS[base + 8], v[I_NODE])
    end
  end
  return {1, epoch, v[I_VERSION], purged, cordoned}
end

local out = {}
for i = 0, #KEYS / stride - 1 do
  local ok, reply = pcall(upsert, stride * i, ARGV[6 + 2 * i], ARGV[7 + 2 * i])
  if not ok then
    reply = {-2, type(reply) == 'table' and reply.err or tostring(reply)}
  end
  out[i + 1] = reply
end
return out
