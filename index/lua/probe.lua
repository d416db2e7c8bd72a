-- probe.lua - read-only: how much of a prompt this pool could serve from its cache right now.
--
-- KEYS    - the pool's keys, see lib.lua
-- ARGV[1] - prompt length in tokens
-- ARGV[2] - the chained hashes of its complete hash blocks
-- returns msgpack {epoch, mla = blocks the MLA pages alone match, hit = blocks usable (MLA and a
--           checkpoint in every KDA group at the same boundary)}
--
-- Writes nothing (no pin, no recency), so a router may ask every pool for every prompt; a hit it
-- reports may be gone by the time a step is planned. Bounded like plan_step's lookup: a binary
-- search over the prompt's pages, then one HMGET per page of boundaries probed.

local m = load_meta(nil)
local tokens, blob = tonumber(ARGV[1]), ARGV[2] or ""
check_prompt(m, tokens, blob)
local depth, hit = match_prefix(m, tokens, held_hashes(blob, m.hash_len))
return reply({epoch = m.epoch, mla = depth, hit = hit})
