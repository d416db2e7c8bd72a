-- confirm.lua - the bytes of a ticket's copies and writes are on the device: make them matchable.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2] - the counter of a ticket returned by plan_step or commit
-- ARGV[3] - its nonce: a ticket whose nonce differs is unknown (lib.lua `check_nonce`)
-- returns msgpack {ticket, requests = n}
--
-- Confirmation is cumulative per request, like a device stream: confirming ticket t settles every
-- pending item of t's requests with a ticket <= t. A plan ticket's items release the pins on the
-- checkpoints that were copied into private state; a commit ticket's items raise each page's
-- ready fill and mark its checkpoint ready.

local m = load_meta(ARGV[1])
local ticket = tonumber(ARGV[2])
if not is_int(ticket, 0) then fail("BADINPUT", "ticket must be an integer") end
local nonce = check_nonce(ARGV[3])
local raw = redis.call("HGET", K_TIX, ticket)
local entry = raw and cmsgpack.unpack(raw)
if not entry or entry.n ~= nonce then
  fail("UNKNOWN", "unknown ticket " .. ARGV[2] .. " (already confirmed, the pool was invalidated, "
       .. "or never issued)")
end
redis.call("HDEL", K_TIX, ticket)

local function settle(item)
  if item.unpin >= 0 then unpin(m, item.unpin) end
  for lead, fill in pairs(item.fills) do
    local id = tonumber(lead)
    local rec = get_rec(id)
    if rec ~= nil and rec.st ~= "private" and get_rf(id) < fill then
      redis.call("HSET", K_RF, id, fill)
      rec.st = "ready"
      save_lead(m, id, rec)
    end
  end
  if pending_checkpoint(item) then
    local rec = get_rec(item.ck)
    rec.st = "ready"
    save_lead(m, item.ck, rec)
    put_ready(rec)
  end
end

local count = 0
for _, rid in ipairs(entry.rids) do
  local r = get_req(rid)
  if r ~= nil then
    local keep = {}
    for _, item in ipairs(r.pend) do
      if item.t <= ticket then settle(item) else keep[#keep + 1] = item end
    end
    r.pend = keep
    remove_from(r.tix, ticket)
    put_req(rid, r)
    count = count + 1
  end
end
save_meta(m)
return reply({ticket = ticket, requests = count})
