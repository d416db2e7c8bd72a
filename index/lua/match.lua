-- match.lua - the two-stage lookup of DESIGN.md, read-only; the loader prepends it (after lib.lua)
-- to the scripts that look a prompt up: plan_step, probe and pin_prefix.

-- One lookup's endpoints, each read once (`seen`: hash -> endpoint, or false when not
-- matchable): stage 2 re-checks the boundary stage 1 found, and the caller wants the hit's
-- endpoint. It lives for one match_prefix call, before the caller writes anything.
local function matchable_in(seen, h)
  local e = seen[h]
  if e == nil then
    e = matchable(h) or false
    seen[h] = e
  end
  return e or nil
end

-- Stage 1: whole pages by their page-end hash (prefix-closed, so a binary search), then the
-- endpoints inside the first missing page. Returns the deepest matchable block count. The
-- deepest page end is probed first: a conversation's next turn usually adds less than a page
-- to a prefix the pool holds, so that one probe ends the search.
local function match_mla(m, hs, usable, seen)
  local PB, HL = m.blocks_per_page, m.hash_len
  local lo, hi = 0, math.floor(usable / PB)
  if hi > 0 then
    if matchable_in(seen, hash_at(hs, hi * PB)) then lo = hi else hi = hi - 1 end
  end
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if matchable_in(seen, hash_at(hs, mid * PB)) then lo = mid else hi = mid - 1 end
  end
  local inside = math.min(PB - 1, usable - lo * PB)
  local run = hash_run(hs, lo * PB + 1, lo * PB + inside)  -- the first missing page's hashes
  for f = inside, 1, -1 do
    if matchable_in(seen, block_hash(run, HL, f)) then return lo * PB + f end
  end
  return lo * PB
end

-- Stage 2: the deepest boundary <= depth with a ready checkpoint in every KDA group (one `ckr`
-- entry holds them all): depth itself first (a turn end the next turn resumes from is where
-- its MLA match ends), then one page's worth of boundaries per HMGET, deepest page first.
-- Returns the boundary in blocks, its hash, the checkpoint's lead page (-1 without KDA groups)
-- and its `ckr` entry (its class and page set; nil without one).
local function match_kda(m, hs, depth, seen)
  local top = hash_at(hs, depth)
  if m.kda_groups == 0 then return depth, top, -1 end
  local PB, HL = m.blocks_per_page, m.hash_len
  local ready = redis.call("HGET", K_CKR, top)
  if ready and matchable_in(seen, top) then return depth, top, ready_lead(ready), ready end
  local slot = math.floor((depth - 2) / PB)  -- the boundaries below depth
  while slot >= 0 do
    local first, last = slot * PB + 1, math.min(depth - 1, (slot + 1) * PB)
    local run, fields = hash_run(hs, first, last), {}
    for i = last, first, -1 do fields[#fields + 1] = block_hash(run, HL, i - first + 1) end
    for j, ready in ipairs(redis.call("HMGET", K_CKR, unpack(fields))) do
      if ready and matchable_in(seen, fields[j]) then
        return last - j + 1, fields[j], ready_lead(ready), ready
      end
    end
    slot = slot - 1
  end
  return 0, nil, -1
end

-- Validates a prompt (length, one hash per complete block) before any lookup.
local function check_prompt(m, tokens, blob)
  if not is_int(tokens, 1, 1099511627776) then fail("BADINPUT", "tokens must be an integer >= 1") end
  if #blob ~= math.floor(tokens / m.block_tokens) * m.hash_len then
    fail("BADINPUT", "hashes must hold one " .. m.hash_len .. "-byte hash per complete " ..
         m.block_tokens .. "-token block")
  end
end

-- The longest usable prefix of a prompt (its hashes `hs`, lib.lua `held_hashes`): MLA depth
-- and hit (both in blocks; the last token is always left to compute), the checkpoint lead of
-- the hit (-1 if none), the hit's endpoint (nil without a hit) and the checkpoint's `ckr` entry
-- (nil if none).
local function match_prefix(m, tokens, hs)
  local usable = math.min(hs.count, math.floor((tokens - 1) / m.block_tokens))
  local seen = {}
  local depth = match_mla(m, hs, usable, seen)
  if depth == 0 then return 0, 0, -1, nil end
  local hit, h, ck, ready = match_kda(m, hs, depth, seen)
  if hit == 0 then return depth, 0, -1, nil end
  return depth, hit, ck, seen[h], ready
end
