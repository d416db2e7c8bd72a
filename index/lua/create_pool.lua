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

local GEOMETRY = {num_pages = true, blocks_per_page = true, block_tokens = true, hash_len = true,
                  kda_groups = true, mla_groups = true, mla_token_bytes = true,
                  kda_state_bytes = true, max_batch = true}
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
if redis.call("EXISTS", K_META) == 1 then
  for field in pairs(GEOMETRY) do
    local have = tonumber(redis.call("HGET", K_META, field))
    if have ~= given[field] then
      fail("CONFLICT", "pool exists with " .. field .. "=" .. tostring(have) .. ", not " .. given[field])
    end
  end
else
  redis.call("HSET", K_META, "epoch", 1, "fresh", 0, "tick", 0, "ticket", 0, "lru_pages", 0,
             "durable_cks", 0)
end
-- A stored pool these scripts cannot take as it is starts a new epoch, as when its agents
-- restart: every per-epoch key goes.
local function start_over()
  redis.call("UNLINK", unpack(EPOCH_KEYS))
  redis.call("HINCRBY", K_META, "epoch", 1)
  redis.call("HSET", K_META, "fresh", 0, "lru_pages", 0, "durable_cks", 0)
end
-- One stored before meta.durable_cks was kept: its durable checkpoints cannot be counted in
-- bounded time, so it starts over if it has any.
if redis.call("HEXISTS", K_META, "durable_cks") == 0 then
  if redis.call("HLEN", K_CK) > 0 then start_over() end
  redis.call("HSET", K_META, "durable_cks", 0)
end
-- One stored with another record layout (lib.lua LAYOUT) holds records these scripts would
-- misread: it starts over if it has any.
if tonumber(redis.call("HGET", K_META, "layout")) ~= LAYOUT then
  if redis.call("HLEN", K_PAGES) > 0 then start_over() end
  redis.call("HSET", K_META, "layout", LAYOUT)
end
redis.call("HSETNX", K_META, "clock", 0)
for field, value in pairs(given) do redis.call("HSET", K_META, field, value) end
return tonumber(redis.call("HGET", K_META, "epoch"))
