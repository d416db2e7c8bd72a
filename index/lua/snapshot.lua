-- snapshot.lua - read-only: every key of the pool as it is, for checkers (index.snapshot).
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV   - none
-- returns the contents of the 11 hashes (meta, pages, ep, ck, req, reqh, tix, rf, path, refs,
--           ckr: HGETALL's field/value lists), then `free` (LRANGE), `lru` and `lease` (ZRANGE
--           ... WITHSCORES: member/score lists)
--
-- One call, so the snapshot is atomic under the service's own Redis user (a MULTI needs
-- permissions the service never uses). It reads the whole pool: bounded by the pool's pages and
-- requests, not by the keyspace, and never on a step's path (tests, chaos checks, operators).

local hashes = {K_META, K_PAGES, K_EP, K_CK, K_REQ, K_REQH, K_TIX, K_RF, K_PATH, K_REFS, K_CKR}
local out = {}
for _, key in ipairs(hashes) do out[#out + 1] = redis.call("HGETALL", key) end
out[#out + 1] = redis.call("LRANGE", K_FREE, 0, -1)
out[#out + 1] = redis.call("ZRANGE", K_LRU, 0, -1, "WITHSCORES")
out[#out + 1] = redis.call("ZRANGE", K_LEASE, 0, -1, "WITHSCORES")
return out
