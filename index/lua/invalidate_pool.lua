-- invalidate_pool.lua - the pool's bytes are gone (agent died or restarted): start a new epoch.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch the caller saw, or "" to invalidate whatever epoch is current
-- ARGV[2] - optional: the caller's view (lib.lua check_view); a pool behind it is CT_ROLLBACK,
--           since bumping an epoch that went back would issue an epoch again
-- returns the new epoch
--
-- O(1) in the main thread: every per-epoch structure lives in a fixed set of keys that UNLINK
-- hands to a background thread. From this instant nothing of the old epoch is matchable, its pins
-- are void, and every page id is free again. An invalidation against an epoch that is already
-- gone returns the current one without bumping it twice.

local m = load_meta(nil)
if ARGV[2] ~= nil then check_view(m, ARGV[2]) end
if ARGV[1] ~= "" then
  local seen = tonumber(ARGV[1])
  if seen == nil then fail("BADINPUT", "epoch must be an integer or empty") end
  if seen ~= m.epoch then return m.epoch end
end
redis.call("UNLINK", unpack(EPOCH_KEYS))
m.epoch, m.fresh, m.lru_pages, m.durable_cks, m.wc = m.epoch + 1, 0, 0, 0, m.wc + 1
write_meta(m)
return m.epoch
