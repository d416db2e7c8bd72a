-- confirm.lua - the bytes of tickets' copies and writes are on the device: make them matchable.
--
-- KEYS   - the pool's keys, see lib.lua
-- ARGV[1] - epoch
-- ARGV[2], ARGV[3], ... - pairs: the counter of a ticket returned by plan_step or commit, and its
--           nonce (a ticket whose nonce differs is unknown: lib.lua `check_nonce`); at most
--           max_batch pairs, confirmed in order, as one confirm call each would
-- returns msgpack {ticket, requests = {n per ticket}}: the highest ticket confirmed (absent if
--           none), and per ticket how many of its requests were still active, or -1 for a ticket
--           unknown here (already confirmed, the pool invalidated, or never issued), which
--           confirms nothing and leaves the other tickets to be confirmed
--
-- Confirmation is cumulative per request, like a device stream: confirming ticket t settles every
-- pending item of t's requests with a ticket <= t. A plan ticket's items release the pins on the
-- checkpoints that were copied into private state; a commit ticket's items raise each page's
-- ready fill and mark its checkpoint ready.

local m = load_meta(ARGV[1])
local pairs_given = (#ARGV - 1) / 2
if pairs_given < 1 or pairs_given ~= math.floor(pairs_given) then
  fail("BADINPUT", "confirm takes one or more (ticket, nonce) pairs")
end
if pairs_given > m.max_batch then
  fail("BADINPUT", pairs_given .. " tickets exceed max_batch " .. m.max_batch)
end
local tickets = {}
for i = 1, pairs_given do
  local ticket = tonumber(ARGV[2 * i])
  if not is_int(ticket, 0) then fail("BADINPUT", "ticket must be an integer") end
  tickets[i] = {ticket, check_nonce(ARGV[2 * i + 1])}
end

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

-- One ticket's confirmation: how many of its requests were still active, -1 if it is unknown.
local function confirm(ticket, nonce)
  local raw = redis.call("HGET", K_TIX, ticket)
  local entry = raw and cmsgpack.unpack(raw)
  if not entry or entry.n ~= nonce then return -1 end
  redis.call("HDEL", K_TIX, ticket)
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
  return count
end

local counts, highest = {}, nil  -- the highest ticket confirmed: what the caller's view has seen
for i, t in ipairs(tickets) do
  counts[i] = confirm(t[1], t[2])
  if counts[i] >= 0 and (highest == nil or t[1] > highest) then highest = t[1] end
end
if highest ~= nil then save_meta(m) end  -- none known: nothing was written
return reply({ticket = highest, requests = counts})
