"""An independent, pure-Python model of the checkpoint policies at hash-block level (no Redis).

A test oracle, not part of the shipped package: it restates the index's rules (index/lua:
plan_step, commit, release and lib.lua's eviction) in plain Python, so that the policies' figures
can be told apart from the code that produces them. tests/test_replay_model.py checks the model
alone: the hand-made trace of tests/hand_trace.py (every hit worked out there), and its own
invariants (`Model.check`) under a budget. tests/test_replay.py runs the real index (`cachetier
replay`'s runners) on the same hand trace, and against this model request by request on a
synthetic agentic trace: the same hit for every request and as many checkpoints alive at the end,
for each baseline, at unlimited capacity. Nothing compares the two under a budget, nor for the
adaptive policy.

A request is its prefix-chained hash ids (one per 512-token block of the trace, the last maybe
partial) and its input length; requests are served one at a time in timestamp order (stable), and
each request's input end is its turn end (see cachetier.replay.traces). A policy's per-request
decisions (`Steps`) are those a `CheckpointPlacement` makes for the real index: `StepRequest`
flags, chunk size, and the class each `CommitItem` gives its checkpoint.

Lookup (plan_step). usable = min(complete blocks, floor((L - 1) / B)), so at least one token is
computed. MLA match m: binary search over page-end endpoints (prefix-closed), then the endpoints of
the first missing page, deepest first. Hit: the deepest boundary k <= m (in hash blocks) holding a
checkpoint (full-attention pools: k = m). Token-weighted hit ratio = sum(k * B) / sum(L).

Passes. The prefill runs from the hit to L in forward passes; each pass that crosses a hash block
writes a checkpoint at its last aligned position floor(stop / B) * B (`StepRequest.checkpoint`).
Pass ends come from the policy's per-request `Steps`:
  * `stop_at_match`: the first pass ends at the MLA match m * B when m > hit (a branch point);
  * `stop_at_page_end`: a pass also ends at every physical page end it would cross (a rung), or
    with `last_rung_only` at the deepest one only;
  * `chunk_tokens`: a pass computes at most that many tokens (chunked prefill);
  * the last pass ends at L: its checkpoint is the turn end (unless `turn_end=False`);
  * a prompt ending on a block boundary (L % B == 0) also ends a pass at L - B, its resend point
    (the deepest boundary an exact resend can hit, since a hit leaves a token to compute), whose
    checkpoint is kept as a `turn` too (unless `turn_end=False`).
Checkpoint classes (eviction.policy.CLASSES): `turn` (last pass), `branch` (the pass ending at m),
`rung` (a page end), `spec` (a page end that is not the request's deepest, when `spec_rungs`),
`intermediate` (a chunk end: recycled when the request registers its next checkpoint),
`superseded` (a turn end that a later request restored and continued past, when
`demote_restored`, with the `turn` checkpoint one block before it, its resend point; an exact
repeat promotes it back to `turn`, and a request restoring its own resend point leaves it a
`turn`). The real index knows them all: a commit names one of the first five (`CommitItem.kind`),
and commit.lua demotes and promotes turn ends itself.

Conventions that reproduce the figures the policies were designed to (Mooncake trace, unlimited
capacity, token-weighted, target in brackets; `python -m tests.policy_model --unlimited-only`, run
from the repository root, prints them, and `cachetier replay` gets the same from the real index):
  oracle    0.6504 [0.650]  full attention, 512-token blocks: hit = the usable MLA match.
  seed      0.5088 [0.509]  one checkpoint per request, at floor(L/512)*512 (its turn end), and
                            one more at L - 512 for the 4 requests with L % 512 == 0.
                            Chunking changes nothing at unlimited capacity: intermediate checkpoints
                            are recycled and only the turn end survives.
  branch    0.5820 [0.582]  seed + a kept checkpoint at m*512 when m > hit: the request that
                            finds the branch point ends its first pass there (it still hits only
                            at its old checkpoint; the next request sharing the prefix hits at m).
  ladder    0.6436 [0.644]  branch + a kept checkpoint at every 6,144-token page end p with
                            hit*512 < p < L that the prefill crosses (those between hit and m too).
  coupled   0.5463 [0.546]  hash block = page = 6,144 tokens and ONE checkpoint per request, at
                            floor(L/6144)*6144 (an unchunked prefill). Checkpointing every page end
                            crossed (a page-chunked prefill keeping every chunk's state, vLLM's
                            "all" mode) gives 0.5654, which is full-6144.
  full-6144 0.5654 [0.565]  full attention, 6,144-token blocks.
Requests are served strictly one after the other (each one's registrations visible to the next);
requests sharing a timestamp are not batched. A partial last block never hits (it has no hash).

Capacity. Budgets are bytes of the kimi-k3 preset in unified page ids (padding included):
page_id_bytes = page_bytes x layer_slots = 162,791,424 B; an MLA page set = 1 id, a checkpoint =
kda_groups = 3 ids; GB = 1e9 B, so 100 GB = 614 ids, 400 GB = 2,457, 1.6 TB = 9,828. The running
request also holds its private state set (3 ids), its own MLA pages and, per pass, a checkpoint
set. Eviction follows the index: leaf-first over the page tree (an MLA page with registered
children is not evictable; evicting a page drops its endpoints and the checkpoints anchored on
them, and its parent inherits its last-used stamps); pinned entries (the hit's anchor page until
release, the restored checkpoint until the first commit) are not evictable; the lowest score goes
first, ties by creation order (the index breaks ties by page id, so under a budget the two may
evict equal scores in another order). Page sets are what the index makes of a prompt: a request's
page for a slot is kept only if it registers an endpoint first (first writer wins), so a page
shared only partially (a hit inside a page) is copied and becomes a second page for that slot.
Last-used stamps: `lu` = the plan tick when a pin is dropped or a checkpoint registered, and, with
`fresh="tick"`, when release hands a request's new MLA pages to the cache, as release.lua does.
`fresh="zero"` (the baselines' default, an earlier release.lua) leaves them at lu = 0 until a hit
pins them; the two differ only once something is evicted.

Score (eviction.policy.EvictionWeights' formula, as lib.lua's `score` evaluates it; a policy's
`Scorer` holds its weights):
  score = recency * lu + clock * lc + bonus[class] + depth * prefix_tokens / pages
          + value[class] * gain / pages
An MLA page's bonus is the highest of `mla` and its anchored checkpoints' classes' bonuses. `lc`
is a second stamp taken at the same moments as `lu`: the pool's GreedyDual inflation value,
which eviction raises to lc + value term of each entry it evicts. `gain` = the tokens a
checkpoint adds over the deepest kept checkpoint (neither intermediate nor spec) its request had
restored or written before it (what losing it costs a request that would hit it); an MLA page
carries the sum of its anchored checkpoints' terms over its own page plus theirs (they are
evicted with it), and a page with none has value 0.

The `adaptive` policy (see `adaptive()`): two modes, and the pool follows whichever mode's
metadata-only shadow copy (this model, fed every request's hash ids) served more tokens over the
last 1,000 requests (decided every 100, switching only past a 0.002 margin); the first mode at
unlimited capacity.
  `value` mode (GreedyDual on prefill tokens saved per page id, Marconi-like; eviction.policy
    `value()`): branch points, page-end rungs (the deepest one a request crosses is a `rung`, the
    others `spec`), turn ends; a restored turn end the request continues past becomes
    `superseded` (an exact repeat promotes it back). score = lc + value[class] * gain / pages,
    value = branch 2, turn 1, rung 1, superseded 0.2, spec 0.02 (tokens per page id: a
    checkpoint weighs 3 ids = 18,432 MLA tokens).
  `recency` mode (deep agentic sessions under a tight budget; eviction.policy `recency()`):
    checkpoints only at the deepest page end a request crosses (a turn end only for prompts
    shorter than a page: no partial page and no superseded checkpoint per turn), the LRU tiers
    with spec and superseded checkpoints in the intermediate tier.
The real index implements all of it (release's recency stamp, checkpoint classes and gains, the
GreedyDual clock, demotion, `stop_at_last_page_end`, `reweigh.lua`); cachetier/replay/adaptive.py
is the runner with its shadow pools.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cachetier.replay.traces import BLOCK_TOKENS, TraceRequest
from eviction.policy import CLASSES, TIER

DURABLE = ("turn", "branch", "rung")  # what the LRU tiers of `recency()` keep above MLA pages
GB = 10**9


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
class Lookup:
    """What the index tells the scheduler about a new request (`RequestPlan`)."""

    hit_tokens: int
    match_tokens: int
    input_tokens: int
    hit_class: str | None  # the class of the checkpoint it restores from


@dataclass(frozen=True)
class Steps:
    """A request's decisions, as a `CheckpointPlacement` takes them for the real index:
    `StepRequest` flags and chunk size, and the class of each checkpoint its passes write
    (`CommitItem.kind`)."""

    stop_at_match: bool = False
    stop_at_page_end: bool = False
    last_rung_only: bool = False  # end a pass only at the deepest page end the prefill crosses
    spec_rungs: bool = False  # rungs other than the deepest are `spec` (else `rung`)
    turn_end: bool = True  # the last pass writes the turn-end checkpoint
    chunk_tokens: int | None = None
    checkpoint: bool = True  # False: no pass writes a checkpoint (full attention)
    demote_restored: bool = False  # a restored turn end the request continues past: `superseded`


@dataclass(frozen=True)
class Scorer:
    """score = recency * lu + clock * lc + bonus[class] + depth * prefix / pages
               + value[class] * gain / pages; the lowest is evicted first.

    An MLA page's bonus is the highest of `mla` and its anchored checkpoints' classes' bonuses,
    as in lib.lua's `terms`."""

    recency: float = 1.0
    clock: float = 0.0
    bonus: tuple[tuple[str, float], ...] = ()
    depth: float = 0.0
    value: tuple[tuple[str, float], ...] = ()
    fresh: Literal["zero", "tick"] = "zero"

    @classmethod
    def lib_lua(cls, recency: float = 1.0, mla: float = TIER, intermediate: float = 0.0,
                durable: float = 2 * TIER, depth: float = 0.0,
                fresh: Literal["zero", "tick"] = "zero") -> Scorer:
        """The LRU tiers of eviction.policy as the index evaluates them. The defaults are
        `recency()` (spec and superseded checkpoints in the intermediate tier), which is `lru()`
        on every class the baselines write."""
        bonus = {"mla": mla, **{c: intermediate for c in CLASSES},
                 **{c: durable for c in DURABLE}}
        return cls(recency=recency, bonus=tuple(bonus.items()), depth=depth, fresh=fresh)


@dataclass(frozen=True)
class Policy:
    name: str
    geometry: Geometry
    # the same Steps for every request, or one per request from what its lookup found
    steps: Steps | Callable[[Lookup], Steps]
    scorer: Scorer = field(default_factory=Scorer.lib_lua)
    unlimited_only: bool = False  # the oracle: no capacity, by definition


@dataclass(frozen=True)
class AdaptivePolicy:
    """Modes sharing one geometry; the live pool runs the mode whose shadow did best lately."""

    name: str
    modes: tuple[Policy, ...]
    window: int = 1000  # requests over which shadows are compared
    every: int = 100  # requests between decisions
    margin: float = 0.002  # a challenger must beat the current mode by this hit-ratio margin

    @property
    def geometry(self) -> Geometry:
        return self.modes[0].geometry


HYBRID = Geometry(512, 6144, 3)
FULL_512 = Geometry(512, 6144, 0)


class _ShortPromptTurnEnd:
    """Checkpoints at page ends only; a turn end only for prompts shorter than a page."""

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens

    def __call__(self, lookup: Lookup) -> Steps:
        return Steps(stop_at_page_end=True, last_rung_only=True,
                     turn_end=lookup.input_tokens < self.page_tokens)


def oracle() -> Policy:
    return Policy("oracle", FULL_512, Steps(checkpoint=False), unlimited_only=True)


def full_512(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    """The oracle's geometry under a budget: full attention, 512-token blocks in 6,144 pages."""
    return Policy("full-512", FULL_512, Steps(checkpoint=False), Scorer.lib_lua(fresh=fresh))


def full_6144(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    return Policy("full-6144", Geometry(6144, 6144, 0), Steps(checkpoint=False),
                  Scorer.lib_lua(fresh=fresh))


def seed(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    return Policy("seed", HYBRID, Steps(), Scorer.lib_lua(fresh=fresh))


def branch(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    return Policy("branch", HYBRID, Steps(stop_at_match=True), Scorer.lib_lua(fresh=fresh))


def ladder(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    return Policy("ladder", HYBRID, Steps(stop_at_match=True, stop_at_page_end=True),
                  Scorer.lib_lua(fresh=fresh))


def coupled(fresh: Literal["zero", "tick"] = "zero") -> Policy:
    return Policy("coupled", Geometry(6144, 6144, 3), Steps(), Scorer.lib_lua(fresh=fresh))


VALUE_WEIGHTS = (("branch", 2.0), ("turn", 1.0), ("rung", 1.0), ("superseded", 0.2), ("spec", 0.02),
                 ("intermediate", 0.0))


def value_mode() -> Policy:
    """GreedyDual on prefill tokens saved per page id, weighted by class (see the docstring)."""
    steps = Steps(stop_at_match=True, stop_at_page_end=True, spec_rungs=True, demote_restored=True)
    scorer = Scorer(recency=0.0, clock=1.0, bonus=tuple((c, 0.0) for c in (*CLASSES, "mla")),
                    value=VALUE_WEIGHTS, fresh="tick")
    return Policy("adaptive/value", HYBRID, steps, scorer)


def recency_mode() -> Policy:
    """LRU tiers with checkpoints at page ends: the least bytes per session chain."""
    return Policy("adaptive/recency", HYBRID, _ShortPromptTurnEnd(HYBRID.page_tokens),
                  Scorer.lib_lua(fresh="tick"))


def adaptive() -> AdaptivePolicy:
    return AdaptivePolicy("adaptive", (value_mode(), recency_mode()))


BASELINES: dict[str, Callable[..., Policy]] = {
    "oracle": oracle, "seed": seed, "branch": branch, "ladder": ladder, "coupled": coupled,
    "full-6144": full_6144, "full-512": full_512,
}


# -- the model's state ----------------------------------------------------------------------------

class _Page:
    """An MLA page set: private to its request until it registers an endpoint."""

    __slots__ = (
        "alive",
        "anchored",
        "cks",
        "depth",
        "eps",
        "fill",
        "kids",
        "lc",
        "lu",
        "par",
        "ref",
        "registered",
        "seq",
        "ver",
    )

    def __init__(self, seq: int) -> None:
        self.seq, self.eps, self.fill, self.cks = seq, [], 0, []
        self.par: _Page | None = None
        self.kids, self.lu, self.lc, self.depth, self.ref, self.ver = 0, 0.0, 0.0, 0, 1, 0
        self.anchored: dict[str, int] = {}
        self.registered, self.alive = False, True


class _Ckpt:
    __slots__ = ("alive", "anchor", "cls", "depth", "gain", "h", "lc", "lu", "ref", "seq", "ver")

    def __init__(self, seq: int, h: int, anchor: _Page, cls: str, depth: int, gain: int) -> None:
        self.seq, self.h, self.anchor, self.cls, self.depth, self.gain = seq, h, anchor, cls, depth, gain
        self.lu, self.lc, self.ref, self.alive, self.ver = 0.0, 0.0, 0, True, 0


@dataclass
class Stats:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    match_tokens: int = 0
    checkpoints: dict[str, int] = field(default_factory=dict)  # passes that wrote one, by class
    evicted_pages: int = 0
    refused: int = 0
    peak_pages: int = 0
    mode_switches: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


class Refused(Exception):
    """A pass cannot get its pages even after evicting everything evictable."""


class _Request:
    __slots__ = (
        "anchor",
        "chain",
        "has_state",
        "inter",
        "own",
        "pos",
        "prev_ck",
        "reg",
        "restored",
        "shared",
    )

    def __init__(self, chain: list[int], hit: int) -> None:
        self.chain = chain
        self.pos = self.reg = self.prev_ck = hit  # in hash blocks, except pos (tokens): set below
        self.shared = 0
        self.own: list[_Page] = []
        self.inter: int | None = None
        self.anchor: _Page | None = None
        self.restored: _Ckpt | None = None
        self.has_state = False


class Model:
    """The index's state for one policy and one capacity (page ids; None = unlimited)."""

    def __init__(self, policy: Policy, capacity: int | None = None,
                 clock_value: tuple[tuple[str, float], ...] | None = None) -> None:
        """`clock_value`: the value weights eviction raises the inflation clock with (default: the
        policy's own), so that a mode switch finds `lc` stamps on the same scale."""
        self.geo, self.capacity = policy.geometry, capacity
        self._clock_value = collections.defaultdict(
            float, policy.scorer.value if clock_value is None else clock_value)
        self.B, self.PB = self.geo.block_tokens, self.geo.blocks_per_page
        self.ratio = self.B // BLOCK_TOKENS
        self.ep: dict[int, tuple[_Page, int]] = {}
        self.ck: dict[int, _Ckpt] = {}
        self.used = 0
        self.tick = 0
        self.clock = 0.0
        self.heap: list[tuple[float, int, int, _Page | _Ckpt]] = []
        self.seq = itertools.count()
        self.stats = Stats()
        self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        """Switch steps and weights; every evictable entry is rescored (the index: one pass over
        the eviction set with the new weights)."""
        if policy.geometry != self.geo:
            raise ValueError("a policy switch cannot change the geometry")
        self.p = policy
        sc = policy.scorer
        self._bonus = collections.defaultdict(float, sc.bonus)
        self._value = collections.defaultdict(float, sc.value)
        self._rank = [(self._bonus[c], c) for c in CLASSES]
        for obj in list(self._entries()):
            self._touch(obj)

    def _entries(self) -> Iterable[_Page | _Ckpt]:
        yield from {id(pg): pg for pg, _ in self.ep.values()}.values()
        yield from self.ck.values()

    # -- scores and eviction --------------------------------------------------------------------
    def _stamp(self, obj: _Page | _Ckpt) -> None:
        obj.lu, obj.lc = self.tick, self.clock

    def _value_term(self, obj: _Page | _Ckpt, weights: dict[str, float] | None = None) -> float:
        w = self._value if weights is None else weights
        if isinstance(obj, _Ckpt):
            return w[obj.cls] * obj.gain / self.geo.kda_groups
        if not obj.cks:
            return 0.0
        total = sum(w[c.cls] * c.gain for c in obj.cks)
        return total / (self.geo.mla_groups + self.geo.kda_groups * len(obj.cks))

    def _score(self, obj: _Page | _Ckpt) -> float:
        sc = self.p.scorer
        if isinstance(obj, _Ckpt):
            bonus, prefix = self._bonus[obj.cls], obj.depth / self.geo.kda_groups
        else:
            bonus = self._bonus["mla"]
            for b, c in self._rank:
                if obj.anchored.get(c, 0) > 0 and b > bonus:
                    bonus = b
            prefix = obj.depth / self.geo.mla_groups
        return (sc.recency * obj.lu + sc.clock * obj.lc + bonus + sc.depth * prefix
                + self._value_term(obj))

    def _touch(self, obj: _Page | _Ckpt) -> None:
        obj.ver += 1
        if obj.alive and obj.ref == 0 and (isinstance(obj, _Ckpt) or (obj.registered and obj.kids == 0)):
            heapq.heappush(self.heap, (self._score(obj), obj.seq, obj.ver, obj))

    def _evict_one(self) -> bool:
        while self.heap:
            _, _, ver, obj = heapq.heappop(self.heap)
            if obj.alive and obj.ver == ver:
                self.clock = max(self.clock, obj.lc + self._value_term(obj, self._clock_value))
                before = self.used
                if isinstance(obj, _Ckpt):
                    self._drop_ck(obj)
                else:
                    self._drop_page(obj)  # and the checkpoints anchored on it
                self.stats.evicted_pages += before - self.used
                return True
        return False

    def _drop_ck(self, c: _Ckpt) -> None:
        if c.ref:
            raise RuntimeError(f"pinned checkpoint {c.h} dropped")
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
            pg.par.lc = max(pg.par.lc, pg.lc)
            self._touch(pg.par)
        self.used -= self.geo.mla_groups

    def _alloc(self, need: int) -> None:
        if self.capacity is not None:
            while self.capacity - self.used < need:
                if not self._evict_one():
                    raise Refused
        self.used += need
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
        return [req.hash_ids[(j + 1) * r - 1] for j in range(req.input_length // self.B)]

    def lookup(self, req: TraceRequest) -> tuple[list[int], int, int]:
        chain = self.chain_of(req)
        usable = min(len(chain), (req.input_length - 1) // self.B)
        match = self.mla_match(chain, usable)
        hit = self.kda_match(chain, match) if self.geo.kda_groups and match else match
        return chain, match, hit

    # -- one request ----------------------------------------------------------------------------
    def serve(self, req: TraceRequest) -> int:
        """Serve one request; returns its hit in tokens."""
        chain, match, hit = self.lookup(req)
        length, kda = req.input_length, self.geo.kda_groups
        hit_ck = self.ck[chain[hit - 1]] if kda and hit else None
        steps = self.p.steps
        if not isinstance(steps, Steps):
            steps = steps(Lookup(hit * self.B, match * self.B, length, hit_ck and hit_ck.cls))
        r = _Request(chain, hit)
        r.pos = hit * self.B
        self.stats.requests += 1
        self.stats.input_tokens += length
        self.stats.match_tokens += match * self.B
        if hit:
            r.anchor = self.ep[chain[hit - 1]][0]
            r.shared = hit // self.PB  # the anchor's page is shared only when the hit ends on it
            r.anchor.ref += 1
            self._touch(r.anchor)
            if hit_ck is not None:
                r.restored = hit_ck
                hit_ck.ref += 1
                self._touch(hit_ck)
        try:
            for n, (stop, cls) in enumerate(self._stops(hit, match, length, steps)):
                self._step(r, stop, cls if steps.checkpoint else None, first=n == 0)
            if steps.demote_restored and hit_ck is not None and hit_ck.cls in ("turn", "superseded"):
                # continued past: the request's deeper checkpoint supersedes it; an exact repeat
                # (nothing deeper, or its own resend point restored) promotes it back
                went_past = r.prev_ck > hit and hit < (length - 1) // self.B
                self._reclass(hit_ck, "superseded" if went_past else "turn")
                partner = self.ck.get(chain[hit - 2]) if went_past and hit > 1 else None
                if partner is not None and partner.cls == "turn":  # its resend point with it
                    self._reclass(partner, "superseded")
        except Refused:
            self.stats.refused += 1
            if not r.has_state:  # refused at its first plan: served without the cache
                hit = 0
        self._release(r)
        self.stats.hit_tokens += hit * self.B
        return hit * self.B

    def _stops(self, hit: int, match: int, length: int, steps: Steps) -> list[tuple[int, str | None]]:
        """Pass ends after hit*B, each with the class of the checkpoint it writes (or None)."""
        start = hit * self.B
        marks: dict[int, str | None] = {length: "turn" if steps.turn_end else None}
        if steps.stop_at_page_end:
            pt = self.geo.page_tokens
            rungs = range((start // pt + 1) * pt, length, pt)
            for p in rungs[-1:] if steps.last_rung_only else rungs:
                marks.setdefault(p, "spec" if steps.spec_rungs and p != rungs[-1] else "rung")
        resend_point = length - self.B
        if steps.turn_end and length % self.B == 0 and resend_point > start:
            marks.setdefault(resend_point, "turn")
        if steps.stop_at_match and match > hit:
            marks[match * self.B] = "branch"
        out: list[tuple[int, str | None]] = []
        pos = start
        for stop in sorted(marks):
            while steps.chunk_tokens and stop - pos > steps.chunk_tokens:
                pos += steps.chunk_tokens
                out.append((pos, "intermediate"))
            out.append((stop, marks[stop]))
            pos = stop
        return out

    def _step(self, r: _Request, stop: int, cls: str | None, first: bool) -> None:
        """One pass: plan (allocate, evicting as needed), forward, commit."""
        B, kda, mla = self.B, self.geo.kda_groups, self.geo.mla_groups
        self.tick += 1
        new_slots = -(-stop // self.geo.page_tokens) - (r.shared + len(r.own))
        want_ck = cls is not None and kda > 0 and stop // B > r.pos // B
        self._alloc(new_slots * mla + (kda if first else 0) + (kda if want_ck else 0))
        r.has_state = r.has_state or (first and kda > 0)
        r.own.extend(_Page(next(self.seq)) for _ in range(new_slots))
        if r.restored is not None:  # the forward pass read it: the restore pin goes
            self._unpin(r.restored)
            r.restored = None
        self._register(r, stop // B)
        if want_ck:
            self._checkpoint(r, stop // B, cls)  # type: ignore[arg-type]
        r.pos = stop

    def _unpin(self, obj: _Page | _Ckpt) -> None:
        obj.ref -= 1
        self._stamp(obj)
        self._touch(obj)

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
        """Hang a page under the page holding the previous page end (commit.lua `attach`)."""
        if slot > 0:
            e = self.ep.get(r.chain[slot * self.PB - 1])
            if e is None:
                return False
            pg.par = e[0]
            e[0].kids += 1
            self._touch(e[0])
        pg.registered, pg.depth = True, (slot + 1) * self.PB * self.B
        return True

    def _checkpoint(self, r: _Request, blocks: int, cls: str) -> None:
        kda = self.geo.kda_groups
        h = r.chain[blocks - 1]
        self.stats.checkpoints[cls] = self.stats.checkpoints.get(cls, 0) + 1
        existing = self.ck.get(h)
        e = self.ep.get(h)
        if existing is not None or e is None:  # duplicate or unanchored: the new set is freed
            self.used -= kda
            if existing is not None and cls != "intermediate" and existing.cls in ("intermediate", "superseded"):
                self._reclass(existing, cls)
            return
        c = _Ckpt(next(self.seq), h, e[0], cls, blocks * self.B, (blocks - r.prev_ck) * self.B)
        self._stamp(c)
        if cls not in ("spec", "intermediate"):
            r.prev_ck = blocks
        self.ck[h] = c
        e[0].cks.append(c)
        e[0].anchored[cls] = e[0].anchored.get(cls, 0) + 1
        self._touch(c)
        self._touch(e[0])
        if r.inter is not None:  # recycle the request's previous intermediate checkpoint
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
        if r.restored is not None:
            self._unpin(r.restored)
        for pg in reversed(r.own):
            if not pg.registered:
                pg.alive = False
                self.used -= self.geo.mla_groups
                continue
            pg.ref -= 1
            if self.p.scorer.fresh == "tick":
                self._stamp(pg)
            self._touch(pg)
        if r.anchor is not None:
            self._unpin(r.anchor)
        if r.has_state:
            self.used -= self.geo.kda_groups  # the private state set

    # -- checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Between requests: page accounting adds up, every entry is reachable, leaf-first holds."""
        pages = {id(pg): pg for pg, _ in self.ep.values()}
        used = len(pages) * self.geo.mla_groups + len(self.ck) * self.geo.kda_groups
        if used != self.used:
            raise RuntimeError(f"{self.used} pages accounted, {used} held")
        kids = collections.Counter(id(pg.par) for pg in pages.values() if pg.par is not None)
        for pg in pages.values():
            if not pg.alive or pg.ref or (pg.par is not None and not pg.par.alive):
                raise RuntimeError("a cached page is dead, pinned or orphaned")
            if kids[id(pg)] != pg.kids:
                raise RuntimeError("a page's child count is wrong")
        for c in self.ck.values():
            if not c.alive or c.ref or self.ep[c.h][0] is not c.anchor:
                raise RuntimeError(f"checkpoint {c.h} is not anchored on its endpoint's page")


class AdaptiveModel:
    """The live pool plus one metadata-only shadow per mode, all fed every request."""

    def __init__(self, policy: AdaptivePolicy, capacity: int | None = None) -> None:
        self.policy, self.capacity = policy, capacity
        clock_value = next((m.scorer.value for m in policy.modes if m.scorer.clock), ())
        self.live = Model(policy.modes[0], capacity, clock_value)
        self.current = 0
        # at unlimited capacity nothing is evicted and the first mode's admission is the richest
        self.shadows = [Model(m, capacity) for m in policy.modes] if capacity is not None else []
        self.recent: collections.deque[tuple[int, list[int]]] = collections.deque(maxlen=policy.window)
        self.seen = 0

    @property
    def stats(self) -> Stats:
        return self.live.stats

    def serve(self, req: TraceRequest) -> int:
        hit = self.live.serve(req)
        if self.shadows:
            self.recent.append((req.input_length, [s.serve(req) for s in self.shadows]))
            self.seen += 1
            if self.seen % self.policy.every == 0:
                self._decide()
        return hit

    def _decide(self) -> None:
        tokens = sum(n for n, _ in self.recent)
        ratios = [sum(h[i] for _, h in self.recent) / tokens for i in range(len(self.shadows))]
        best = max(range(len(ratios)), key=ratios.__getitem__)
        if best != self.current and ratios[best] > ratios[self.current] + self.policy.margin:
            self.current = best
            self.live.set_policy(self.policy.modes[best])
            self.live.stats.mode_switches += 1

    def check(self) -> None:
        self.live.check()


def simulate(trace: Iterable[TraceRequest], policy: Policy | AdaptivePolicy,
             capacity: int | None = None, check: bool = False) -> Stats:
    """Serve the trace in timestamp order (stable) through one policy at one capacity (page ids)."""
    if isinstance(policy, AdaptivePolicy):
        model: Model | AdaptiveModel = AdaptiveModel(policy, capacity)
    else:
        model = Model(policy, None if policy.unlimited_only else capacity)
    for req in sorted(trace, key=lambda q: q.timestamp):
        model.serve(req)
        if check:
            model.check()
    return model.stats


def budget_pages(budget_bytes: float, preset: str = "kimi-k3") -> int:
    """Unified page ids a byte budget buys (padding included)."""
    from cachetier.config import load_config
    return int(budget_bytes // load_config(preset).geometry.page_id_bytes)


BUDGETS = {"unlimited": None, "100GB": 100 * GB, "400GB": 400 * GB, "1.6TB": 1600 * GB}


def table(trace: Sequence[TraceRequest], policies: dict[str, Policy | AdaptivePolicy],
          budgets: dict[str, float | None] = BUDGETS) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, policy in policies.items():
        out[name] = {}
        for label, nbytes in budgets.items():
            cap = None if nbytes is None else budget_pages(nbytes)
            out[name][label] = simulate(trace, policy, cap).hit_ratio
    return out


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from cachetier.replay.traces import AgenticSpec, read_trace, synth_agentic
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default="../shared/traces/mooncake_synthetic_trace.jsonl",
                        help="a Mooncake-format JSONL trace, or 'agentic:SEED' for a synthetic one")
    parser.add_argument("--unlimited-only", action="store_true")
    args = parser.parse_args(argv)
    if args.trace.startswith("agentic:"):
        trace = synth_agentic(AgenticSpec(seed=int(args.trace.split(":", 1)[1])))
    else:
        trace = read_trace(args.trace)
    policies: dict[str, Policy | AdaptivePolicy] = {}
    for fresh in ("zero", "tick"):
        for name in ("seed", "branch", "ladder", "coupled", "full-6144"):
            policies[f"{name}/{fresh}"] = BASELINES[name](fresh)
    policies = {"oracle": oracle(), **policies, "adaptive": adaptive()}
    budgets = {"unlimited": None} if args.unlimited_only else BUDGETS
    rows = table(trace, policies, budgets)
    print(f"{'policy':18s}" + "".join(f"{b:>11s}" for b in budgets))
    for name, row in rows.items():
        print(f"{name:18s}" + "".join(f"{row[b]:11.4f}" for b in budgets))


if __name__ == "__main__":
    main()
