"""An independent, pure-Python model of the checkpoint policies at hash-block level (no Redis).

A request is its prefix-chained hash ids (one per 512-token block of the trace, the last maybe
partial) and its input length; requests are served one at a time in timestamp order (stable), and
each request's input end is its turn end (see `traces`). The model restates the index's rules
(index/lua: plan_step, commit, release, lib.lua's eviction) closely enough that every per-request
decision maps onto a `StepRequest` / `CommitItem` of the real index:

Lookup (plan_step). usable = min(complete blocks, floor((L - 1) / B)) so at least one token is
computed. MLA match m: binary search over page-end endpoints (prefix-closed), then the endpoints of
the first missing page, deepest first. Hit: the deepest boundary k <= m (in hash blocks) holding a
checkpoint (full-attention pools: k = m). Token-weighted hit ratio = sum(k * B) / sum(L).

Steps. The prefill runs from the hit to L in forward passes; each pass that crosses a hash block
writes a checkpoint at its last aligned position floor(stop / B) * B (`StepRequest.checkpoint`).
Pass ends (stops) come from the policy's per-request `Steps`:
  * `stop_at_match`: the first pass ends at the MLA match m * B when m > hit (a branch point);
  * `stop_at_page_end`: every pass also ends at each physical page end it would cross (a rung);
  * `chunk_tokens`: a pass computes at most that many tokens (chunked prefill);
  * the last pass ends at L: its checkpoint is the turn end.
Each checkpoint has a class: `turn` (last pass), `branch` (the pass ending at m), `rung` (a page
end), `intermediate` (a chunk end). In the real index `CommitItem.durable` is set for turn,
branch and rung; an intermediate one is recycled when the request registers its next checkpoint.

Conventions that reproduce the issue's figures (Mooncake trace, unlimited capacity, token-weighted;
target in brackets; `python -m cachetier.replay.policy_model` prints them):
  oracle    0.6504 [0.650]  full attention, 512-token blocks: hit = usable MLA match.
  seed      0.5088 [0.509]  one checkpoint per request, at floor(L/512)*512 (its turn end).
                            Chunking changes nothing at unlimited capacity: intermediate ones are
                            recycled and only the last (turn-end) checkpoint survives.
  branch    0.5820 [0.582]  seed + a durable checkpoint at m*512 when m > hit (the first pass of
                            the request that discovers the branch point ends there; that request
                            itself still hits only at its old checkpoint).
  ladder    0.6436 [0.644]  branch + a durable checkpoint at every 6,144-token page end p with
                            hit*512 < p < L that the prefill crosses (those between hit and m too).
  coupled   0.5463 [0.546]  hash block = page = 6,144 tokens; ONE checkpoint per request, at the
                            last 6,144-aligned position of its input (floor(L/6144)*6144), i.e. an
                            unchunked prefill. Checkpointing every page end crossed (what a chunked
                            prefill with page-sized chunks that keeps every chunk state gives, the
                            vLLM "all" mode) gives 0.5654 = full-6144.
  full-6144 0.5654 [0.565]  full attention, 6,144-token blocks.
Requests are served sequentially (each one's registrations visible to the next one): requests that
share a timestamp are not batched. A partial last block never hits (it has no hash).

Capacity. Budgets are bytes of the kimi-k3 preset in unified page ids (padding included):
page_id_bytes = page_bytes x layer_slots = 162,791,424 B; an MLA page set = 1 id, a checkpoint =
kda_groups = 3 ids; GB = 1e9 B, so 100 GB = 614 ids, 400 GB = 2,457, 1.6 TB = 9,828. The running
request holds a private state set (3 ids), its own MLA pages and, per pass, a checkpoint set.
Eviction follows the index: leaf-first over the page tree (an MLA page with registered children is
not evictable; evicting a page drops its endpoints and the checkpoints anchored on them, and its
parent inherits its last-used tick); pinned entries (the hit's anchor page until release, the
restored checkpoint until the first commit) are not evictable; among evictable entries the lowest
score goes first, ties by creation order. Page sets are what the real index makes of a prompt: a
request's own page for a slot is registered only if it holds a first-registered endpoint (first
writer wins), so a page the request shares only partially (a hit inside a page) is copied and
becomes a second page for the same slot. `last_used` is the plan tick at which a pin was dropped;
as in release.lua, a newly registered MLA page keeps last_used = 0 until a hit pins it
(`fresh_lu="zero"`; `fresh_lu="tick"` stamps it at release, for comparison).

The `adaptive` policy and what the index needs for it: see `adaptive()` below.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from cachetier.replay.traces import BLOCK_TOKENS, TraceRequest
from eviction.policy import TIER, EvictionWeights, lru

CkClass = Literal["intermediate", "turn", "branch", "rung", "spec", "superseded"]
TRACE_BLOCK = BLOCK_TOKENS


# -- policies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    block_tokens: int = 512
    page_tokens: int = 6144
    kda_groups: int = 3  # 0: a full-attention pool (no checkpoints)
    mla_groups: int = 1

    @property
    def blocks_per_page(self) -> int:
        return self.page_tokens // self.block_tokens


@dataclass(frozen=True)
class Steps:
    """A request's first-plan decisions, as the real index takes them: `StepRequest` flags and
    chunk size, and the class (hence `CommitItem.durable`) of each checkpoint kind it writes."""

    stop_at_match: bool = False
    stop_at_page_end: bool = False
    chunk_tokens: int | None = None
    checkpoint: bool = True
    rung_class: CkClass = "rung"
    rung_pages: int = 1  # a rung every this many page ends
    last_rung_only: bool = False  # only the deepest page end crossed
    last_rung_spec: bool = False  # the deepest rung is `spec_class` too
    spec_class: CkClass | None = None  # when set, the class of every rung but the deepest
    spec_free_only: bool = False  # a `spec` checkpoint is written only into free pages (no eviction)
    promote_spec: bool = False  # a `spec` checkpoint that is restored from becomes a `rung`
    admit: tuple[str, ...] = ()  # classes written only if their value beats what eviction takes
    admit_ratio: float = 1.0
    rung_min_age: float = 0.0  # write a rung only if the last evicted entry was last used at least
                               # this many ticks ago (pressure-aware admission); 0: always
    turn_end: bool = True  # write the turn-end checkpoint (the last pass)
    demote_restored: bool = False  # the turn end supersedes the checkpoint the request restored
    demote_classes: tuple[str, ...] = ("turn", "superseded")  # which restored classes it demotes


@dataclass(frozen=True)
class Lookup:
    """What the index tells the scheduler about a new request (`RequestPlan`)."""

    hit_tokens: int
    match_tokens: int
    input_tokens: int
    hit_class: str | None  # the class of the checkpoint it restores from


@dataclass(frozen=True)
class Scorer:
    """score = recency * last_used + bonus[class] + depth * value / pages (lowest evicted first).

    `bonus` has one entry per class the model knows: intermediate, turn, branch, rung (checkpoints)
    and mla (an MLA page). An MLA page anchoring checkpoints takes the highest bonus among the
    classes of its anchored checkpoints in `anchor_classes` (lib.lua: a page anchoring a durable
    checkpoint counts as durable). `value` is the checkpoint's or page's prefix tokens
    (`depth_term="prefix"`, lib.lua) or only the tokens it adds over the next shallower
    checkpoint of its chain when written (`depth_term="gain"`)."""

    recency: float = 1.0
    bonus: tuple[tuple[str, float], ...] = ()
    depth: float = 0.0
    depth_term: Literal["prefix", "gain", "ck-prefix"] = "prefix"
    anchor_classes: tuple[str, ...] = ("turn", "branch", "rung")
    clock: Literal["tick", "gds"] = "tick"
    fresh: Literal["zero", "tick"] = "zero"
    hit_bonus: float = 0.0  # added once an entry has been hit (restored from / pinned as anchor)
    freq: float = 0.0  # the value term is multiplied by 1 + freq * hits
    value_weight: tuple[tuple[str, float], ...] = ()  # per-class multiplier of the value term (1)
    value_cap: float = math.inf  # the value term (tokens per page id, after weights) is capped here
    gds_tie: float = 0.0  # with clock="gds": last_used = inflation value + gds_tie * plan tick

    def bonus_of(self, cls: str) -> float:
        return dict(self.bonus)[cls]

    @classmethod
    def from_weights(cls, w: EvictionWeights) -> Scorer:
        """The index's formula: durable = turn, branch and rung checkpoints."""
        return cls(recency=w.recency, depth=w.depth,
                   bonus=(("intermediate", w.intermediate), ("mla", w.mla), ("turn", w.durable),
                          ("branch", w.durable), ("rung", w.durable), ("superseded", w.intermediate)))


@dataclass(frozen=True)
class Policy:
    name: str
    geometry: Geometry
    # the same Steps for every request, or one per request from what its lookup found
    steps: Steps | Callable[[Lookup], Steps]
    scorer: Scorer = field(default_factory=lambda: Scorer.from_weights(lru()))
    unlimited_only: bool = False  # the oracle: no capacity, by definition


HYBRID = Geometry(512, 6144, 3)


def oracle() -> Policy:
    return Policy("oracle", Geometry(512, 6144, 0), (Steps(checkpoint=False)), unlimited_only=True)


def full_512() -> Policy:
    """The oracle's geometry under a budget: full attention, 512-token blocks in 6,144-token pages."""
    return Policy("full-512", Geometry(512, 6144, 0), (Steps(checkpoint=False)))


def full_6144() -> Policy:
    return Policy("full-6144", Geometry(6144, 6144, 0), (Steps(checkpoint=False)))


def seed() -> Policy:
    return Policy("seed", HYBRID, (Steps()))


def branch() -> Policy:
    return Policy("branch", HYBRID, (Steps(stop_at_match=True)))


def ladder() -> Policy:
    return Policy("ladder", HYBRID, (Steps(stop_at_match=True, stop_at_page_end=True)))


def coupled() -> Policy:
    return Policy("coupled", Geometry(6144, 6144, 3), (Steps()))


# -- the model's state ----------------------------------------------------------------------------

class _Page:
    """An MLA page set: private to its request until it registers an endpoint."""

    __slots__ = ("seq", "slot", "eps", "fill", "cks", "par", "kids", "lu", "anchored", "depth",
                 "ref", "registered", "alive", "ver", "hits")

    def __init__(self, seq: int) -> None:
        self.seq, self.slot, self.eps, self.fill, self.cks = seq, -1, [], 0, []
        self.par: _Page | None = None
        self.kids, self.lu, self.depth, self.ref, self.ver = 0, 0, 0, 1, 0
        self.anchored: dict[str, int] = {}
        self.registered, self.alive = False, True
        self.hits = 0


class _Ckpt:
    __slots__ = ("seq", "h", "blocks", "anchor", "cls", "lu", "depth", "gain", "ref", "alive", "ver",
                 "hits")

    def __init__(self, seq: int, h: int, blocks: int, anchor: _Page, cls: str, lu: int, depth: int,
                 gain: int) -> None:
        self.seq, self.h, self.blocks, self.anchor, self.cls = seq, h, blocks, anchor, cls
        self.lu, self.depth, self.gain, self.ref, self.alive, self.ver = lu, depth, gain, 0, True, 0
        self.hits = 0


@dataclass
class Stats:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    match_tokens: int = 0
    checkpoints_written: dict[str, int] = field(default_factory=dict)
    evicted_pages: int = 0
    refused: int = 0
    peak_pages: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


class Refused(Exception):
    """A step cannot get its pages even after evicting everything evictable."""


class _Request:
    __slots__ = ("chain", "length", "pos", "reg", "shared", "own", "inter", "anchor", "restored",
                 "prev_ck", "has_state")

    def __init__(self, chain: list[int], length: int) -> None:
        self.chain, self.length = chain, length
        self.pos = self.reg = self.shared = self.prev_ck = 0
        self.own: list[_Page] = []
        self.inter: int | None = None
        self.anchor: _Page | None = None
        self.restored: _Ckpt | None = None
        self.has_state = False


class Model:
    """The index's state for one policy and one capacity (page ids; None = unlimited)."""

    def __init__(self, policy: Policy, capacity: int | None = None) -> None:
        self.p, self.geo, self.capacity = policy, policy.geometry, capacity
        self.fresh_lu = policy.scorer.fresh
        self.gds = policy.scorer.clock == "gds"
        self.evicted_lu = -math.inf  # last_used of the most recently evicted entry
        self.evicted_v: float | None = None  # moving average of evicted entries' score - last_used
        self.clock = 0.0
        self.B, self.PB = self.geo.block_tokens, self.geo.blocks_per_page
        self.ratio = self.B // TRACE_BLOCK
        self.ep: dict[int, tuple[_Page, int]] = {}
        self.ck: dict[int, _Ckpt] = {}
        self.used = 0
        self.tick = 0
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.stats = Stats()
        sc = policy.scorer
        self._bonus = dict(sc.bonus)
        self._rank = {c: self._bonus[c] for c in sc.anchor_classes}
        self._prior = dict(sc.value_weight)

    def now(self) -> float:
        """The last-used stamp: the plan tick, or the GreedyDual inflation value."""
        return self.clock if self.gds else self.tick

    # -- eviction -------------------------------------------------------------------------------
    def _score(self, obj: _Page | _Ckpt) -> float:
        sc = self.p.scorer
        if isinstance(obj, _Ckpt):
            value = (obj.gain if sc.depth_term == "gain" else obj.depth) * (1 + sc.freq * obj.hits)
            return (sc.recency * obj.lu + self._bonus[obj.cls]
                    + sc.depth * min(sc.value_cap, self._prior.get(obj.cls, 1.0) * value / self.geo.kda_groups)
                    + (sc.hit_bonus if obj.hits else 0.0))
        bonus = self._bonus["mla"]
        for cls, n in obj.anchored.items():
            if n > 0 and cls in self._rank:
                bonus = max(bonus, self._rank[cls])
        if sc.depth_term in ("gain", "ck-prefix"):  # it lives and dies with its checkpoints
            value = (sum((c.gain if sc.depth_term == "gain" else c.depth) * (1 + sc.freq * c.hits)
                         * self._prior.get(c.cls, 1.0) for c in obj.cks)
                     / (self.geo.mla_groups + self.geo.kda_groups * len(obj.cks)))
        else:
            value = obj.depth / self.geo.mla_groups
        return (sc.recency * obj.lu + bonus + sc.depth * min(sc.value_cap, value)
                + (sc.hit_bonus if obj.hits else 0.0))

    def _touch(self, obj: _Page | _Ckpt) -> None:
        obj.ver += 1
        if obj.alive and obj.ref == 0 and (isinstance(obj, _Ckpt) or (obj.registered and obj.kids == 0)):
            heapq.heappush(self.heap, (self._score(obj), obj.seq, obj.ver, obj))

    def _head_score(self) -> float | None:
        while self.heap:
            score, _, ver, obj = self.heap[0]
            if obj.alive and obj.ver == ver:  # type: ignore[attr-defined]
                return score
            heapq.heappop(self.heap)
        return None

    def _evict_one(self) -> bool:
        while self.heap:
            score, _, ver, obj = heapq.heappop(self.heap)
            if obj.alive and obj.ver == ver:  # type: ignore[attr-defined]
                if self.gds:
                    self.clock = max(self.clock, score)
                self.evicted_lu = obj.lu  # type: ignore[attr-defined]
                v = score - obj.lu  # type: ignore[attr-defined]
                self.evicted_v = v if self.evicted_v is None else 0.99 * self.evicted_v + 0.01 * v
                if isinstance(obj, _Ckpt):
                    self._drop_ck(obj)
                    self.stats.evicted_pages += self.geo.kda_groups
                else:
                    self._drop_page(obj)  # type: ignore[arg-type]
                    self.stats.evicted_pages += self.geo.mla_groups
                return True
        return False

    def _drop_ck(self, c: _Ckpt) -> None:
        assert c.ref == 0
        c.alive = False
        del self.ck[c.h]
        a = c.anchor
        a.cks.remove(c)
        a.anchored[c.cls] -= 1
        self._touch(a)
        self.used -= self.geo.kda_groups

    def _drop_page(self, pg: _Page) -> None:
        for c in list(pg.cks):
            self._drop_ck(c)
        for h in pg.eps:
            del self.ep[h]
        pg.alive = False
        if pg.par is not None:
            pg.par.kids -= 1
            pg.par.lu = max(pg.par.lu, pg.lu)
            self._touch(pg.par)
        self.used -= self.geo.mla_groups

    def _ensure(self, need: int) -> None:
        if self.capacity is None:
            return
        while self.capacity - self.used < need:
            if not self._evict_one():
                raise Refused
        # a lower bound check like plan_step's is implied: eviction ran until it fit

    def _alloc(self, n: int) -> None:
        self.used += n
        self.stats.peak_pages = max(self.stats.peak_pages, self.used)

    # -- lookup ---------------------------------------------------------------------------------
    def mla_match(self, chain: Sequence[int], usable: int) -> int:
        lo, hi = 0, usable // self.PB
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid * self.PB - 1] in self.ep:
                lo = mid
            else:
                hi = mid - 1
        for f in range(min(self.PB - 1, usable - lo * self.PB), 0, -1):
            if chain[lo * self.PB + f - 1] in self.ep:
                return lo * self.PB + f
        return lo * self.PB

    def kda_match(self, chain: Sequence[int], depth: int) -> int:
        for k in range(depth, 0, -1):
            if chain[k - 1] in self.ck:
                return k
        return 0

    def chain_of(self, req: TraceRequest) -> list[int]:
        """Hash ids of the complete blocks at this geometry's block size."""
        r = self.ratio
        full = req.input_length // self.B
        return [req.hash_ids[(j + 1) * r - 1] for j in range(full)]

    # -- one request ----------------------------------------------------------------------------
    def serve(self, req: TraceRequest) -> int:
        """Serve one request; returns its hit in tokens."""
        chain, length = self.chain_of(req), req.input_length
        usable = min(len(chain), (length - 1) // self.B)
        match = self.mla_match(chain, usable)
        kda = self.geo.kda_groups
        hit = self.kda_match(chain, match) if kda and match else match
        steps = self.p.steps
        if not isinstance(steps, Steps):
            hit_class = self.ck[chain[hit - 1]].cls if kda and hit else None
            steps = steps(Lookup(hit * self.B, match * self.B, length, hit_class))
        self.spec_free_only = steps.spec_free_only
        self.rung_min_age = steps.rung_min_age
        self.admit = steps.admit
        self.admit_ratio = steps.admit_ratio
        r = _Request(chain, length)
        r.pos = r.reg = r.prev_ck = hit
        self.stats.requests += 1
        self.stats.input_tokens += length
        self.stats.match_tokens += match * self.B
        hit_ck = None
        if hit:
            r.anchor = self.ep[chain[hit - 1]][0]
            r.shared = hit // self.PB  # the anchor's page is shared only when the hit ends on it
            r.anchor.ref += 1
            r.anchor.hits += 1
            self._touch(r.anchor)
            if kda:
                r.restored = hit_ck = self.ck[chain[hit - 1]]
                r.restored.ref += 1
                r.restored.hits += 1
                self._touch(r.restored)
        try:
            for n, (stop, cls) in enumerate(self._stops(hit, match, length, steps)):
                self._step(r, stop, cls if steps.checkpoint else None, first=n == 0)
            if steps.promote_spec and hit_ck is not None and hit_ck.cls == "spec":
                self._reclass(hit_ck, "rung")
            if steps.demote_restored and hit_ck is not None and hit_ck.cls in steps.demote_classes:
                # a turn end this request continued past is superseded by its deeper checkpoint;
                # a hit that does not go deeper (an exact repeat) promotes it back
                self._reclass(hit_ck, "superseded" if r.prev_ck > hit else "turn")
        except Refused:
            self.stats.refused += 1
            if not r.has_state:  # refused at its first plan: served without the cache
                hit = 0
        self._release(r)
        self.stats.hit_tokens += hit * self.B
        return hit * self.B

    def _stops(self, hit: int, match: int, length: int, steps: Steps) -> list[tuple[int, str]]:
        """Pass ends after hit*B and the class of the checkpoint each one writes."""
        start = hit * self.B
        marks: dict[int, str | None] = {length: "turn" if steps.turn_end else None}
        if steps.stop_at_page_end:
            pt = self.geo.page_tokens
            step = pt * steps.rung_pages
            rungs = range((start // step + 1) * step, length, step)
            for p in rungs[-1:] if steps.last_rung_only else rungs:
                deepest = p == rungs[-1] and not steps.last_rung_spec
                marks.setdefault(p, steps.rung_class if deepest or not steps.spec_class
                                 else steps.spec_class)
        if steps.stop_at_match and match > hit:
            marks[match * self.B] = "branch"
        stops = sorted(marks)
        if steps.chunk_tokens:
            chunked, pos = [], start
            for s in stops:
                while s - pos > steps.chunk_tokens:
                    pos += steps.chunk_tokens
                    chunked.append((pos, "intermediate"))
                chunked.append((s, marks[s]))
                pos = s
            return chunked
        return [(s, marks[s]) for s in stops]

    def _step(self, r: _Request, stop: int, cls: str | None, first: bool) -> None:
        B, PT, kda = self.B, self.geo.page_tokens, self.geo.kda_groups
        self.tick += 1
        new_slots = -(-stop // PT) - (r.shared + len(r.own))
        want_ck = cls is not None and kda > 0 and stop // B > r.pos // B
        if want_ck and cls == "rung" and self.rung_min_age and self.tick - self.evicted_lu < self.rung_min_age:
            want_ck = False
        if want_ck and cls in self.admit and self.capacity is not None and self.evicted_v is not None:
            cand = _Ckpt(-1, -1, stop // B, r.own[-1] if r.own else r.anchor, cls, 0.0,
                         (stop // B) * B, (stop // B - r.prev_ck) * B)  # type: ignore[arg-type]
            want_ck = self._score(cand) > self.admit_ratio * self.evicted_v
        if want_ck and cls == "spec" and self.spec_free_only and self.capacity is not None:
            free = self.capacity - self.used - new_slots * self.geo.mla_groups - (kda if first else 0)
            want_ck = free >= kda
        need = new_slots * self.geo.mla_groups + (kda if first else 0) + (kda if want_ck else 0)
        self._ensure(need)
        self._alloc(need)
        r.has_state = r.has_state or (first and kda > 0)
        for _ in range(new_slots):
            r.own.append(_Page(next(self.seq)))
        # commit
        if r.restored is not None:
            r.restored.ref -= 1
            r.restored.lu = self.now()
            self._touch(r.restored)
            r.restored = None
        self._register(r, stop // B)
        if want_ck:
            self._checkpoint(r, stop // B, cls)  # type: ignore[arg-type]
        r.pos = stop

    def _register(self, r: _Request, upto: int) -> None:
        PB = self.PB
        for i in range(r.reg + 1, upto + 1):
            h = r.chain[i - 1]
            if h not in self.ep:
                slot = (i - 1) // PB
                pg = r.own[slot - r.shared]
                if not pg.registered and not self._attach(r, pg, slot):
                    return
                pg.fill = i - slot * PB
                pg.eps.append(h)
                self.ep[h] = (pg, pg.fill)
            r.reg = i

    def _attach(self, r: _Request, pg: _Page, slot: int) -> bool:
        if slot > 0:
            e = self.ep.get(r.chain[slot * self.PB - 1])
            if e is None:
                return False
            pg.par = e[0]
            e[0].kids += 1
            self._touch(e[0])
        pg.registered, pg.slot, pg.depth = True, slot, (slot + 1) * self.PB * self.B
        return True

    def _checkpoint(self, r: _Request, blocks: int, cls: str) -> None:
        kda = self.geo.kda_groups
        h = r.chain[blocks - 1]
        self.stats.checkpoints_written[cls] = self.stats.checkpoints_written.get(cls, 0) + 1
        existing = self.ck.get(h)
        e = self.ep.get(h)
        if existing is not None or e is None:
            self.used -= kda  # the new set is freed
            if existing is not None and cls != "intermediate" and existing.cls in ("intermediate", "superseded"):
                self._reclass(existing, cls)
            return
        anchor = e[0]
        c = _Ckpt(next(self.seq), h, blocks, anchor, cls, self.now(), blocks * self.B,
                  (blocks - r.prev_ck) * self.B)
        if cls not in ("spec", "intermediate"):
            r.prev_ck = blocks
        self.ck[h] = c
        anchor.cks.append(c)
        anchor.anchored[cls] = anchor.anchored.get(cls, 0) + 1
        self._touch(c)
        self._touch(anchor)
        if r.inter is not None:
            old = self.ck.get(r.inter)
            if old is not None and old.ref == 0 and old.cls == "intermediate":
                self._drop_ck(old)
        r.inter = h if cls == "intermediate" else None

    def _reclass(self, c: _Ckpt, cls: str) -> None:
        if not c.alive or c.cls == cls:
            return
        c.anchor.anchored[c.cls] -= 1
        c.cls = cls
        c.anchor.anchored[cls] = c.anchor.anchored.get(cls, 0) + 1
        self._touch(c)
        self._touch(c.anchor)

    def _release(self, r: _Request) -> None:
        kda = self.geo.kda_groups
        if r.restored is not None:
            r.restored.ref -= 1
            r.restored.lu = self.now()
            self._touch(r.restored)
        for pg in reversed(r.own):
            if not pg.registered:
                pg.alive = False
                self.used -= self.geo.mla_groups
                continue
            pg.ref -= 1
            if self.fresh_lu == "tick":
                pg.lu = self.now()
            self._touch(pg)
        if r.anchor is not None:
            r.anchor.ref -= 1
            r.anchor.lu = self.now()
            self._touch(r.anchor)
        if r.has_state:
            self.used -= kda  # the private state set

    # -- checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Accounting and structure: every live entry reachable, page counts add up."""
        pages = {id(pg): pg for pg, _ in self.ep.values()}
        used = len(pages) * self.geo.mla_groups + len(self.ck) * self.geo.kda_groups
        assert used == self.used, (used, self.used)
        for c in self.ck.values():
            assert c.alive and c.anchor.alive and self.ep[c.h][0] is c.anchor
        for pg in pages.values():
            assert pg.alive and (pg.par is None or pg.par.alive)


def simulate(trace: Iterable[TraceRequest], policy: Policy, capacity: int | None = None,
             fresh_lu: Literal["zero", "tick"] | None = None, check: bool = False) -> Stats:
    """`fresh_lu` overrides the policy's stamp of newly registered pages (index semantics)."""
    if policy.unlimited_only:
        capacity = None
    if fresh_lu is not None:
        policy = replace(policy, scorer=replace(policy.scorer, fresh=fresh_lu))
    model = Model(policy, capacity)
    for req in sorted(trace, key=lambda q: q.timestamp):
        model.serve(req)
        if check:
            model.check()
    return model.stats


def budget_pages(budget_bytes: float, preset: str = "kimi-k3") -> int:
    from cachetier.config import load_config
    return int(budget_bytes // load_config(preset).geometry.page_id_bytes)
