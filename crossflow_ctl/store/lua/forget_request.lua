-- Delete a request record if it names a reservation as its grant (a grant recorded with its
-- debit, released because no caller heard of it).
-- KEYS[1] the request record STRING.
-- ARGV[1] the record's grant member as it is written: '"reservation_id":"<id>"'.
-- Returns 1 when the record was deleted, 0 otherwise.
local record = redis.call('GET', KEYS[1])
if record and string.find(record, ARGV[1], 1, true) then
  return redis.call('DEL', KEYS[1])
end
return 0
