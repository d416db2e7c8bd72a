-- create_pool.lua - create a pool's metadata, or check that an existing one has the same geometry.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV   - field, value pairs: num_pages, blocks_per_page, block_tokens, hash_len, kda_groups,
--          mla_groups, mla_token_bytes, kda_state_bytes, max_batch and the eviction weights
--          (WEIGHT_FIELDS, generated from eviction.policy.EvictionWeights.as_pool_fields)
-- returns the pool's epoch
--
-- Geometry is fixed for a pool's life: a caller with another geometry gets CT_CONFLICT rather
-- than silently reinterpreting page ids and byte ranges. Weights may change (a new policy); the
-- members already in the eviction order keep their scores until `reweigh` rescores them.

local GEOMETRY = {}
for _, field in ipairs(GEOMETRY_FIELDS) do GEOMETRY[field] = true end
if #ARGV % 2 ~= 0 then fail("BADINPUT", "expected field/value pairs") end
local given = {}
for i = 1, #ARGV, 2 do
  local field, value = ARGV[i], tonumber(ARGV[i + 1])
  if GEOMETRY[field] then
    if not is_int(value, field == "kda_groups" and 0 or 1) then
      fail("BADINPUT", field .. " must be a positive integer")
    end
  elseif WEIGHT_FIELDS[field] then
    check_weight(field, value)
  else
    fail("BADINPUT", "unknown pool field " .. field)
  end
  given[field] = value
end
require_fields(GEOMETRY, given)
require_fields(WEIGHT_FIELDS, given)

-- A pool stored before the `core` field (layout 2 and older) kept its geometry and counters as
-- fields of their own; one stored before a counter existed counted none (0).
local function fields_meta()
  local raw = redis.call("HMGET", K_META, unpack(CORE_FIELDS))
  local m = {}
  for i, field in ipairs(CORE_FIELDS) do m[field] = tonumber(raw[i]) or 0 end
  return m
end

local m = read_meta()
if m == nil and redis.call("EXISTS", K_META) == 1 then m = fields_meta() end
if m then
  for _, field in ipairs(GEOMETRY_FIELDS) do
    if m[field] ~= given[field] then
      fail("CONFLICT", "pool exists with " .. field .. "=" .. m[field] .. ", not " .. given[field])
    end
  end
else
  m = {epoch = 1, fresh = 0, tick = 0, ticket = 0, lru_pages = 0, clock = 0, durable_cks = 0, wc = 0}
  for _, field in ipairs(GEOMETRY_FIELDS) do m[field] = given[field] end
end
-- A pool stored with another record layout (lib.lua LAYOUT) holds records these scripts would
-- misread: if it has any, every per-epoch key goes and it starts over in the next epoch, as when
-- its agents restart; its epoch, tickets and write count go on from where they were, so none is
-- issued twice.
if tonumber(redis.call("HGET", K_META, "layout")) ~= LAYOUT then
  if redis.call("HLEN", K_PAGES) > 0 then
    redis.call("UNLINK", unpack(EPOCH_KEYS))
    m.epoch, m.fresh, m.lru_pages, m.durable_cks = m.epoch + 1, 0, 0, 0
  end
  redis.call("HDEL", K_META, unpack(CORE_FIELDS))  -- an older layout's own fields
  redis.call("HSET", K_META, "layout", LAYOUT)
end
write_meta(m)
for field in pairs(WEIGHT_FIELDS) do redis.call("HSET", K_META, field, given[field]) end
return m.epoch
