-- commit.lua - register what a step's forward pass computed: MLA endpoints and one checkpoint.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2] - msgpack list of {rid = str, stop = tokens now processed (start < stop <= planned stop),
--           ckpt_tokens = boundary whose state was written to the planned checkpoint pages
--           (a multiple of the hash block inside (start, stop]) or 0,
--           kind = the checkpoint's class, one of COMMIT_KINDS (eviction.policy CheckpointKind)}
-- ARGV[3..] - the new tickets' nonces (lib.lua `check_nonce`), one per group of items: an item's
--           optional `g` (default 1) names its group, groups in order, none empty. Group g gets
--           ticket `ticket + g - 1`, so several callers' commits share one call and each keeps a
--           ticket of its own, as if committed one after the other in group order.
-- returns msgpack {ticket, nonce, requests = {{rid, endpoints, ckpt, stored, parent, ckh}},
--           removed} (`ticket` and `nonce`: the first group's):
--           `stored` is the chain of block hashes this commit processed (registered here or
--           already present), `parent` the hash before it ("" at the namespace root), `ckh` the
--           checkpoint registered ("" if none): what cache-event consumers are told was stored.
--
-- Everything registered here is pending (never matched) until `confirm(ticket)` (invariant 2).
-- The pins on the checkpoints this request restored from are dropped.
-- First writer wins: a hash already registered elsewhere is left alone, since both pages hold the
-- same prefix. A page is only hung under a parent that is ready or pending for this same request,
-- which keeps readiness prefix-closed along every chain (a ready page has ready ancestors). A
-- checkpoint may anchor on another request's pending endpoint (two requests of one step computing
-- the same prefix): it is matched only once that endpoint is confirmed too, and it is dropped with
-- the endpoint if that request is released unconfirmed (release rolls anchored checkpoints back).
-- A checkpoint's `gain` is the tokens it adds over the deepest kept (not intermediate, not spec)
-- checkpoint of its request so far (`pck`: its hit to begin with): what losing it costs a later
-- request that would hit it. The commit that completes a prompt re-classes the turn end the
-- request resumed from: `superseded` when the request registered a deeper kept checkpoint (the
-- conversation went on past it), `turn` again otherwise (an exact repeat), and `turn` too when it
-- is the prompt's own resend point (a block-aligned prompt resent: the hit stops one block short,
-- and the pass to the end registers the turn end, or finds it, past the one it restored). A
-- superseded turn end takes the `turn` checkpoint one block before it along (its resend point).

local m = load_meta(ARGV[1])
local batch = unpack_arg(ARGV[2], "batch")
if #ARGV - 2 > m.max_batch then fail("BADINPUT", "more commit groups than max_batch " .. m.max_batch) end
local nonces = {}
for i = 3, #ARGV do nonces[i - 2] = check_nonce(ARGV[i]) end
if #nonces == 0 then fail("BADINPUT", "a commit needs a ticket nonce") end
local B, PB, HL = m.block_tokens, m.blocks_per_page, m.hash_len
if #batch == 0 then fail("BADINPUT", "empty commit") end
if #batch > m.max_batch then fail("BADINPUT", "batch of " .. #batch .. " requests exceeds max_batch " .. m.max_batch) end

local reqs, seen, group_rids = {}, {}, {}
for n, item in ipairs(batch) do
  if type(item) ~= "table" or type(item.rid) ~= "string" then fail("BADINPUT", "each commit needs a string rid") end
  item.g = item.g or 1
  local open = #group_rids  -- the groups begun so far: an item stays in the last or begins the next
  if not is_int(item.g, math.max(open, 1), math.min(open + 1, #nonces)) then
    fail("BADINPUT", item.rid .. ": group " .. tostring(item.g) .. " out of order (groups 1 to "
         .. #nonces .. ", in order, none empty)")
  end
  if item.g > open then group_rids[item.g] = {} end
  if seen[item.rid] then fail("BADINPUT", "request " .. item.rid .. " appears twice in the commit") end
  seen[item.rid] = true
  local r = get_req(item.rid)
  if r == nil then fail("UNKNOWN", "unknown request " .. item.rid .. " (released, or the pool was invalidated)") end
  if r.stop == r.pos then fail("BADINPUT", item.rid .. ": no planned step to commit") end
  if not is_int(item.stop, r.pos + 1, r.stop) then
    fail("BADINPUT", item.rid .. ": stop must be an integer in (" .. r.pos .. ", " .. r.stop .. "]")
  end
  local c = item.ckpt_tokens
  if not is_int(c, 0) then fail("BADINPUT", item.rid .. ": ckpt_tokens must be an integer >= 0") end
  if c > 0 then
    if c % B ~= 0 then fail("BADINPUT", item.rid .. ": ckpt_tokens " .. c .. " is not on a " .. B .. "-token hash block boundary") end
    if c <= r.pos or c > item.stop then fail("BADINPUT", item.rid .. ": ckpt_tokens must lie in (" .. r.pos .. ", " .. item.stop .. "]") end
    if r.ck < 0 then fail("BADINPUT", item.rid .. ": no checkpoint pages were planned for this step") end
  end
  if type(item.kind) ~= "string" or not IS_COMMIT_KIND[item.kind] then
    fail("BADINPUT", item.rid .. ": kind must be one of " .. table.concat(COMMIT_KINDS, ", "))
  end
  reqs[n] = r
end
if #group_rids ~= #nonces then fail("BADINPUT", "a commit group without items") end

local first_ticket = m.ticket + 1
local ticket = first_ticket  -- the ticket of the item being registered
local removed = {}

-- Hang an owned page under its chain: the parent is whatever page holds the previous page-end,
-- and the page's path (its ancestors' page sets) is the parent's path plus the parent's set.
local function attach(rid, lead, rec, slot, hash_at)
  local par = -1
  if slot > 0 then
    local e = get_ep(hash_at(slot * PB))
    if e == nil then return false end
    local parent = get_rec(e[1])
    if get_rf(e[1]) < PB and parent.owner ~= rid then return false end
    redis.call("HSET", K_PATH, lead, (redis.call("HGET", K_PATH, e[1]) or "") .. pack_ids(parent.pages))
    par = e[1]
    parent.kids = parent.kids + 1
    save_lead(m, e[1], parent)
  end
  redis.call("HSET", K_RF, lead, 0)
  set_ref(lead, 1)  -- its owner's pin, implied while it was private
  rec.par, rec.st, rec.depth, rec.eps, rec.cks, rec.fill = par, "pending", (slot + 1) * PB * B, {}, {}, 0
  rec.cn, rec.cg = class_zeros(), class_zeros()
  return true
end

local function register_endpoints(rid, r, hash_at, upto, fills)
  local count = 0
  for i = r.reg + 1, upto do
    local h = hash_at(i)
    if redis.call("HEXISTS", K_EP, h) == 0 then
      local slot = math.floor((i - 1) / PB)
      local lead = r.own[slot - r.shared + 1]
      local rec = get_rec(lead)
      if rec.st == "private" and not attach(rid, lead, rec, slot, hash_at) then return count end
      rec.fill = i - slot * PB
      rec.eps[#rec.eps + 1] = {h, rec.fill}
      redis.call("HSET", K_EP, h, cmsgpack.pack({lead, rec.fill}))
      save_lead(m, lead, rec)
      fills[tostring(lead)] = rec.fill
      count = count + 1
    end
    r.reg = i
  end
  return count
end

local function register_checkpoint(rid, r, hash_at, blocks, kind, p)
  local h = hash_at(blocks)
  local existing = redis.call("HGET", K_CK, h)
  local e = get_ep(h)
  local ck_lead = r.ck
  r.ck = -1
  if existing or e == nil then
    free_set(m, get_rec(ck_lead))
    if existing and kind ~= "intermediate" then  -- a kept kind promotes what is worth less
      local rec = get_rec(tonumber(existing))
      if rec.cls == "intermediate" or rec.cls == "superseded" then
        reclass(m, tonumber(existing), rec, kind)
      end
    end
    return existing and "duplicate" or "unanchored"
  end
  local rec = get_rec(ck_lead)
  rec.st, rec.owner, rec.h, rec.anchor = "pending", "", h, e[1]
  set_ref(ck_lead, 0)
  rec.cls, rec.gain, rec.depth, rec.tk = kind, (blocks - r.pck) * B, blocks * B, ticket
  if kind == "intermediate" then rec.dur = 0 else rec.dur = 1 end
  stamp(m, rec)
  save_lead(m, ck_lead, rec)
  redis.call("HSET", K_CK, h, ck_lead)
  m.durable_cks = m.durable_cks + rec.dur
  local anchor = get_rec(e[1])
  anchor.cks[#anchor.cks + 1] = h
  local i = CLASS_INDEX[kind]
  anchor.cn[i], anchor.cg[i] = anchor.cn[i] + 1, anchor.cg[i] + rec.gain
  save_lead(m, e[1], anchor)
  p.ck, p.ckh = ck_lead, h
  if kind ~= "intermediate" and kind ~= "spec" then r.pck = blocks end
  -- Recycle this request's previous intermediate checkpoint: progress made it obsolete.
  if r.inter ~= "" then
    local old = redis.call("HGET", K_CK, r.inter)
    if old then
      local orec = get_rec(tonumber(old))
      if orec.st == "ready" and get_ref(old) == 0 and orec.cls == "intermediate" then drop_checkpoint(m, r.inter, removed) end
    end
  end
  if kind == "intermediate" then r.inter = h else r.inter = "" end
  return "registered"
end

-- The prompt is complete: the turn end it resumed from was superseded if it went further (and
-- the resend point before it with it), unless it is the prompt's own resend point (the deepest
-- boundary a hit on this prompt can reach).
local function settle_restored(r, hash_at)
  if m.kda_groups == 0 or r.hit == 0 then return end
  local lead = redis.call("HGET", K_CK, hash_at(r.hit / B))
  if not lead then return end
  local rec = get_rec(tonumber(lead))
  if rec.cls ~= "turn" and rec.cls ~= "superseded" then return end
  local cls = "turn"
  if r.pck * B > r.hit and r.hit < math.floor((r.tokens - 1) / B) * B then cls = "superseded" end
  if cls ~= rec.cls then reclass(m, tonumber(lead), rec, cls) end
  -- Its resend point (one block before it, a turn end's pair) is superseded with it: it served
  -- exact resends of a turn the conversation has left. An exact resend's plan promotes it back.
  if cls == "superseded" and r.hit > B then
    local partner = redis.call("HGET", K_CK, hash_at(r.hit / B - 1))
    if partner then
      local prec = get_rec(tonumber(partner))
      if prec.cls == "turn" then reclass(m, tonumber(partner), prec, "superseded") end
    end
  end
end

-- The forward pass read the restored state, so the step's copies are done: drop the restore pins
-- even when the plan ticket was never confirmed.
local function drop_restore_pins(r)
  local keep = {}
  for _, item in ipairs(r.pend) do
    if item.unpin >= 0 then unpin(m, item.unpin) else keep[#keep + 1] = item end
  end
  r.pend = keep
end

local out = {}
for n, item in ipairs(batch) do
  local r = reqs[n]
  ticket = first_ticket + item.g - 1
  drop_restore_pins(r)
  local blob = redis.call("HGET", K_REQH, item.rid)
  local function hash_at(i) return block_hash(blob, HL, i - r.hoff) end
  local p = {t = ticket, fills = {}, unpin = -1, ck = -1, ckh = ""}
  local first = r.reg
  local count = register_endpoints(item.rid, r, hash_at, math.floor(item.stop / B), p.fills)
  local stored = string.sub(blob, (first - r.hoff) * HL + 1, (r.reg - r.hoff) * HL)
  local parent = first > 0 and hash_at(first) or ""
  local ck_state = "none"
  if item.ckpt_tokens > 0 then
    ck_state = register_checkpoint(item.rid, r, hash_at, item.ckpt_tokens / B, item.kind, p)
  elseif r.ck >= 0 then
    free_set(m, get_rec(r.ck))
    r.ck = -1
  end
  if item.stop == r.tokens then settle_restored(r, hash_at) end
  r.pend[#r.pend + 1] = p
  r.pos, r.stop = item.stop, item.stop
  r.tix[#r.tix + 1] = ticket
  put_req(item.rid, r)
  local group = group_rids[item.g]
  group[#group + 1] = item.rid
  out[n] = {rid = item.rid, endpoints = count, ckpt = ck_state, stored = stored, parent = parent,
            ckh = p.ckh}
end
for g, rids in ipairs(group_rids) do new_ticket(m, rids, nonces[g]) end
save_meta(m)
return reply({ticket = first_ticket, nonce = nonces[1], requests = out, removed = removed})
