-- lib.lua - helpers shared by every cachetier script. The loader (index/scripts.py) makes one
-- Redis Functions library of a preamble of constants it generates from eviction/policy.py (see
-- CLASSES below), this file, match.lua and every script's body as a registered function, so the
-- helpers are defined once when the library loads, not again by every call. Every function
-- starts with `begin_call(KEYS)`: the state below that lives for one call is set there.
--
-- Every script receives the same KEYS, in this order (all carry the pool's hash tag):
--   KEYS[1] meta   HASH  pool geometry, epoch, counters, eviction weights
--   KEYS[2] pages  HASH  page id -> msgpack record (absent = free)
--   KEYS[3] free   LIST  page ids freed in this epoch (ids >= meta.fresh were never used)
--   KEYS[4] ep     HASH  MLA endpoint: chained hash -> msgpack {lead page id, filled hash blocks}
--   KEYS[5] ck     HASH  checkpoint: boundary chained hash -> lead page id of its KDA page set
--   KEYS[6] lru    ZSET  evictable lead page ids, scored by the pool's eviction weights
--   KEYS[7] req    HASH  request id -> msgpack request record
--   KEYS[8] reqh   HASH  request id -> its prompt's chained hashes from its first own page on
--   KEYS[9] tix    HASH  ticket counter -> msgpack {n = its nonce, rids = request ids to confirm}
--   KEYS[10] rf    HASH  registered MLA lead -> ready (confirmed) hash blocks: matching reads it
--                        without decoding the page record
--   KEYS[11] path  HASH  registered MLA lead -> the page sets of all its ancestors, slot by slot,
--                        as little-endian uint32 page ids: the page table of any hit through it
--   KEYS[12] lease ZSET  request id -> the deadline (ms) of its lease, for the requests planned
--                        or pinned with one: the reaper (release.lua) releases them past it
--   KEYS[13] refs  HASH  registered lead -> its pins (`ref` below): a pin is one field, no record
--                        decoded; a private set has none (its one pin, its owner's, is implied)
--   KEYS[14] ckr   HASH  ready checkpoint: boundary chained hash -> its class (one byte, its
--                        CLASS_INDEX) and its page set (little-endian uint32 ids, the lead first):
--                        matching probes it alone and restoring reads it, no record decoded
--   KEYS[15] stage STRING plan_step only, when its caller staged the step's new hashes there
--                        (one call's key: the caller sets it just before and unlinks it after)
--
-- A "page set" is one page per cache group of one kind (MLA or KDA), allocated, pinned and freed
-- as a unit; its first page is the lead and holds the record; the other pages have none.
-- Errors are raised as "CT_<CODE> message" before any write, so a failed call changes nothing.
--
-- Records are msgpack maps. Ids are page ids, hashes raw chained-hash bytes; -1 or "" is none.
-- Tokens count from the prompt's start; blocks are hash blocks (meta.block_tokens tokens each).
--
-- Lead record, pages[lead], of every page set (alloc_set; `k` says which kind):
--   k       str    "M" an MLA page set, "K" a KDA page set (private state, or a checkpoint)
--   g       int    always 0; nothing reads it
--   pages   list   the set's page ids, one per cache group of its kind; pages[1] is the lead
--   st      str    "private" (its request's alone), "pending" (registered, never matched until
--                  its ticket is confirmed: invariant 2) or "ready"
--   ref     int    (kept in `refs`, not in the record) pins: 1 while its owner holds it, plus 1
--                  per hit or reader pinning it (MLA anchor) or per restore copying it
--                  (checkpoint); evictable only at 0
--   owner   str    request id that allocated it; "" once registered (checkpoint) or released
--   lu      int    meta.tick when last used (the recency term of `score`)
--   lc      num    meta.clock when last used (the GreedyDual term of `score`)
--   depth   int    tokens of the prefix it ends: an MLA page's page end, a checkpoint's
--                  boundary (0 while private); `score`'s depth term is depth / #pages
--   kids    int    registered MLA pages hung under it (leaf-first: evictable only at 0)
-- An MLA lead, once registered (commit.lua `attach`), also has:
--   par     int    lead of the page holding the previous page end (-1 on the first page)
--   eps     list   its endpoints, {hash, fill}, in registration order (each also in `ep`)
--   cks     list   hashes of the checkpoints anchored on its endpoints (evicted with it)
--   fill    int    hash blocks registered on it (<= blocks_per_page); `rf` holds those confirmed
--   cn      list   per class (CLASSES order): how many checkpoints in `cks` have that class
--   cg      list   per class: the sum of those checkpoints' `gain`
-- A checkpoint lead, once registered (commit.lua `register_checkpoint`), also has:
--   h       bytes  its boundary's chained hash (its field in `ck`)
--   anchor  int    the MLA lead holding the endpoint `h` (evicting that page drops it too)
--   cls     str    its class, one of CLASSES (`reclass` promotes or demotes it)
--   gain    int    tokens it adds over its request's deepest kept checkpoint before it (`pck`)
--   tk      int    the commit ticket that registered it (`pending_checkpoint` checks it)
--   dur     int    1 unless `cls` is "intermediate" (counted in meta.durable_cks)
--
-- Request record, req[rid] (plan_step `start_request`; pin_prefix keeps a reader's pins in one
-- without `mt` and `pck`, whose prompt ends at its hit):
--   tokens  int    prompt length
--   pos     int    tokens done: its hit, then each commit's stop
--   stop    int    where the planned step ends (= pos when no step awaits its commit)
--   hit     int    tokens served from the cache: where its prefill started
--   mt      int    tokens the MLA pages alone matched at lookup (>= hit)
--   pin     int    the hit's anchor MLA lead, pinned until release (-1 without a hit)
--   spath   bytes  the page table of the slots served from the cache (uint32 ids, slot-major)
--   shared  int    how many slots are served from the cache (the length of spath in page sets)
--   own     list   leads of its own MLA page sets, one per slot after `shared`
--   state   int    lead of its private KDA state set (-1 without KDA groups)
--   ck      int    lead of the checkpoint set planned for the current step (-1 if none)
--   reg     int    hash blocks whose endpoints are registered or found present (hit at first)
--   pck     int    blocks of its deepest kept (not intermediate, not spec) checkpoint, its hit
--                  to begin with: the base of the next checkpoint's `gain`
--   inter   bytes  hash of its latest intermediate checkpoint ("" if none), recycled when its
--                  next checkpoint registers
--   hoff    int    blocks cut off the front of its reqh blob (hash i is the blob's i - hoff)
--   tix     list   the tickets it still waits on (its rid is in each one's `tix` entry)
--   pend    list   what confirming each ticket settles, one map per ticket:
--                    t      int    the ticket (settled when one of its request's tickets
--                                  >= t is confirmed)
--                    unpin  int    a checkpoint lead whose restore pin then drops (-1; a
--                                  commit drops it earlier: the forward pass has read it)
--                    fills  map    MLA lead (as a string) -> the fill then ready on it
--                    ck     int    the checkpoint lead the commit registered (-1), then ready
--                    ckh    bytes  its hash ("")
--
-- Meta hash, meta: `core` holds the geometry (fixed for the pool's life, see create_pool.lua)
-- and the counters, numbers packed as little-endian doubles in this order (index/meta.py);
-- `layout`, `holder` and the weights are fields of their own:
--   num_pages        page ids in the pool
--   blocks_per_page  hash blocks per physical page
--   block_tokens     tokens per hash block
--   hash_len         bytes per chained hash
--   kda_groups       KDA cache groups: pages per checkpoint or state set (0: full attention)
--   mla_groups       MLA cache groups: pages per MLA page set
--   mla_token_bytes  bytes per token in an MLA page (the size of a partial page's copy)
--   kda_state_bytes  bytes of one group's state that a restore copies
--   max_batch        most requests in one plan_step or commit
--   epoch            the current epoch; a new one (invalidate_pool) voids every page id
--   fresh            the lowest page id never allocated in this epoch
--   tick             logical time: +1 per plan_step and pin_prefix (the `lu` stamps)
--   ticket           the last ticket counter issued (never reissued); a caller's ticket is the
--                    counter and the nonce it drew (index/tickets.py, `new_ticket`)
--   lru_pages        pages held by the members of `lru`, so a step's capacity check is O(1)
--   clock            the GreedyDual clock: evicting an entry raises it to the entry's lc plus
--                    its value term, when that is higher
--   durable_cks      registered checkpoints with dur = 1
--   wc               write calls so far, never going back (save_meta; reconcile_pool jumps it):
--                    a pool behind a caller's view of it lost writes (index.identity)
--   holder           the storage instance that last vouched for the pool (reconcile_pool)
--   layout           the record layout its keys hold (LAYOUT below; create_pool sets it)
--   w_*              the eviction weights: WEIGHT_FIELDS (EvictionWeights.as_pool_fields)

-- The call's keys, and every key of the pool but meta (what a new epoch UNLINKs: a fixed set,
-- O(1) each); set by begin_call.
local K_META, K_PAGES, K_FREE, K_EP, K_CK, K_LRU, K_REQ, K_REQH, K_TIX, K_RF, K_PATH, K_LEASE,
      K_REFS, K_CKR
local EPOCH_KEYS
-- The record layout: 2 keeps pins in `refs` and ready checkpoints in `ckr`, 3 the meta's geometry
-- and counters in its `core` field (create_pool takes an older pool's counters over, and starts
-- it over in a new epoch if it holds pages).
local LAYOUT = 3

local function fail(code, msg)
  error({err = "CT_" .. code .. " " .. msg})
end

local function unpack_arg(blob, what)
  local ok, value = pcall(cmsgpack.unpack, blob)
  if not ok or type(value) ~= "table" then fail("BADINPUT", what .. " is not a msgpack map or list") end
  return value
end

local function is_int(v, lo, hi)
  return type(v) == "number" and v == math.floor(v) and v >= lo and (hi == nil or v <= hi)
end

-- CLASSES, CLASS_INDEX, COMMIT_KINDS, IS_COMMIT_KIND, WEIGHT_FIELDS, W_BONUS and W_VALUE come
-- from the preamble the loader generates from eviction/policy.py (index/scripts.py): MLA leads
-- count their anchored checkpoints (`cn`) and sum their gains (`cg`) per class, in CLASSES order.

-- A per-class array of zeros, in CLASSES order: a new MLA lead's `cn` or `cg`.
local function class_zeros()
  local out = {}
  for i = 1, #CLASSES do out[i] = 0 end
  return out
end

-- The per-class weights as arrays in CLASSES order (`wb` bonus, `wv` value), for `score`.
local function class_weights(m)
  m.wb, m.wv = {}, {}
  for i = 1, #CLASSES do
    m.wb[i], m.wv[i] = m[W_BONUS[i]], m[W_VALUE[i]]
  end
end

-- The eviction weights are meta fields of their own, read on first use (`weights`), since most
-- calls score nothing; the geometry and counters every call reads are one packed field (below).
local function weights(m)
  if m.wb then return end
  local raw = redis.call("HMGET", K_META, unpack(WEIGHT_LIST))
  for i, field in ipairs(WEIGHT_LIST) do m[field] = tonumber(raw[i]) end
  class_weights(m)
end

-- The write count of the meta this call loaded (then saved), returned with every reply.
local META_WC = 0

-- A caller's view of the pool (ARGV[1] of every call that names an epoch): "epoch" or
-- "epoch:writes", the epoch it works in and the highest meta.wc it has been answered with. A
-- pool behind the view lost writes the caller saw (restarted from an older snapshot or backup,
-- failed over to a lagging replica): CT_ROLLBACK, never CT_STALE, so that nobody adopts the
-- older epoch (index.identity says what the caller does then).
local function check_view(m, view)
  local epoch, writes = string.match(view, "^(%d+):(%d+)$")
  epoch, writes = tonumber(epoch or view), tonumber(writes or 0)
  if epoch == nil then fail("BADINPUT", "epoch must be an integer") end
  if m.epoch < epoch or m.wc < writes then
    fail("ROLLBACK", "pool is at epoch " .. m.epoch .. " write " .. m.wc .. ", caller saw epoch "
         .. epoch .. " write " .. writes)
  end
  return epoch
end

-- The pool's geometry and counters (meta's `core` field: CORE_FORMAT, core_table and core_blob
-- come from the preamble, generated from index/meta.py), or nil for a pool never created.
local function read_meta()
  local raw = redis.call("HGET", K_META, CORE_FIELD)
  if not raw then return nil end
  return core_table(raw)
end

local function write_meta(m)
  redis.call("HSET", K_META, CORE_FIELD, core_blob(m))
end

local function load_meta(view)
  local m = read_meta()
  if m == nil then fail("NOPOOL", "unknown pool (not created): " .. K_META) end
  META_WC = m.wc
  if view ~= nil then
    local want = check_view(m, view)
    if want ~= m.epoch then fail("STALE", "pool epoch is " .. m.epoch .. ", caller has " .. want) end
  end
  return m
end

-- A weight a caller sends (WEIGHT_FIELDS: eviction.policy.EvictionWeights.as_pool_fields) must
-- be a finite number, so that every score is one.
local function check_weight(field, value)
  if value == nil or value ~= value or value == math.huge or value == -math.huge then
    fail("BADINPUT", field .. " must be a finite number")
  end
end

local function require_fields(fields, given)
  for field in pairs(fields) do
    if given[field] == nil then fail("BADINPUT", "missing pool field " .. field) end
  end
end

local function get_packed(key, field)
  local raw = redis.call("HGET", key, field)
  if not raw then return nil end
  return cmsgpack.unpack(raw)
end

local function get_ep(h) return get_packed(K_EP, h) end
local function get_req(rid) return get_packed(K_REQ, rid) end

-- Lead records and their pins are read at most once per call and written once, by `reply`
-- (flush_cached): a step touches the same lead several times (pin, reclass, its page set), and a
-- decode or an encode costs about as much as the HGET or HSET around it. Every read and write of
-- `pages` and `refs` goes through these caches (get_rec, put_rec, get_ref, set_ref, free_set),
-- so they are never stale; a script whose writes must land returns through `reply`.
local FLUSH_PAIRS = 1000  -- field-value pairs per HSET, well under Lua's stack

-- `encoded` holds a value's encoding made with it (cache_put_encoded), used while nobody has read the
-- value back (a reader may change it).
local function field_cache(key, decode, encode)
  return {key = key, decode = decode, encode = encode, vals = {}, dirty = {}, order = {},
          encoded = {}}
end

local RECS, REFS  -- id -> record, id -> pins (false: none); new caches for every call

local function cache_get(c, id)
  local v = c.vals[id]
  if v == nil then
    local raw = redis.call("HGET", c.key, id)
    v = raw and c.decode(raw) or false
    c.vals[id] = v
  end
  c.encoded[id] = nil
  return v or nil
end

local function cache_put(c, id, v)
  c.vals[id], c.encoded[id] = v, nil
  if not c.dirty[id] then
    c.dirty[id] = true
    c.order[#c.order + 1] = id
  end
end

local function cache_put_encoded(c, id, v, encoded)
  cache_put(c, id, v)
  c.encoded[id] = encoded
end

local function cache_drop(c, id)
  c.vals[id], c.dirty[id], c.encoded[id] = false, nil, nil
  redis.call("HDEL", c.key, id)
end

-- Field, value pairs written with as few HSETs as Lua's stack allows.
local function hset_pairs(key, args)
  for i = 1, #args, 2 * FLUSH_PAIRS do
    redis.call("HSET", key, unpack(args, i, math.min(#args, i + 2 * FLUSH_PAIRS - 1)))
  end
end

local function cache_flush(c)
  local args = {}
  for _, id in ipairs(c.order) do
    if c.dirty[id] and c.vals[id] then
      args[#args + 1], args[#args + 2] = id, c.encoded[id] or c.encode(c.vals[id])
    end
    c.dirty[id] = nil
  end
  c.order, c.encoded = {}, {}
  hset_pairs(c.key, args)
end

local function get_rec(id) return cache_get(RECS, tonumber(id)) end
local function put_rec(id, rec) cache_put(RECS, tonumber(id), rec) end
local function get_ref(id) return cache_get(REFS, tonumber(id)) end
local function set_ref(id, n) cache_put(REFS, tonumber(id), n) end

local function flush_cached()
  cache_flush(RECS)
  cache_flush(REFS)
end

local function get_rf(lead)
  return tonumber(redis.call("HGET", K_RF, lead))
end

-- An endpoint is matchable once its page has confirmed at least its fill.
local function matchable(h)
  local e = get_ep(h)
  if e == nil or get_rf(e[1]) < e[2] then return nil end
  return e
end

local function pack_ids(ids)
  local out = {}
  for i, id in ipairs(ids) do out[i] = struct.pack("<I4", id) end
  return table.concat(out)
end

-- An MLA lead's page set: the lead alone with one MLA group, so no record is read for it.
local function mla_pages(m, lead)
  if m.mla_groups == 1 then return {lead} end
  return get_rec(lead).pages
end

-- The ids pack_ids packed, from byte `first` of the blob on.
local function unpack_ids(blob, first)
  local out = {}
  for i = first, #blob - 3, 4 do out[#out + 1] = struct.unpack("<I4", blob, i) end
  return out
end

local function block_hash(blob, hl, i)
  return string.sub(blob, (i - 1) * hl + 1, i * hl)
end

-- A prompt's chained hashes (`count` of `hl` bytes, one per complete hash block) for a lookup,
-- wherever they are: a script argument (`held_hashes`), or a range of the key a big step staged
-- them in (`staged_hashes`, plan_step): Lua interns every byte of every argument (~1.2 ns a
-- byte: 38 us for a 1M-token prompt's 32 KB), while a lookup reads a few dozen hashes.
local function held_hashes(blob, hl)
  return {blob = blob, hl = hl, count = math.floor(#blob / hl)}
end

local function staged_hashes(key, offset, count, hl)
  return {key = key, offset = offset, hl = hl, count = count}
end

-- Hashes first..last (1-based, inclusive) as one string: one GETRANGE when staged.
local function hash_run(hs, first, last)
  if last < first then return "" end
  if hs.blob then return string.sub(hs.blob, (first - 1) * hs.hl + 1, last * hs.hl) end
  return redis.call("GETRANGE", hs.key, hs.offset + (first - 1) * hs.hl, hs.offset + last * hs.hl - 1)
end

local function hash_at(hs, i) return hash_run(hs, i, i) end

-- The class-dependent terms of the score (eviction.policy.EvictionWeights.terms): the highest
-- bonus and the value per page freed over what evicting `rec` removes (a checkpoint: itself; an
-- MLA page: itself and the checkpoints anchored on it).
local function terms(m, rec)
  weights(m)
  local freed = #rec.pages
  if rec.k == "K" then
    local i = CLASS_INDEX[rec.cls]
    return m.wb[i], m.wv[i] * rec.gain / freed
  end
  local bonus, value = m.w_mla, 0
  for i = 1, #CLASSES do
    if rec.cn[i] > 0 then
      if m.wb[i] > bonus then bonus = m.wb[i] end
      value = value + m.wv[i] * rec.cg[i]
      freed = freed + rec.cn[i] * m.kda_groups
    end
  end
  return bonus, value / freed
end

-- The eviction score: lower is evicted first. Mirrors eviction.policy.EvictionWeights.score.
local function score(m, rec)
  local bonus, value = terms(m, rec)
  return m.w_recency * rec.lu + m.w_clock * rec.lc + bonus + m.w_depth * rec.depth / #rec.pages
         + value
end

-- Last use: the logical tick and the GreedyDual clock at that moment.
local function stamp(m, rec)
  rec.lu, rec.lc = m.tick, m.clock
end

local function evictable(id, rec)
  return rec.st == "ready" and get_ref(id) == 0 and (rec.k == "K" or rec.kids == 0)
end

-- A ready checkpoint's `ckr` entry, under its hash: its class and its page set.
local function put_ready(rec)
  redis.call("HSET", K_CKR, rec.h, string.char(CLASS_INDEX[rec.cls]) .. pack_ids(rec.pages))
end

-- The class, the page set and the lead of a `ckr` entry.
local function ready_class(entry) return CLASSES[string.byte(entry, 1)] end
local function ready_pages(entry) return unpack_ids(entry, 2) end
local function ready_lead(entry) return (struct.unpack("<I4", entry, 2)) end

-- The single place that decides LRU membership: call after every change to a lead record or its
-- pins. meta.lru_pages counts the pages of every member, so a step's capacity check is O(1).
local function save_lead(m, id, rec)
  put_rec(id, rec)
  if evictable(id, rec) then
    m.lru_pages = m.lru_pages + #rec.pages * redis.call("ZADD", K_LRU, score(m, rec), id)
  else
    m.lru_pages = m.lru_pages - #rec.pages * redis.call("ZREM", K_LRU, id)
  end
end

-- Moves a registered checkpoint to another class; its anchor's per-class sums and
-- meta.durable_cks (the count of registered checkpoints with `dur` = 1) follow.
local function reclass(m, lead, rec, cls)
  local anchor = get_rec(rec.anchor)
  local i, j = CLASS_INDEX[rec.cls], CLASS_INDEX[cls]
  anchor.cn[i], anchor.cg[i] = anchor.cn[i] - 1, anchor.cg[i] - rec.gain
  anchor.cn[j], anchor.cg[j] = anchor.cn[j] + 1, anchor.cg[j] + rec.gain
  rec.cls = cls
  m.durable_cks = m.durable_cks - rec.dur
  if cls == "intermediate" then rec.dur = 0 else rec.dur = 1 end
  m.durable_cks = m.durable_cks + rec.dur
  save_lead(m, rec.anchor, anchor)
  save_lead(m, lead, rec)
  if rec.st == "ready" then put_ready(rec) end
end

local function free_count(m)
  return redis.call("LLEN", K_FREE) + (m.num_pages - m.fresh)
end

-- A new private lead record as msgpack, the map alloc_set makes, assembled from its constant
-- parts (made on the first call: a library's code may call nothing as it loads): a step writes
-- three per request, unread, and packing the table costs more.
local function fixstr(s) return string.char(0xa0 + #s) .. s end
local PRIVATE_HEAD, PRIVATE_PAGES, PRIVATE_OWNER, PRIVATE_TAIL

local function make_private_template()
  PRIVATE_HEAD, PRIVATE_PAGES, PRIVATE_OWNER = string.char(0x89) .. fixstr("k"), fixstr("pages"),
    fixstr("owner")
  PRIVATE_TAIL = fixstr("g") .. "\0" .. fixstr("st") .. fixstr("private") .. fixstr("lu") .. "\0"
    .. fixstr("lc") .. "\0" .. fixstr("depth") .. "\0" .. fixstr("kids") .. "\0"
end

local function private_record(kind, ids, owner)
  return PRIVATE_HEAD .. fixstr(kind) .. PRIVATE_PAGES .. cmsgpack.pack(ids) .. PRIVATE_OWNER
         .. cmsgpack.pack(owner) .. PRIVATE_TAIL
end

-- Page ids a step popped off the free list at once (`reserve`: exactly the pages it allocates,
-- after its evictions), handed out in order by alloc_set before it pops any more: the same ids,
-- in the same order, as one LPOP per page set (a miscount would leak ids: sanity_check's page
-- count catches it).
local RESERVED, NEXT_RESERVED = {}, 1

local function reserve(n)
  if n > 0 then RESERVED, NEXT_RESERVED = redis.call("LPOP", K_FREE, n) or {}, 1 end
end

local function alloc_set(m, kind, n, owner)
  local ids = {}
  while #ids < n and NEXT_RESERVED <= #RESERVED do
    ids[#ids + 1] = tonumber(RESERVED[NEXT_RESERVED])
    NEXT_RESERVED = NEXT_RESERVED + 1
  end
  if #ids < n then
    for _, id in ipairs(redis.call("LPOP", K_FREE, n - #ids) or {}) do ids[#ids + 1] = tonumber(id) end
  end
  while #ids < n do
    ids[#ids + 1] = m.fresh
    m.fresh = m.fresh + 1
  end
  cache_put_encoded(RECS, ids[1], {k = kind, g = 0, pages = ids, st = "private", owner = owner,
                                   lu = 0, lc = 0, depth = 0, kids = 0},
                    private_record(kind, ids, owner))
  return ids[1], ids
end

-- Only MLA leads have a ready fill and a path, only registered checkpoints a `ckr` entry.
local function free_set(m, rec)
  local lead = rec.pages[1]
  cache_drop(RECS, lead)
  if rec.st ~= "private" then cache_drop(REFS, lead) end
  if rec.k == "M" then
    redis.call("HDEL", K_RF, lead)
    redis.call("HDEL", K_PATH, lead)
  elseif rec.h then
    redis.call("HDEL", K_CKR, rec.h)
  end
  redis.call("RPUSH", K_FREE, unpack(rec.pages))
  m.lru_pages = m.lru_pages - #rec.pages * redis.call("ZREM", K_LRU, rec.pages[1])
end

local function remove_from(list, value)
  for i = #list, 1, -1 do
    if list[i] == value then table.remove(list, i) end
  end
end

-- Invariant 3: a checkpoint leaves every KDA group at once; its sibling pages are freed together.
local function drop_checkpoint(m, h, removed)
  local lead = tonumber(redis.call("HGET", K_CK, h))
  local rec = get_rec(lead)
  if get_ref(lead) > 0 then error("CT_CORRUPT pinned checkpoint dropped at page " .. lead) end
  redis.call("HDEL", K_CK, h)
  m.durable_cks = m.durable_cks - rec.dur
  local anchor = get_rec(rec.anchor)
  if anchor then
    remove_from(anchor.cks, h)
    local i = CLASS_INDEX[rec.cls]
    anchor.cn[i], anchor.cg[i] = anchor.cn[i] - 1, anchor.cg[i] - rec.gain
    save_lead(m, rec.anchor, anchor)
  end
  free_set(m, rec)
  removed[#removed + 1] = {"ck", h}
end

-- Leaf-first: only an MLA page without registered children is evicted; its parent may then become
-- a leaf, inheriting the child's recency so a hot chain is not cut at its root first.
local function drop_mla(m, id, rec, removed)
  while #rec.cks > 0 do drop_checkpoint(m, rec.cks[#rec.cks], removed) ; rec = get_rec(id) end
  for _, e in ipairs(rec.eps) do
    redis.call("HDEL", K_EP, e[1])
    removed[#removed + 1] = {"ep", e[1]}
  end
  if rec.par >= 0 then
    local parent = get_rec(rec.par)
    parent.kids = parent.kids - 1
    if rec.lu > parent.lu then parent.lu = rec.lu end
    if rec.lc > parent.lc then parent.lc = rec.lc end
    save_lead(m, rec.par, parent)
  end
  free_set(m, rec)
end

local function evict_one(m, removed)
  local top = redis.call("ZRANGE", K_LRU, 0, 0)
  if #top == 0 then return false end
  local id = tonumber(top[1])
  local rec = get_rec(id)
  local _, value = terms(m, rec)
  if rec.lc + value > m.clock then m.clock = rec.lc + value end  -- GreedyDual inflation
  if rec.k == "K" then drop_checkpoint(m, rec.h, removed) else drop_mla(m, id, rec, removed) end
  return true
end

-- Every write call saves the meta once, and counts itself in meta.wc (index.identity).
local function save_meta(m)
  m.wc = m.wc + 1
  META_WC = m.wc
  write_meta(m)
end

-- A pinned lead is never evictable: the first pin takes it out of the eviction order (`pages`
-- of its kind's group count), and nothing of its record changes, so none is read.
local function pin(m, id, pages)
  local n = get_ref(id)
  set_ref(id, n + 1)
  if n == 0 then m.lru_pages = m.lru_pages - pages * redis.call("ZREM", K_LRU, id) end
end

local function unpin(m, id)
  local rec, n = get_rec(id), get_ref(id)
  if rec == nil or n < 1 then error("CT_CORRUPT unpin of unpinned page " .. id) end
  set_ref(id, n - 1)
  stamp(m, rec)
  save_lead(m, id, rec)
end

-- A ticket is its counter and the nonce its caller drew (index/tickets.py: Lua has no secret
-- randomness), stored with the ticket's requests: confirm must name both, so the next counter
-- value, or a counter issued again in another epoch or life of the pool, is an unknown ticket.
local function check_nonce(arg)
  local nonce = tonumber(arg)
  if not is_int(nonce, 0, TICKET_NONCES - 1) then
    fail("BADINPUT", "the ticket nonce must be an integer in [0, " .. TICKET_NONCES .. ")")
  end
  return nonce
end

local function new_ticket(m, rids, nonce)
  m.ticket = m.ticket + 1
  redis.call("HSET", K_TIX, m.ticket, cmsgpack.pack({n = nonce, rids = rids}))
  return m.ticket
end

local function put_req(rid, r)
  redis.call("HSET", K_REQ, rid, cmsgpack.pack(r))
end

-- A commit's pending checkpoint may have been dropped since (its anchor page evicted): only the
-- record registered by that very ticket under that hash is the one the item speaks of.
local function pending_checkpoint(item)
  if item.ck < 0 or redis.call("HGET", K_CK, item.ckh) ~= tostring(item.ck) then return false end
  local rec = get_rec(item.ck)
  return rec.st == "pending" and rec.tk == item.t
end

-- A lease deadline a caller sends (ms, its clock) is a finite number or nil (no lease).
local function check_lease(rid, deadline)
  if deadline ~= nil and (type(deadline) ~= "number" or deadline ~= deadline
                          or deadline == math.huge or deadline == -math.huge) then
    fail("BADINPUT", rid .. ": a lease deadline must be a finite number")
  end
end

-- A request's lease runs to `deadline`; nil: it keeps the one it has (or none).
local function lease(rid, deadline)
  if deadline ~= nil then redis.call("ZADD", K_LEASE, deadline, rid) end
end

-- Every reply carries the pool's write count (`wc`): callers keep the highest as their view.
local function reply(result)
  flush_cached()
  result.wc = META_WC
  return cmsgpack.pack(result)
end

-- The same as a RESP array, {status, wc, ...} (plan_step, called every scheduling step):
-- Redis converts the table in C and the client's hiredis parses it, where a msgpack map costs
-- a pack here and an unpack there. No element may be nil (a nil ends a Lua array), and numbers
-- arrive as integers (Redis truncates them).
local function array_reply(status, ...)
  flush_cached()
  return {status, META_WC, ...}
end

-- The start of every call: its keys, and fresh per-call state (the caches, the write count its
-- reply carries, the step's reserved ids).
local function begin_call(keys)
  K_META, K_PAGES, K_FREE, K_EP, K_CK, K_LRU, K_REQ, K_REQH, K_TIX, K_RF, K_PATH, K_LEASE,
    K_REFS, K_CKR = unpack(keys, 1, 14)
  EPOCH_KEYS = {K_PAGES, K_FREE, K_EP, K_CK, K_LRU, K_REQ, K_REQH, K_TIX, K_RF, K_PATH, K_LEASE,
                K_REFS, K_CKR}
  RECS = field_cache(K_PAGES, cmsgpack.unpack, cmsgpack.pack)
  REFS = field_cache(K_REFS, tonumber, tostring)
  META_WC = 0
  RESERVED, NEXT_RESERVED = {}, 1
  if PRIVATE_HEAD == nil then make_private_template() end
end
