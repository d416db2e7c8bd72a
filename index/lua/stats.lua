-- stats.lua - read-only: the pool's counters, for monitors and the replay's reports.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV   - none (any epoch: the counters are those of the pool now, in the epoch it reports)
-- returns msgpack {epoch, num_pages, free_pages, evictable_pages, requests, pending_tickets,
--           checkpoints, durable_checkpoints} (index.records.IndexStats)
--
-- O(1), so it may be polled at any rate: every figure is a meta counter the scripts keep as they
-- change the pool (lru_pages, durable_cks) or the length of one key (HLEN, LLEN); nothing here
-- walks pages or checkpoints.

local m = load_meta(nil)
return reply({epoch = m.epoch, num_pages = m.num_pages, free_pages = free_count(m),
              evictable_pages = m.lru_pages, requests = redis.call("HLEN", K_REQ),
              pending_tickets = redis.call("HLEN", K_TIX), checkpoints = redis.call("HLEN", K_CK),
              durable_checkpoints = m.durable_cks})
