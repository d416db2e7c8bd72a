-- pin_prefix.lua - pin the longest usable prefix of a prompt, so another pool can copy its pages.
--
-- KEYS    - the pool's keys, see lib.lua
-- ARGV[1] - epoch the caller holds
-- ARGV[2] - reader id: names the pins (a request id that must not be in use)
-- ARGV[3] - prompt length in tokens
-- ARGV[4] - the chained hashes of its complete hash blocks
-- ARGV[5] - the deadline (ms) of the reader's lease, or "" for none (release.lua reaps it)
-- returns msgpack {epoch, hit = blocks, mla = packed page sets of the hit's MLA slots (uint32 per
--           page, slot-major, the last slot holding hit - (slots - 1) * blocks_per_page blocks),
--           ckpt = the checkpoint's KDA page set ({} without KDA groups or without a hit)}
--
-- The pins are held by a request record under the reader id, shaped like a request whose prompt
-- ends at the hit (so plan_step refuses to continue it): `release(reader)` drops them (anchor and checkpoint) like any request's, and
-- an invalidation voids them with the epoch. Pinning the anchor protects its ancestors (eviction
-- is leaf-first), so the whole page table stays readable until the release. No hit: no record.

local m = load_meta(ARGV[1])
local rid, tokens, blob = ARGV[2], tonumber(ARGV[3]), ARGV[4] or ""
if rid == nil or #rid == 0 then fail("BADINPUT", "the reader id must be a non-empty string") end
check_prompt(m, tokens, blob)
if get_req(rid) then fail("BADINPUT", "request " .. rid .. " already exists") end
local deadline = nil
if ARGV[5] ~= nil and ARGV[5] ~= "" then
  deadline = tonumber(ARGV[5])
  if deadline == nil then fail("BADINPUT", "the lease deadline must be a number or empty") end
  check_lease(rid, deadline)
end
local _, hit, ck, e, ready = match_prefix(m, tokens, held_hashes(blob, m.hash_len))
if hit == 0 then return reply({epoch = m.epoch, hit = 0, mla = "", ckpt = {}}) end

local mla = (redis.call("HGET", K_PATH, e[1]) or "") .. pack_ids(mla_pages(m, e[1]))
m.tick = m.tick + 1
pin(m, e[1], m.mla_groups)
local ckpt, pend = {}, {}
if ck >= 0 then
  pin(m, ck, m.kda_groups)
  ckpt = ready_pages(ready)
  pend[1] = {t = 0, unpin = ck, fills = {}, ck = -1, ckh = ""}
end
local pos = hit * m.block_tokens
put_req(rid, {tokens = pos, pos = pos, stop = pos, hit = pos, pin = e[1], spath = "", own = {},
              shared = 0, state = -1, ck = -1, reg = hit, inter = "", pend = pend, hoff = 0,
              tix = {}})
lease(rid, deadline)
save_meta(m)
return reply({epoch = m.epoch, hit = hit, mla = mla, ckpt = ckpt})
