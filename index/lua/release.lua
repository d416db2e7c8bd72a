-- release.lua - a finished or failed request gives back its pins and private pages.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2] - msgpack list of request ids
-- ARGV[3] - optional, the lease reaper: now in ms (the clock the leases were given by)
-- ARGV[4] - with ARGV[3], the most leases to reap: besides ARGV[2], up to that many requests
--           whose lease deadline is <= now are released, earliest first (bounded work per call)
-- returns msgpack {released = n, unknown = {rids}, removed = {...}, reaped = {rids}}
--
-- Registrations the request never confirmed are rolled back (their bytes may never have been
-- written): endpoints above the page's ready fill are removed with the checkpoints anchored on
-- them, and a page with nothing confirmed is freed. Confirmed pages stay cached and become
-- evictable, stamped as used now (else a new page would rank as never used and go first). The
-- request leaves the tickets it was waiting on, and a ticket left with no request is deleted.
-- Unknown ids are reported, not an error, so a retry after a timeout is harmless.

local m = load_meta(ARGV[1])
local rids = unpack_arg(ARGV[2], "request id list")
for _, rid in ipairs(rids) do
  if type(rid) ~= "string" then fail("BADINPUT", "request ids must be strings") end
end
local removed, unknown, released, reaped = {}, {}, 0, {}
if ARGV[3] ~= nil then
  local now, most = tonumber(ARGV[3]), tonumber(ARGV[4])
  if now == nil or not is_int(most, 1, 10000) then
    fail("BADINPUT", "the reaper needs now (ms) and a count in [1, 10000]")
  end
  local named = {}
  for _, rid in ipairs(rids) do named[rid] = true end
  for _, rid in ipairs(redis.call("ZRANGEBYSCORE", K_LEASE, "-inf", now, "LIMIT", 0, most)) do
    if not named[rid] then
      rids[#rids + 1] = rid
      reaped[#reaped + 1] = rid
    end
  end
end

if #rids == 0 then  -- a reaper's call that found nothing expired writes nothing: no write counted
  return reply({released = 0, unknown = {}, removed = {}, reaped = {}})
end

local function roll_back(rec, rf)
  local keep = {}
  for _, e in ipairs(rec.eps) do
    if e[2] > rf then
      local ck = redis.call("HGET", K_CK, e[1])
      if ck and get_rec(tonumber(ck)).anchor == rec.pages[1] then drop_checkpoint(m, e[1], removed) end
      redis.call("HDEL", K_EP, e[1])
    else
      keep[#keep + 1] = e
    end
  end
  return keep
end

local function leave_ticket(t, rid)
  local entry = cmsgpack.unpack(redis.call("HGET", K_TIX, t))
  remove_from(entry.rids, rid)
  if #entry.rids == 0 then
    redis.call("HDEL", K_TIX, t)
  else
    redis.call("HSET", K_TIX, t, cmsgpack.pack(entry))
  end
end

local function release_page(lead)
  local rec = get_rec(lead)
  if rec.st == "private" then free_set(m, rec) return end
  local rf = get_rf(lead)
  local keep = roll_back(rec, rf)
  rec = get_rec(lead)  -- roll_back may have rewritten this record's anchored checkpoints
  rec.eps, rec.fill = keep, rf
  if rf == 0 then
    if rec.par >= 0 then
      local parent = get_rec(rec.par)
      parent.kids = parent.kids - 1
      save_lead(m, rec.par, parent)
    end
    free_set(m, rec)
    return
  end
  rec.owner = ""
  set_ref(lead, get_ref(lead) - 1)
  stamp(m, rec)  -- handed to the cache now: its last use, not never
  save_lead(m, lead, rec)
end

for _, rid in ipairs(rids) do
  local r = get_req(rid)
  redis.call("ZREM", K_LEASE, rid)
  if r == nil then unknown[#unknown + 1] = rid else
    for _, item in ipairs(r.pend) do
      if item.unpin >= 0 then unpin(m, item.unpin) end
      if pending_checkpoint(item) then drop_checkpoint(m, item.ckh, removed) end
    end
    for s = #r.own, 1, -1 do release_page(r.own[s]) end
    if r.pin >= 0 then unpin(m, r.pin) end
    if r.state >= 0 then free_set(m, get_rec(r.state)) end
    if r.ck >= 0 then free_set(m, get_rec(r.ck)) end
    for _, t in ipairs(r.tix) do leave_ticket(t, rid) end
    redis.call("HDEL", K_REQ, rid)
    redis.call("HDEL", K_REQH, rid)
    released = released + 1
  end
end
save_meta(m)
return reply({released = released, unknown = unknown, removed = removed, reaped = reaped})
