-- Shared helpers, prepended to every per-node script when it is loaded (not a script itself).
-- KEYS: none of its own; functions take the caller's per-node key names.
-- ARGV: none.
-- Returns: nothing.
--
-- A reservation is stored in the node's reservation HASH as one '|'-separated record:
--   state|expires_at_ms|release_seq|c1|c2|c3|c4|c5|created_at_ms|grant_seq|epoch|version|request_id
-- where c1..c5 are the debit (compute, kv, kv_transfer, output, slots) and request_id comes last
-- so it may contain any character. Numbers that Lua only copies are kept as strings.

local function cf_parse(rec)
  local f = {}
  local pos = 1
  for _ = 1, 12 do
    local bar = string.find(rec, '|', pos, true)
    f[#f + 1] = string.sub(rec, pos, bar - 1)
    pos = bar + 1
  end
  f[13] = string.sub(rec, pos)
  return f
end

local function cf_format(f)
  return table.concat(f, '|', 1, 13)
end

local function cf_int(x)
  return string.format('%d', x)
end

-- Append one notice with the node's next sequence number; returns the sequence (a string).
local function cf_notice(info_key, notices_key, maxlen, kind, rid, f, now)
  local seq = cf_int(redis.call('HINCRBY', info_key, 'seq', 1))
  local debit = '0,0,0,0,0'
  if f then
    debit = f[4] .. ',' .. f[5] .. ',' .. f[6] .. ',' .. f[7] .. ',' .. f[8]
  end
  redis.call('XADD', notices_key, 'MAXLEN', '~', maxlen, seq .. '-0',
    'k', kind, 'r', rid, 'd', debit, 't', now)
  return seq
end

-- Drop every reservation whose expiry has passed, with an EXPIRE notice each; returns the count.
local function cf_purge_expired(info_key, res_key, notices_key, maxlen, now)
  local all = redis.call('HGETALL', res_key)
  local purged = 0
  local now_n = tonumber(now)
  for i = 1, #all, 2 do
    local f = cf_parse(all[i + 1])
    if tonumber(f[2]) <= now_n then
      redis.call('HDEL', res_key, all[i])
      cf_notice(info_key, notices_key, maxlen, 'expire', all[i], f, now)
      purged = purged + 1
    end
  end
  return purged
end

-- Sum of the debits of the reservations still counting at now (after a purge: all of them).
local function cf_open_debits(res_key, now)
  local sums = {0, 0, 0, 0, 0}
  local all = redis.call('HVALS', res_key)
  local now_n = tonumber(now)
  for i = 1, #all do
    local f = cf_parse(all[i])
    if tonumber(f[2]) > now_n then
      for c = 1, 5 do
        sums[c] = sums[c] + tonumber(f[3 + c])
      end
    end
  end
  return sums
end
