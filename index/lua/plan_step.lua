-- plan_step.lua - lookup + pin + allocate for a whole scheduling step, atomically.
--
-- KEYS    - the pool's keys, see lib.lua; KEYS[15], when given, a key the caller staged the new
--           requests' hash blobs in, one after the other in batch order (a big step's: Lua
--           interns every byte of an argument, GETRANGE reads only what the lookup probes); the
--           ARGV then holds no blob and the caller deletes the key
-- ARGV[1] - epoch the caller planned against
-- ARGV[2] - msgpack list of requests: {rid = str, compute = tokens to compute this step,
--           ckpt = 0|1 (persist a checkpoint when crossing a hash block), at_match = 0|1 (default 0: end the
--           step at the request's MLA match when that lies beyond its start: a branch point),
--           at_page = 0|1 (default 0: end the step at the next page end: a ladder rung),
--           at_last = 0|1 (default 0: end the step at the prompt's deepest page end before its
--           last token, when the step starts before it: the deepest rung), at_resend = 0|1
--           (default 0: end the step one hash block before the end of a prompt that ends on a
--           hash-block boundary, when the step starts before that: the deepest boundary an exact
--           resend can hit, since a hit leaves a token to compute), and for a new request
--           tokens = prompt length, hashes = n: ARGV[2 + n] holds the chained hashes of every
--           complete hash block, turn_end = a kept class of COMMIT_KINDS (optional: the class its
--           policy keeps the deepest boundary a hit can reach, floor((tokens - 1) / B) blocks,
--           as: its turn end, or a block-aligned prompt's resend point; when the hit lands
--           exactly there, the restored checkpoint is that kept one and an intermediate or
--           superseded one is promoted to it, as a duplicate commit would, so its writer does not
--           recycle it), lease = a deadline in ms (optional: the request's lease runs to it,
--           renewed by each step; release.lua reaps it past that)}.
--           An active request id continues its prefill; an unknown one is looked up.
-- ARGV[3..n-1] - the new requests' hash blobs (kept out of the msgpack batch: one copy less),
--           unless staged
-- ARGV[n]  - the new ticket's nonce (lib.lua `check_nonce`)
-- returns an array (lib.lua `array_reply`, in this order; index/store.py reads it by position):
--           {1, wc, epoch, ticket, nonce, evicted, removed = {{kind, hash}...}, requests =
--           {{rid, hit, match, start, stop, shared, own, state, ckpt, ckpt_tokens, copies}...}}
--           (`match` = the MLA match found at lookup, in tokens) where `shared` is the page table
--           of the slots served from the cache and `own` the request's page sets after them (both
--           uint32 ids, slot-major), `state` and `ckpt` page sets (uint32 ids) and `copies` the
--           restore and copy-on-write copies (each src, dst as uint32, offset, nbytes as uint64:
--           COPY_FORMAT), all packed little-endian so that neither side builds a table per id;
--           or {0, wc, reason, need, available}
--
-- Order matters (DESIGN.md invariant 1): every hit of the step is pinned before the first
-- eviction or allocation, so allocating for one request can never evict what another just hit.

-- The `-- phase` lines mark where each phase of the script ends, for `cachetier bench lookup
-- --phases` (cachetier/bench/lookup_phases.py); here they are comments and cost nothing.

local COPY_FORMAT = "<I4I4I8I8"  -- index/store.py COPY_FORMAT
-- phase start
local epoch_arg, batch_blob = ARGV[1], ARGV[2]
local m = load_meta(epoch_arg)
local nonce = check_nonce(ARGV[#ARGV])
-- phase end: meta
local batch = unpack_arg(batch_blob, "batch")
local B, PB, HL = m.block_tokens, m.blocks_per_page, m.hash_len
local PT = B * PB
local STAGED = KEYS[15]
local staged_bytes, blobs = 0, 0  -- the new requests' hashes seen so far
if #batch == 0 then fail("BADINPUT", "empty step: nothing to plan") end
if #batch > m.max_batch then fail("BADINPUT", "batch of " .. #batch .. " requests exceeds max_batch " .. m.max_batch) end
-- phase end: batch

-- The two-stage lookup (match_prefix) comes from match.lua, shared with probe and pin_prefix.

local STEP_FLAGS = {"ckpt", "at_match", "at_page", "at_last", "at_resend"}  -- each 0 or 1

local function check_request(item, seen)
  if type(item) ~= "table" or type(item.rid) ~= "string" or #item.rid == 0 then
    fail("BADINPUT", "each request needs a non-empty string rid")
  end
  if seen[item.rid] then fail("BADINPUT", "request " .. item.rid .. " appears twice in the step") end
  seen[item.rid] = true
  if not is_int(item.compute, 1) then fail("BADINPUT", item.rid .. ": compute must be an integer >= 1") end
  item.at_match, item.at_page, item.at_last = item.at_match or 0, item.at_page or 0, item.at_last or 0
  item.at_resend = item.at_resend or 0
  check_lease(item.rid, item.lease)
  for _, flag in ipairs(STEP_FLAGS) do
    if item[flag] ~= 0 and item[flag] ~= 1 then fail("BADINPUT", item.rid .. ": " .. flag .. " must be 0 or 1") end
  end
  if item.turn_end ~= nil and (not IS_COMMIT_KIND[item.turn_end] or item.turn_end == "intermediate") then
    fail("BADINPUT", item.rid .. ": turn_end must be one of " .. table.concat(COMMIT_KINDS, ", ")
      .. " but intermediate")
  end
  local r = get_req(item.rid)
  if r then
    if r.stop ~= r.pos then fail("BADINPUT", item.rid .. ": previous step not committed") end
    if r.pos >= r.tokens then fail("BADINPUT", item.rid .. ": prompt already complete") end
    return r, nil
  end
  if not is_int(item.tokens, 1, 1099511627776) then fail("BADINPUT", item.rid .. ": tokens must be an integer >= 1") end
  local count = math.floor(item.tokens / B)
  blobs = blobs + 1
  if STAGED then  -- blob n follows blob n - 1 in the staged key
    if item.hashes ~= blobs then fail("BADINPUT", item.rid .. ": staged hashes must be numbered in batch order") end
    staged_bytes = staged_bytes + count * HL
    return nil, staged_hashes(STAGED, staged_bytes - count * HL, count, HL)
  end
  local blob = is_int(item.hashes, 1, #ARGV - 3) and ARGV[2 + item.hashes]
  if not blob or #blob ~= count * HL then
    fail("BADINPUT", item.rid .. ": hashes must hold one " .. HL .. "-byte hash per complete " .. B .. "-token block")
  end
  return nil, held_hashes(blob, HL)
end

-- Staged hashes must be exactly the new requests' (a size check: a short key would read as
-- missing hashes, a longer one belongs to some other step).
local function check_staged()
  local size = redis.call("STRLEN", STAGED)
  if size ~= staged_bytes then
    fail("BADINPUT", "the staged hashes hold " .. size .. " bytes, the step's new requests " .. staged_bytes)
  end
end

-- The hit through anchor page z with `fill` blocks: its ancestors' page sets are served from the
-- cache, and z itself too when the hit ends on its page end; otherwise z is the copy source.
local function hit_pages(p, e)
  p.anchor = e[1]
  p.shared = redis.call("HGET", K_PATH, e[1]) or ""
  if e[2] == PB then
    p.shared = p.shared .. pack_ids(mla_pages(m, e[1]))
  else
    p.cow = e[2]
  end
end

-- Phase A (read-only): validate, look up, and size every request.
local plans, seen, need = {}, {}, 0
for n, item in ipairs(batch) do
  local r, hs = check_request(item, seen)
  local p = {item = item, r = r, hs = hs, anchor = -1, ckpt = -1, hit = 0, shared = "", cow = 0}
  -- phase end: validate
  if r == nil then
    local depth, e
    depth, p.hit, p.ckpt, e, p.ready = match_prefix(m, item.tokens, hs)
    p.match = depth * B
    if p.hit > 0 then hit_pages(p, e) end
    -- phase end: match
    -- A hit at the deepest boundary a hit can reach restores the checkpoint the prompt keeps
    -- there (its turn end, or an aligned prompt's resend point): it is kept (phase B).
    local deepest_hit = math.floor((item.tokens - 1) / B)
    if p.ckpt >= 0 and p.hit == deepest_hit then p.turn_end = item.turn_end end
    p.start, p.tokens, p.slots_have = p.hit * B, item.tokens, #p.shared / (4 * m.mla_groups)
    need = need + m.kda_groups
  else
    p.start, p.tokens, p.slots_have, p.match = r.pos, r.tokens, r.shared + #r.own, r.mt
  end
  p.stop = math.min(p.tokens, p.start + item.compute)
  if item.at_match == 1 and p.match > p.start then p.stop = math.min(p.stop, p.match) end
  if item.at_page == 1 then p.stop = math.min(p.stop, (math.floor(p.start / PT) + 1) * PT) end
  local last_page_end = math.floor((p.tokens - 1) / PT) * PT
  if item.at_last == 1 and last_page_end > p.start then p.stop = math.min(p.stop, last_page_end) end
  local resend_point = p.tokens - B
  if item.at_resend == 1 and p.tokens % B == 0 and resend_point > p.start then
    p.stop = math.min(p.stop, resend_point)
  end
  -- A commit may stop short of its plan, so a request can own slots beyond this step's stop.
  p.new_slots = math.max(0, math.ceil(p.stop / PT) - p.slots_have)
  p.want_ckpt = item.ckpt == 1 and m.kda_groups > 0 and math.floor(p.stop / B) > math.floor(p.start / B)
  need = need + p.new_slots * m.mla_groups
  if p.want_ckpt then need = need + m.kda_groups end
  plans[n] = p
  -- phase end: size
end
if STAGED then check_staged() end

-- With too few free pages, a lower bound on what eviction can free: every member frees at least
-- its own page set, but not the members this step pins (in `lru` exactly when evictable, as
-- save_lead keeps it: no record is read). With enough, nothing is evicted and the pins do not
-- matter.
local function evictable_after_pins()
  local pinned = {}
  for _, p in ipairs(plans) do
    if p.anchor >= 0 and redis.call("ZSCORE", K_LRU, p.anchor) then pinned[p.anchor] = m.mla_groups end
    if p.ckpt >= 0 and redis.call("ZSCORE", K_LRU, p.ckpt) then pinned[p.ckpt] = m.kda_groups end
  end
  local pages = m.lru_pages
  for _, n in pairs(pinned) do pages = pages - n end
  return pages
end

local free = free_count(m)
if free < need then
  local available = free + evictable_after_pins()
  if available < need then
    return array_reply(0, "pool exhausted: the step needs " .. need .. " pages, " .. available ..
                       " are free or evictable", need, available)
  end
end
-- phase end: capacity

-- Phase B: pin every hit, then evict, then allocate.
m.tick = m.tick + 1
for _, p in ipairs(plans) do
  if p.anchor >= 0 then pin(m, p.anchor, m.mla_groups) end
  if p.ckpt >= 0 then pin(m, p.ckpt, m.kda_groups) end
end
for _, p in ipairs(plans) do
  -- The class at lookup says whether to read the record; the record says what it is now (a
  -- request before this one may have promoted it already).
  local cls = p.turn_end and ready_class(p.ready)
  if cls == "intermediate" or cls == "superseded" then
    local rec = get_rec(p.ckpt)
    if rec.cls == "intermediate" or rec.cls == "superseded" then reclass(m, p.ckpt, rec, p.turn_end) end
  end
end
-- phase end: pins
local removed = {}
while free < need do
  if not evict_one(m, removed) then error("CT_CORRUPT eviction ran dry after the capacity check") end
  free = free_count(m)
end
-- phase end: evict
reserve(need)  -- every page set this step allocates, in one LPOP
-- phase end: reserve

local reqh_pairs, req_pairs = {}, {}  -- written once each, after the loop
-- The page sets allocated in this step, lead -> ids: the reply names them without reading their
-- records back (which would lose their ready-made encoding, lib.lua private_record).
local fresh_sets = {}

local function new_set(kind, groups, rid)
  local lead, ids = alloc_set(m, kind, groups, rid)
  fresh_sets[lead] = ids
  return lead, ids
end

local function set_pages(lead)
  return fresh_sets[lead] or get_rec(lead).pages
end

-- A new request's record; it keeps the hashes from one block before its first own page's parent
-- on, all that commit will ever read (that parent's page end, and the block before the hit: the
-- resend point of the turn end it restores, which settle_restored re-classes with it).
local function start_request(p, rid, copies)
  local shared = p.slots_have
  local hoff = math.max(shared * PB - 2, 0)
  local r = {tokens = p.tokens, pos = p.start, hit = p.start, mt = p.match, pin = p.anchor, spath = p.shared,
             own = {}, shared = shared, state = -1, ck = -1, reg = p.hit, pck = p.hit, inter = "",
             pend = {}, hoff = hoff, tix = {}}
  if m.kda_groups > 0 then
    local lead, ids = new_set("K", m.kda_groups, rid)
    r.state = lead
    if p.ckpt >= 0 then
      local src = ready_pages(p.ready)
      for g = 1, m.kda_groups do copies[#copies + 1] = struct.pack(COPY_FORMAT, src[g], ids[g], 0, m.kda_state_bytes) end
      r.pend[#r.pend + 1] = {t = m.ticket + 1, unpin = p.ckpt, fills = {}, ck = -1, ckh = ""}
    end
  end
  reqh_pairs[#reqh_pairs + 1], reqh_pairs[#reqh_pairs + 2] = rid, hash_run(p.hs, hoff + 1, p.hs.count)
  return r
end

local rids, out = {}, {}
for n, p in ipairs(plans) do
  local rid = p.item.rid
  local copies = {}
  local r = p.r or start_request(p, rid, copies)
  -- phase end: restore
  for s = 1, p.new_slots do
    local lead, ids = new_set("M", m.mla_groups, rid)
    r.own[#r.own + 1] = lead
    if s == 1 and p.cow > 0 then
      local src = mla_pages(m, p.anchor)
      for g = 1, m.mla_groups do
        copies[#copies + 1] = struct.pack(COPY_FORMAT, src[g], ids[g], 0, p.cow * B * m.mla_token_bytes)
      end
    end
  end
  -- phase end: slots
  r.ck = -1
  if p.want_ckpt then r.ck = new_set("K", m.kda_groups, rid) end
  r.stop = p.stop
  r.tix[#r.tix + 1] = m.ticket + 1
  req_pairs[#req_pairs + 1], req_pairs[#req_pairs + 2] = rid, cmsgpack.pack(r)
  lease(rid, p.item.lease)
  -- phase end: record
  rids[n] = rid
  local own, state, ckpt = {}, "", ""
  for i, lead in ipairs(r.own) do own[i] = pack_ids(fresh_sets[lead] or mla_pages(m, lead)) end
  if r.state >= 0 then state = pack_ids(set_pages(r.state)) end
  if r.ck >= 0 then ckpt = pack_ids(set_pages(r.ck)) end
  out[n] = {rid, r.hit, r.mt, p.start, p.stop, r.spath, table.concat(own), state, ckpt,
            p.want_ckpt and math.floor(p.stop / B) * B or 0, table.concat(copies)}
  -- phase end: answer
end
hset_pairs(K_REQ, req_pairs)
hset_pairs(K_REQH, reqh_pairs)
local ticket = new_ticket(m, rids, nonce)
save_meta(m)
-- phase end: writes
local answer = array_reply(1, m.epoch, ticket, nonce, #removed, removed, out)
-- phase end: reply
return answer
