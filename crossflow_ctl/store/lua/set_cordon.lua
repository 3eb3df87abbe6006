-- Cordon or uncordon a known node; on a change, a CORDON/UNCORDON notice and a node event.
-- KEYS[1] info HASH, KEYS[2] notices STREAM, KEYS[3] node events LIST, KEYS[4] lease HASH.
-- ARGV[1] now_ms, ARGV[2] '1' to cordon or '0' to uncordon, ARGV[3] reason,
-- ARGV[4] notices MAXLEN, ARGV[5] events cap.
-- Returns {'not_found'} or {'ok', info fields as a flat HGETALL list, lease exp or '',
-- lease zero reason or ''}.
local info, notices, events, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, want, reason = ARGV[1], ARGV[2], ARGV[3]

if redis.call('EXISTS', info) == 0 then
  return {'not_found'}
end
local changed = redis.call('HGET', info, 'cordoned') ~= want
if want == '1' then
  redis.call('HSET', info, 'cordoned', '1', 'cordon_reason', reason)
else
  redis.call('HSET', info, 'cordoned', '0', 'cordon_reason', '')
end
if changed then
  local kind, message = 'uncordon', 'uncordoned'
  if want == '1' then
    kind, message = 'cordon', 'cordoned: ' .. reason
  end
  cf_notice(info, notices, ARGV[4], kind, '', nil, now)
  redis.call('LPUSH', events, now .. '|' .. kind .. '|' .. message)
  redis.call('LTRIM', events, 0, tonumber(ARGV[5]) - 1)
end
local l = redis.call('HMGET', lease, 'exp', 'zero')
return {'ok', redis.call('HGETALL', info), l[1] or '', l[2] or ''}
