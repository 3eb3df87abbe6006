-- Shared helpers, prepended to every per-node script when it is loaded (not a script itself).
-- KEYS: none of its own; functions take the caller's per-node key names.
-- ARGV: none.
-- Returns: nothing.
--
-- A reservation is stored in the node's reservation HASH as one '|'-separated record:
--   state|expires_at_ms|release_seq|c1|c2|c3|c4|c5|created_at_ms|grant_seq|epoch|version|owner|
--   request_id
-- where c1..c5 are the debit (compute, kv, kv_transfer, output, slots), owner the identity of
-- the router that was granted it ('router/<name>', '' without authentication; never holds '|')
-- and request_id comes last so it may contain any character. Numbers that Lua only copies are kept as strings.
-- A timed debit (one with node time behind its compute: Reservation.compute_us) stores c1 as
-- "<tokens>:<us>"; cf_parse splits it (f[4] the tokens, f.us the microseconds, '0' untimed)
-- and cf_format joins it back, so a record written before debits were timed reads as untimed.
-- Each reservation's expiry is also a member of the node's expiry ZSET (score expires_at_ms),
-- and the info HASH keeps running totals, so a debit never scans the reservations.

local CF_RECORD = '^' .. string.rep('([^|]*)|', 13) .. '(.*)$'
local function cf_parse(rec)
  local f = {string.match(rec, CF_RECORD)}
  local tokens, us = string.match(f[4], '^(%d+):(%d+)$')
  if tokens then
    f[4], f.us = tokens, us
  else
    f.us = '0'
  end
  return f
end

local function cf_format(f)
  local tokens = f[4]
  if f.us ~= '0' then
    f[4] = tokens .. ':' .. f.us
  end
  local rec = table.concat(f, '|', 1, 14)
  f[4] = tokens
  return rec
end

local function cf_int(x)
  return string.format('%d', x)
end

-- Append one notice with the node's next sequence number and, for each node's first notice in
-- the script, PUBLISH the node id on the namespace's wake channel '<ns>:notices' (the key is
-- '<ns>:{<ns>:n:<node>}:notices'), which wakes the relay of the replica holding the node's
-- agent stream; returns the sequence (a string). One wake per node per script call is enough:
-- the script is atomic, so the read a wake triggers sees every notice it appended for that node
-- (a batch of debits costs the relay one wake, not one per grant), while a script that touches
-- several nodes (upsert_leases purging expired holds) wakes each of them. A classic PUBLISH is
-- not a key: it is allowed in a one-slot script on a Cluster and reaches subscribers on every
-- shard.
-- pulled: a grant's pulled-in prefix tokens (the entry's 'p'; nil or '': left out).
local cf_woken = {}
local function cf_notice(info_key, notices_key, maxlen, kind, rid, f, now, pulled)
  local seq = cf_int(redis.call('HINCRBY', info_key, 'seq', 1))
  local debit = '0,0,0,0,0'
  if f then
    debit = f[4] .. ',' .. f[5] .. ',' .. f[6] .. ',' .. f[7] .. ',' .. f[8]
  end
  if pulled and pulled ~= '' then
    redis.call('XADD', notices_key, 'MAXLEN', '~', maxlen, seq .. '-0',
      'k', kind, 'r', rid, 'd', debit, 't', now, 'p', pulled)
  else
    redis.call('XADD', notices_key, 'MAXLEN', '~', maxlen, seq .. '-0',
      'k', kind, 'r', rid, 'd', debit, 't', now)
  end
  if not cf_woken[notices_key] then
    cf_woken[notices_key] = true
    local ns, node = string.match(notices_key, '^(.-):{.-:n:(.*)}:notices$')
    if ns then
      redis.call('PUBLISH', ns .. ':notices', node)
    end
  end
  return seq
end

-- Open-debit totals of the node's stored reservations (expired-but-unpurged included), kept in
-- the info HASH field 'open' as "c1,c2,c3,c4,c5,count,us,timed" (us: the timed debits' node
-- microseconds, timed: their compute tokens; a value without them, written before debits were
-- timed, reads them as 0; cf_add zeroes them whenever count reaches 0): parsed from that
-- field's value (raw; nil when unset), or read with cf_totals.
local function cf_totals_of(raw)
  local t = {0, 0, 0, 0, 0, 0, 0, 0}
  if raw then
    local i = 1
    for v in string.gmatch(raw, '[^,]+') do
      t[i] = tonumber(v)
      i = i + 1
    end
  end
  return t
end

local function cf_totals(info_key)
  return cf_totals_of(redis.call('HGET', info_key, 'open'))
end

-- Totals (as read by cf_totals) as text: "c1,c2,c3,c4,c5,count,us,timed".
local function cf_totals_text(t)
  return string.format('%d,%d,%d,%d,%d,%d,%d,%d', t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8])
end

-- Open compute debits (tokens, with us microseconds behind the timed tokens among them) in the
-- unit of a lease whose borrowed-prefill rate is rate: crossflow_ctl/domain/models.py
-- ComputeTime.tokens_at, the same double arithmetic in the same order. A time that cannot be
-- behind them (us <= 0, timed < 0 or timed > tokens: totals an older broker rewrote without
-- it, README.md Rolling upgrades) counts them all untimed, as ComputeTime.behind does.
local function cf_compute_at(tokens, us, timed, rate)
  if rate <= 0 or us <= 0 or timed < 0 or timed > tokens then
    return tokens
  end
  return tokens - timed + math.ceil(us * rate / 1000000)
end

-- The open compute of totals t with one more debit (tokens, us microseconds behind them, 0:
-- untimed) in the unit of a lease whose rate is rate: the node time summed before the one ceil
-- (crossflow_ctl/domain/safety.py need_for), an inconsistent time dropped first.
local function cf_compute_after(t, tokens, us, rate)
  local open_us, timed = t[7], t[8]
  if open_us <= 0 or timed < 0 or timed > t[1] then
    open_us, timed = 0, 0
  end
  if us > 0 then
    open_us, timed = open_us + us, timed + tokens
  end
  return cf_compute_at(t[1] + tokens, open_us, timed, rate)
end

-- Write totals (as read by cf_totals) back to the info HASH.
local function cf_set_totals(info_key, t)
  redis.call('HSET', info_key, 'open', cf_totals_text(t))
end

-- Add (sign 1) or remove (sign -1) one reservation record's debit to/from totals t in memory.
local function cf_add(t, f, sign)
  for c = 1, 5 do
    t[c] = t[c] + sign * tonumber(f[3 + c])
  end
  t[6] = t[6] + sign
  local us = tonumber(f.us)
  if us > 0 then
    t[7] = t[7] + sign * us
    t[8] = t[8] + sign * tonumber(f[4])
  end
  if t[6] <= 0 then -- nothing open: no time either (heals totals an older broker rewrote)
    t[7], t[8] = 0, 0
  end
end

-- Add (sign 1) or remove (sign -1) one reservation record's debit to/from the stored totals.
local function cf_count(info_key, f, sign)
  local t = cf_totals(info_key)
  cf_add(t, f, sign)
  cf_set_totals(info_key, t)
end

-- Store a new reservation (or a changed one: commit, release) with its expiry.
local function cf_put(info_key, res_key, exp_key, rid, f, is_new)
  redis.call('HSET', res_key, rid, cf_format(f))
  redis.call('ZADD', exp_key, f[2], rid)
  if is_new then
    cf_count(info_key, f, 1)
  end
end

-- Forget one reservation (purged).
local function cf_drop(info_key, res_key, exp_key, rid, f)
  redis.call('HDEL', res_key, rid)
  redis.call('ZREM', exp_key, rid)
  cf_count(info_key, f, -1)
end

-- The records of the reservations expired at now, oldest grant first, and how many ids the
-- expiry ZSET holds up to now (records already gone included).
local function cf_expired(res_key, exp_key, now)
  local ids = redis.call('ZRANGEBYSCORE', exp_key, '-inf', now)
  local out = {}
  for i = 1, #ids do
    local rec = redis.call('HGET', res_key, ids[i])
    if rec then
      local f = cf_parse(rec)
      f.id = ids[i]
      out[#out + 1] = f
    end
  end
  table.sort(out, function(a, b) return tonumber(a[10]) < tonumber(b[10]) end)
  return out, #ids
end

-- Drop every reservation expired at now, with an EXPIRE notice each, and trim the expiry ZSET
-- once for the whole range (not at all when it holds nothing due). Returns the count and, when
-- any expired, the node's totals after the purge, else nil. Totals: read and written back here,
-- or given (t, as read by cf_totals: updated in place and NOT written back, the caller writes
-- them once with its own changes).
local function cf_purge_expired(info_key, res_key, exp_key, notices_key, maxlen, now, t)
  local expired, due = cf_expired(res_key, exp_key, now)
  if due == 0 then
    return 0, nil
  end
  if #expired > 0 then
    local given = t ~= nil
    t = t or cf_totals(info_key)
    for i = 1, #expired do
      local f = expired[i]
      redis.call('HDEL', res_key, f.id)
      cf_add(t, f, -1)
      cf_notice(info_key, notices_key, maxlen, 'expire', f.id, f, now)
    end
    if not given then
      cf_set_totals(info_key, t)
    end
  else
    t = nil
  end
  redis.call('ZREMRANGEBYSCORE', exp_key, '-inf', now)
  return #expired, t
end

-- The reservation `rid` if it is still live: its parsed fields and stored record; else nil and
-- 'not_found', or nil and 'expired' after purging the node's expired reservations (with their
-- EXPIRE notices).
local function cf_live_reservation(info_key, res_key, exp_key, notices_key, maxlen, now, rid)
  local rec = redis.call('HGET', res_key, rid)
  if not rec then
    return nil, 'not_found'
  end
  local f = cf_parse(rec)
  if tonumber(f[2]) <= tonumber(now) then
    cf_purge_expired(info_key, res_key, exp_key, notices_key, maxlen, now)
    return nil, 'expired'
  end
  return f, rec
end
