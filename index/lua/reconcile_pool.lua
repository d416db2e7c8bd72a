-- reconcile_pool.lua - the pool against what its callers have seen of it: a pool that went back
-- in time (or was lost and created again) starts over in an epoch never issued before.
--
-- KEYS    - the pool's keys, see lib.lua
-- ARGV[1] - the highest epoch the caller has seen of the pool (a service: its own calls and its
--           agents' registrations), 0 if none
-- ARGV[2] - the highest write count (meta.wc) it has been answered with, 0 if none
-- ARGV[3] - the highest ticket it has been given, 0 if none
-- ARGV[4] - the epoch to start over in, above every epoch the caller knows of (the pool's own
--           epoch + 1 when that is higher)
-- ARGV[5] - the storage instance answering now (a Redis run id, or a cluster node id)
-- returns msgpack {epoch, wc, ticket, restarted = 0|1, why}
--
-- The pool is *behind* when its epoch, write count or ticket counter is below the caller's: writes
-- the caller saw are gone. Its *holder moved* when another storage instance held it before (a
-- restart, a failover) and the caller has seen none of its writes, so nobody here can tell whether
-- writes were lost. Either way every per-epoch key goes, the epoch jumps to ARGV[4] and the write
-- count and the ticket counter above anything seen: no epoch or ticket is ever issued twice, and a
-- caller holding the old epoch is told stale. Otherwise only the holder is stamped: the caller
-- vouches for the instance holding the pool now.

local m = load_meta(nil)
local seen = {}
for i = 1, 4 do
  seen[i] = tonumber(ARGV[i])
  if not is_int(seen[i], 0, 9007199254740991) then
    fail("BADINPUT", "reconcile_pool's ARGV[1..4] must be integers >= 0")
  end
end
local seen_epoch, seen_wc, seen_ticket, fresh_epoch = seen[1], seen[2], seen[3], seen[4]
local holder = ARGV[5]
if type(holder) ~= "string" or #holder == 0 then fail("BADINPUT", "the holder must be named") end
local was = redis.call("HGET", K_META, "holder")

local why = ""
if m.epoch < seen_epoch or m.wc < seen_wc or m.ticket < seen_ticket then
  why = "behind: epoch " .. m.epoch .. " write " .. m.wc .. " ticket " .. m.ticket ..
        ", seen epoch " .. seen_epoch .. " write " .. seen_wc .. " ticket " .. seen_ticket
elseif was and was ~= holder and seen_wc == 0 then
  why = "holder moved from " .. was .. " to " .. holder .. " with no write seen to vouch for it"
end
if why == "" then
  redis.call("HSET", K_META, "holder", holder)
  return reply({epoch = m.epoch, wc = m.wc, ticket = m.ticket, restarted = 0, why = why})
end
local epoch = math.max(fresh_epoch, m.epoch + 1)
m.wc = math.max(m.wc, seen_wc) + 1
META_WC = m.wc
local ticket = math.max(m.ticket, seen_ticket)
redis.call("UNLINK", unpack(EPOCH_KEYS))
m.epoch, m.fresh, m.lru_pages, m.durable_cks, m.ticket = epoch, 0, 0, 0, ticket
write_meta(m)
redis.call("HSET", K_META, "holder", holder)
return reply({epoch = epoch, wc = m.wc, ticket = ticket, restarted = 1, why = why})
