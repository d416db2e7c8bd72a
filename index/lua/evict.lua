-- evict.lua - evict up to N entries in policy order (operators shrinking a pool, and tests).
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2] - N, the number of eviction-order entries to remove (each frees a whole page set)
-- returns msgpack {evicted = n, removed = {{"ep"|"ck", hash}, ...}}

local m = load_meta(ARGV[1])
local n = tonumber(ARGV[2])
if not is_int(n, 0, 1000000) then fail("BADINPUT", "N must be an integer in [0, 1000000]") end
local removed, count = {}, 0
while count < n and evict_one(m, removed) do count = count + 1 end
save_meta(m)
return reply({evicted = count, removed = removed})
