-- create_pool.lua - create a pool's metadata, or check that an existing one has the same geometry.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV   - field, value pairs: num_pages, blocks_per_page, block_tokens, hash_len, kda_groups,
--          mla_groups, mla_token_bytes, kda_state_bytes, max_batch and the eviction weights
--          (w_recency, w_mla, w_intermediate, w_durable, w_depth)
-- returns the pool's epoch
--
-- Geometry is fixed for a pool's life: a caller with another geometry gets CT_CONFLICT rather
-- than silently reinterpreting page ids and byte ranges. Weights may change (a new policy).

local GEOMETRY = {num_pages = true, blocks_per_page = true, block_tokens = true, hash_len = true,
                  kda_groups = true, mla_groups = true, mla_token_bytes = true,
                  kda_state_bytes = true, max_batch = true}
local WEIGHTS = {w_recency = true, w_mla = true, w_intermediate = true, w_durable = true, w_depth = true}
if #ARGV % 2 ~= 0 then fail("BADINPUT", "expected field/value pairs") end
local given = {}
for i = 1, #ARGV, 2 do
  local field, value = ARGV[i], tonumber(ARGV[i + 1])
  if not (GEOMETRY[field] or WEIGHTS[field]) then fail("BADINPUT", "unknown pool field " .. field) end
  if value == nil then fail("BADINPUT", field .. " must be a number") end
  if GEOMETRY[field] and not is_int(value, field == "kda_groups" and 0 or 1) then
    fail("BADINPUT", field .. " must be a positive integer")
  end
  given[field] = value
end
for field in pairs(GEOMETRY) do
  if given[field] == nil then fail("BADINPUT", "missing pool field " .. field) end
end
for field in pairs(WEIGHTS) do
  if given[field] == nil then fail("BADINPUT", "missing pool field " .. field) end
end
if redis.call("EXISTS", K_META) == 1 then
  for field in pairs(GEOMETRY) do
    local have = tonumber(redis.call("HGET", K_META, field))
    if have ~= given[field] then
      fail("CONFLICT", "pool exists with " .. field .. "=" .. tostring(have) .. ", not " .. given[field])
    end
  end
else
  redis.call("HSET", K_META, "epoch", 1, "fresh", 0, "tick", 0, "ticket", 0, "lru_pages", 0)
end
for field, value in pairs(given) do redis.call("HSET", K_META, field, value) end
return tonumber(redis.call("HGET", K_META, "epoch"))
