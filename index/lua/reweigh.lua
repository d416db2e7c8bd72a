-- reweigh.lua - switch a pool to new eviction weights and rescore a batch of the eviction order.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2] - first page id of this batch (0 on the first call)
-- ARGV[3] - N, how many page ids to visit (1..100000)
-- ARGV[4..] - the new weights as field, value pairs (every one of WEIGHT_FIELDS, see lib.lua)
-- returns the first page id of the next batch, or -1 once every allocated id was visited
--
-- Bounded: one batch visits N page ids, in id order, and re-adds the eviction-order members among
-- them with their score under the new weights. Page ids never move, so a caller walking from 0
-- until -1 rescores every member that existed before its first call, whatever happens between
-- batches; members saved meanwhile are scored with the new weights already (they are in meta
-- from the first batch on), so the order is mixed only until the walk ends.

local m = load_meta(ARGV[1])
local first, n = tonumber(ARGV[2]), tonumber(ARGV[3])
if not is_int(first, 0) then fail("BADINPUT", "the first page id must be an integer >= 0") end
if not is_int(n, 1, 100000) then fail("BADINPUT", "N must be an integer in [1, 100000]") end
if #ARGV % 2 ~= 1 then fail("BADINPUT", "expected weight field/value pairs") end
local given = {}
for i = 4, #ARGV, 2 do
  local field, value = ARGV[i], tonumber(ARGV[i + 1])
  if not WEIGHT_FIELDS[field] then fail("BADINPUT", "unknown weight " .. field) end
  check_weight(field, value)
  given[field] = value
end
require_fields(WEIGHT_FIELDS, given)

for field, value in pairs(given) do
  redis.call("HSET", K_META, field, value)
  m[field] = value
end
class_weights(m)
local last = math.min(first + n, m.fresh) - 1
for id = first, last do
  if redis.call("ZSCORE", K_LRU, id) then redis.call("ZADD", K_LRU, score(m, get_rec(id)), id) end
end
if last + 1 >= m.fresh then return -1 end
return last + 1
