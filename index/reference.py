"""An in-memory model of the Lua scripts' semantics: the oracle of the property tests.

It keeps the same structures as Redis (records by page id, one free list, endpoint and checkpoint
maps, the eviction order) and follows the scripts step by step, so that a hypothesis state machine
can drive both with the same operations and demand identical answers, page ids included. It is
deliberately plain Python: readable first, never used on a hot path.

`ReferenceIndex` is an `index.face.Index` with `PrefixIndex`'s signatures (async, the epoch it
last saw carried by every call and refreshed on `StaleEpoch`), so tests drive either one the same
way. Several faces may share one `ReferencePool`, as several service replicas share a pool in
Redis: one of them invalidating it leaves the others holding a voided epoch.
"""

from __future__ import annotations

import math
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cachetier.config import Config
from eviction.policy import CLASSES, COMMIT_KINDS, Entry, EvictionWeights, lru
from index.errors import (BadRequest, CorruptState, StaleEpoch, StorageRollback, UnknownEntity,
                          UnknownPool)
from index.hashing import hash_len
from index.prefix import PrefixProbe
from index.records import (CommitItem, CommitResult, CommittedRequest, EvictResult, IndexStats,
                           PageCopy, ReleaseResult, Removal, RequestPlan, StepPlan, StepRefusal,
                           StepRequest)
from index.tickets import compose, random_nonce, split


@dataclass
class PoolState:
    """What the Redis keys of one pool hold, decoded."""

    epoch: int = 1
    fresh: int = 0
    tick: int = 0
    ticket: int = 0
    clock: float = 0.0
    pages: dict[int, dict[str, Any]] = field(default_factory=dict)
    free: deque[int] = field(default_factory=deque)
    ep: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    ck: dict[bytes, int] = field(default_factory=dict)
    lru: dict[int, float] = field(default_factory=dict)
    req: dict[str, dict[str, Any]] = field(default_factory=dict)
    reqh: dict[str, bytes] = field(default_factory=dict)
    tix: dict[int, list[str]] = field(default_factory=dict)  # ticket (counter, nonce) -> rids
    lease: dict[str, int] = field(default_factory=dict)  # request id -> lease deadline (ms)
    lru_page_count: int = 0  # meta.lru_pages as Redis stores it; the reference derives it
    durable_cks: int = 0  # meta.durable_cks: registered checkpoints with dur = 1, kept by both

    def lru_pages(self) -> int:
        """Pages held by eviction-order members: what Redis keeps as meta.lru_pages."""
        return sum(len(self.pages[lead]["pages"]) for lead in self.lru)

    def durable_checkpoints(self) -> int:
        """Registered checkpoints of a kept class, counted from their records."""
        return sum(self.pages[lead]["dur"] for lead in self.ck.values())


@dataclass
class ReferencePool:
    """One pool as Redis holds it: the state of its current epoch and the eviction weights its
    scores use (meta's weight fields), shared by every face on it."""

    state: PoolState
    weights: EvictionWeights


class ReferenceIndex:
    """`pool`: join that pool (another face's) instead of creating one at `create()`; `lease_s`,
    `clock` and `nonce` as `PrefixIndex`'s."""

    def __init__(self, config: Config, weights: EvictionWeights | None = None, *,
                 pool_id: str = "reference", pool: ReferencePool | None = None,
                 lease_s: float | None = None, clock: Callable[[], float] = time.time,
                 nonce: Callable[[], int] = random_nonce) -> None:
        self.config = config
        self.lease_s, self.clock, self.nonce = lease_s, clock, nonce
        self.pool_id = pool_id
        self.weights = weights or lru()
        self.pool = pool
        self.epoch = 0
        cache, model = config.cache, config.model
        self.B, self.PB = cache.hash_block_tokens, cache.blocks_per_page
        self.HL = hash_len(cache.hash_algo)
        self.kda, self.mla = model.kda_groups, model.mla_groups
        self.num_pages = cache.num_pages
        self.mla_token_bytes = model.mla_token_bytes
        self.kda_state_bytes = model.kda_rank_layer_bytes
        self.max_batch = cache.max_batch

    @property
    def s(self) -> PoolState:
        if self.pool is None:
            raise UnknownPool(f"unknown pool (not created): {self.pool_id}")
        return self.pool.state

    @property
    def w(self) -> EvictionWeights:
        """The weights the pool's scores use (read only once `s` found the pool)."""
        return self.pool.weights if self.pool is not None else self.weights

    # -- create_pool.lua ----------------------------------------------------------------------
    async def create(self) -> int:
        """Create the pool or join the shared one; the face's weights become the pool's (the
        eviction order keeps its scores until `reweigh`). Returns the epoch."""
        if self.pool is None:
            self.pool = ReferencePool(PoolState(), self.weights)
        else:
            self.pool.weights = self.weights
        self.epoch = self.s.epoch
        return self.epoch

    # -- shared helpers (lib.lua) -------------------------------------------------------------
    def _check_epoch(self) -> None:
        """The epoch this face carries must be the pool's; on a voided one the face learns the
        current epoch and raises, as PrefixIndex does. A pool behind the face went back in time
        (lib.lua `check_view`): the face keeps its epoch, so nobody adopts the older one."""
        current = self.s.epoch
        if self.epoch > current:
            raise StorageRollback(f"pool is at epoch {current}, caller saw epoch {self.epoch}")
        if self.epoch != current:
            seen, self.epoch = self.epoch, current
            raise StaleEpoch(f"pool epoch is {current}, caller has {seen}")

    def _h(self, blob: bytes, i: int) -> bytes:
        return blob[(i - 1) * self.HL:i * self.HL]

    def _score(self, rec: dict[str, Any]) -> float:
        return self.w.score(entry_of(rec), self.kda)

    def _stamp(self, rec: dict[str, Any]) -> None:
        rec["lu"], rec["lc"] = self.s.tick, self.s.clock

    @staticmethod
    def _evictable(rec: dict[str, Any]) -> bool:
        return rec["st"] == "ready" and rec["ref"] == 0 and (rec["k"] == "K" or rec["kids"] == 0)

    def _save_lead(self, lead: int, rec: dict[str, Any]) -> None:
        self.s.pages[lead] = rec
        if self._evictable(rec):
            self.s.lru[lead] = self._score(rec)
        else:
            self.s.lru.pop(lead, None)

    def _free_count(self) -> int:
        return len(self.s.free) + self.num_pages - self.s.fresh

    def _alloc_set(self, kind: str, n: int, owner: str) -> tuple[int, list[int]]:
        ids = []
        for _ in range(n):
            if self.s.free:
                ids.append(self.s.free.popleft())
            else:
                ids.append(self.s.fresh)
                self.s.fresh += 1
        self.s.pages[ids[0]] = {"k": kind, "g": 0, "pages": ids, "st": "private", "ref": 1,
                                "owner": owner, "lu": 0, "lc": 0, "depth": 0, "kids": 0}
        return ids[0], ids

    def _free_set(self, rec: dict[str, Any]) -> None:
        del self.s.pages[rec["pages"][0]]
        self.s.free.extend(rec["pages"])
        self.s.lru.pop(rec["pages"][0], None)

    def _drop_checkpoint(self, h: bytes, removed: list[Removal]) -> None:
        lead = self.s.ck[h]
        rec = self.s.pages[lead]
        if rec["ref"] > 0:
            raise CorruptState(f"pinned checkpoint dropped at page {lead}")
        del self.s.ck[h]
        self.s.durable_cks -= rec["dur"]
        anchor = self.s.pages.get(rec["anchor"])
        if anchor is not None:
            anchor["cks"] = [c for c in anchor["cks"] if c != h]
            i = CLASSES.index(rec["cls"])
            anchor["cn"][i] -= 1
            anchor["cg"][i] -= rec["gain"]
            self._save_lead(rec["anchor"], anchor)
        self._free_set(rec)
        removed.append(Removal("ck", h))

    def _drop_mla(self, lead: int, rec: dict[str, Any], removed: list[Removal]) -> None:
        while rec["cks"]:
            self._drop_checkpoint(rec["cks"][-1], removed)
            rec = self.s.pages[lead]
        for h, _ in rec["eps"]:
            del self.s.ep[h]
            removed.append(Removal("ep", h))
        if rec["par"] >= 0:
            parent = self.s.pages[rec["par"]]
            parent["kids"] -= 1
            parent["lu"] = max(parent["lu"], rec["lu"])
            parent["lc"] = max(parent["lc"], rec["lc"])
            self._save_lead(rec["par"], parent)
        self._free_set(rec)

    def _evict_one(self, removed: list[Removal]) -> bool:
        if not self.s.lru:
            return False
        # ZRANGE order: score, then the member string.
        lead = min(self.s.lru, key=lambda pid: (self.s.lru[pid], str(pid)))
        rec = self.s.pages[lead]
        _, value = self.w.terms(entry_of(rec), self.kda)
        self.s.clock = max(self.s.clock, rec["lc"] + value)  # GreedyDual inflation
        if rec["k"] == "K":
            self._drop_checkpoint(rec["h"], removed)
        else:
            self._drop_mla(lead, rec, removed)
        return True

    def _pin(self, lead: int) -> None:
        rec = self.s.pages[lead]
        rec["ref"] += 1
        self._save_lead(lead, rec)

    def _unpin(self, lead: int) -> None:
        rec = self.s.pages.get(lead)
        if rec is None or rec["ref"] < 1:
            raise CorruptState(f"unpin of unpinned page {lead}")
        rec["ref"] -= 1
        self._stamp(rec)
        self._save_lead(lead, rec)

    def _new_ticket(self, rids: list[str]) -> int:
        """lib.lua `new_ticket`: the next counter with a nonce the caller drew."""
        self.s.ticket += 1
        ticket = compose(self.s.ticket, self.nonce())
        self.s.tix[ticket] = rids
        return ticket

    def _matchable(self, h: bytes) -> tuple[int, int] | None:
        e = self.s.ep.get(h)
        if e is None:
            return None
        return e if self.s.pages[e[0]]["rf"] >= e[1] else None

    def _pending_checkpoint(self, item: dict[str, Any]) -> bool:
        if item["ck"] < 0 or self.s.ck.get(item["ckh"]) != item["ck"]:
            return False
        rec = self.s.pages[item["ck"]]
        return rec["st"] == "pending" and rec["tk"] == item["t"]

    # -- match.lua, probe.lua -----------------------------------------------------------------
    def _match_prefix(self, blob: bytes, tokens: int) -> tuple[int, int, int]:
        """MLA depth and hit in blocks (the last token is always left to compute), and the hit's
        checkpoint lead (-1 if none)."""
        usable = min(len(blob) // self.HL, (tokens - 1) // self.B)
        depth = self._mla_match(blob, usable)
        if depth == 0:
            return 0, 0, -1
        return (depth, *self._kda_match(blob, depth))

    async def probe(self, prompt_tokens: int, hashes: bytes) -> PrefixProbe:
        """Read-only: no pin, no recency, any epoch."""
        if (isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
                or not 1 <= prompt_tokens <= 1 << 40):
            raise BadRequest("tokens must be an integer >= 1")
        if len(hashes) != prompt_tokens // self.B * self.HL:
            raise BadRequest(f"hashes must hold one {self.HL}-byte hash per complete block")
        depth, hit, _ = self._match_prefix(bytes(hashes), prompt_tokens)
        return PrefixProbe(self.pool_id, self.s.epoch, hit * self.B, depth * self.B)

    # -- stats.lua ----------------------------------------------------------------------------
    async def stats(self) -> IndexStats:
        """The counters as the script reads them: `durable_checkpoints` is the kept counter,
        not a recount (`PoolState.durable_checkpoints` is the recount tests compare it with)."""
        s = self.s
        return IndexStats(epoch=s.epoch, num_pages=self.num_pages,
                          free_pages=self._free_count(), evictable_pages=s.lru_pages(),
                          requests=len(s.req), pending_tickets=len(s.tix), checkpoints=len(s.ck),
                          durable_checkpoints=s.durable_cks)

    # -- plan_step.lua ------------------------------------------------------------------------
    def _mla_match(self, blob: bytes, usable: int) -> int:
        lo, hi = 0, usable // self.PB
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._matchable(self._h(blob, mid * self.PB)):
                lo = mid
            else:
                hi = mid - 1
        for f in range(min(self.PB - 1, usable - lo * self.PB), 0, -1):
            if self._matchable(self._h(blob, lo * self.PB + f)):
                return lo * self.PB + f
        return lo * self.PB

    def _kda_match(self, blob: bytes, depth: int) -> tuple[int, int]:
        if self.kda == 0:
            return depth, -1
        for slot in range((depth - 1) // self.PB, -1, -1):
            last = min(depth, (slot + 1) * self.PB)
            for i in range(last, slot * self.PB, -1):
                h = self._h(blob, i)
                lead = self.s.ck.get(h)
                if lead is not None and self.s.pages[lead]["st"] == "ready" and self._matchable(h):
                    return i, lead
        return 0, -1

    def _check_request(self, item: StepRequest, seen: set[str]) -> dict[str, Any] | None:
        if item.rid in seen:
            raise BadRequest(f"request {item.rid} appears twice in the step")
        seen.add(item.rid)
        if item.compute_tokens < 1:
            raise BadRequest(f"{item.rid}: compute must be an integer >= 1")
        if item.turn_end_kind is not None and (item.turn_end_kind not in COMMIT_KINDS
                                               or item.turn_end_kind == "intermediate"):
            raise BadRequest(f"{item.rid}: turn_end must be one of {', '.join(COMMIT_KINDS)} "
                             f"but intermediate")
        r = self.s.req.get(item.rid)
        if r is not None:
            if r["stop"] != r["pos"]:
                raise BadRequest(f"{item.rid}: previous step not committed")
            if r["pos"] >= r["tokens"]:
                raise BadRequest(f"{item.rid}: prompt already complete")
            return r
        if item.hashes is None or item.prompt_tokens is None or item.prompt_tokens < 1:
            raise BadRequest(f"{item.rid}: tokens must be an integer >= 1")
        if len(item.hashes) != item.prompt_tokens // self.B * self.HL:
            raise BadRequest(f"{item.rid}: hashes must hold one hash per complete block")
        return None

    def _check_size(self, items: Sequence[object]) -> None:
        """PrefixIndex checks the batch before calling a script, so before the epoch."""
        if len(items) > self.max_batch:
            raise BadRequest(f"batch of {len(items)} exceeds max_batch {self.max_batch}")

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        self._check_size(requests)
        if len({r.rid for r in requests}) != len(requests):
            raise BadRequest("a request id appears twice in the step")
        self._check_epoch()
        if not requests:
            raise BadRequest("empty step: nothing to plan")
        plans, seen, need = [], set(), 0
        pinned_in_lru: dict[int, int] = {}
        for item in requests:
            r = self._check_request(item, seen)
            p: dict[str, Any] = {"item": item, "r": r, "anchor": -1, "ckpt": -1, "hit": 0,
                                 "shared": b"", "cow": 0}
            if r is None:
                depth, p["hit"], p["ckpt"] = self._match_prefix(item.hashes, item.prompt_tokens)
                p["match"] = depth * self.B
                if p["ckpt"] >= 0 and p["hit"] == (item.prompt_tokens - 1) // self.B:
                    p["turn_end"] = item.turn_end_kind  # the hit restores what the prompt keeps
                if p["hit"] > 0:
                    lead, fill = self.s.ep[self._h(item.hashes, p["hit"])]
                    p["anchor"] = lead
                    p["shared"] = self.s.pages[lead]["path"]
                    if fill == self.PB:
                        p["shared"] += pack_ids(self.s.pages[lead]["pages"])
                    else:
                        p["cow"] = fill
                p["start"], p["tokens"] = p["hit"] * self.B, item.prompt_tokens
                p["slots_have"] = len(p["shared"]) // (4 * self.mla)
                for lead, size in ((p["anchor"], self.mla), (p["ckpt"], self.kda)):
                    if lead >= 0 and lead in self.s.lru:
                        pinned_in_lru[lead] = size
                need += self.kda
            else:
                p["start"], p["tokens"], p["slots_have"] = r["pos"], r["tokens"], r["shared"] + len(r["own"])
                p["match"] = r["mt"]
            p["stop"] = min(p["tokens"], p["start"] + item.compute_tokens)
            if item.stop_at_match and p["match"] > p["start"]:
                p["stop"] = min(p["stop"], p["match"])
            page_tokens = self.B * self.PB
            if item.stop_at_page_end:
                p["stop"] = min(p["stop"], (p["start"] // page_tokens + 1) * page_tokens)
            last_page_end = (p["tokens"] - 1) // page_tokens * page_tokens
            if item.stop_at_last_page_end and last_page_end > p["start"]:
                p["stop"] = min(p["stop"], last_page_end)
            resend_point = p["tokens"] - self.B
            if (item.stop_at_resend_point and p["tokens"] % self.B == 0
                    and resend_point > p["start"]):
                p["stop"] = min(p["stop"], resend_point)
            p["new_slots"] = max(0, math.ceil(p["stop"] / (self.B * self.PB)) - p["slots_have"])
            p["want_ckpt"] = (item.checkpoint and self.kda > 0
                              and p["stop"] // self.B > p["start"] // self.B)
            need += p["new_slots"] * self.mla + (self.kda if p["want_ckpt"] else 0)
            plans.append(p)
        pinned_pages = sum(pinned_in_lru.values())
        available = self._free_count() + self.s.lru_pages() - pinned_pages
        if available < need:
            return StepRefusal(f"pool exhausted: the step needs {need} pages, {available} are "
                               "free or evictable", need, available)
        self.s.tick += 1
        for p in plans:
            for lead in (p["anchor"], p["ckpt"]):
                if lead >= 0:
                    self._pin(lead)
        for p in plans:
            if p.get("turn_end") is not None:
                rec = self.s.pages[p["ckpt"]]
                if rec["cls"] in ("intermediate", "superseded"):
                    self._reclass(p["ckpt"], rec, p["turn_end"])
        removed: list[Removal] = []
        while self._free_count() < need:
            if not self._evict_one(removed):
                raise CorruptState("eviction ran dry after the capacity check")
        out = [self._allocate(p) for p in plans]
        if self.lease_s is not None:
            deadline = int((self.clock() + self.lease_s) * 1000)
            self.s.lease.update((p["item"].rid, deadline) for p in plans)
        ticket = self._new_ticket([p["item"].rid for p in plans])
        return StepPlan(ticket, self.s.epoch, out, len(removed), removed)

    def _start_request(self, p: dict[str, Any], rid: str, copies: list[PageCopy]) -> dict[str, Any]:
        shared = p["slots_have"]
        hoff = max(shared * self.PB - 2, 0)  # down to the resend point of the hit's turn end
        r = {"tokens": p["tokens"], "pos": p["start"], "hit": p["start"], "mt": p["match"],
             "pin": p["anchor"],
             "spath": p["shared"], "own": [], "shared": shared, "state": -1, "ck": -1,
             "reg": p["hit"], "pck": p["hit"], "inter": b"", "pend": [], "hoff": hoff, "tix": []}
        if self.kda > 0:
            lead, ids = self._alloc_set("K", self.kda, rid)
            r["state"] = lead
            if p["ckpt"] >= 0:
                src = self.s.pages[p["ckpt"]]["pages"]
                copies += [PageCopy(src[g], ids[g], 0, self.kda_state_bytes) for g in range(self.kda)]
                r["pend"].append({"t": self.s.ticket + 1, "unpin": p["ckpt"], "fills": {},
                                  "ck": -1, "ckh": b""})
        self.s.reqh[rid] = p["item"].hashes[hoff * self.HL:]
        return r

    def _allocate(self, p: dict[str, Any]) -> RequestPlan:
        rid, copies = p["item"].rid, []
        r = p["r"] if p["r"] is not None else self._start_request(p, rid, copies)
        for s in range(p["new_slots"]):
            lead, ids = self._alloc_set("M", self.mla, rid)
            r["own"].append(lead)
            if s == 0 and p["cow"] > 0:
                src = self.s.pages[p["anchor"]]["pages"]
                copies += [PageCopy(src[g], ids[g], 0, p["cow"] * self.B * self.mla_token_bytes)
                           for g in range(self.mla)]
        r["ck"] = self._alloc_set("K", self.kda, rid)[0] if p["want_ckpt"] else -1
        r["stop"] = p["stop"]
        r["tix"].append(self.s.ticket + 1)
        self.s.req[rid] = r
        shared = [list(row) for row in struct.iter_unpack("<" + "I" * self.mla, r["spath"])]
        slots = shared + [self.s.pages[lead]["pages"] for lead in r["own"]]
        mla = [[slot[g] for slot in slots] for g in range(self.mla)]
        state = list(self.s.pages[r["state"]]["pages"]) if r["state"] >= 0 else []
        ckpt = list(self.s.pages[r["ck"]]["pages"]) if r["ck"] >= 0 else []
        ck_tokens = p["stop"] // self.B * self.B if p["want_ckpt"] else 0
        return RequestPlan(rid, r["hit"], p["start"], p["stop"], mla, state, ckpt, ck_tokens, copies,
                           r["mt"])

    # -- commit.lua ---------------------------------------------------------------------------
    async def commit(self, items: Sequence[CommitItem]) -> CommitResult:
        (result,) = await self.commit_groups([items])
        return result

    async def commit_groups(self, groups: Sequence[Sequence[CommitItem]]) -> list[CommitResult]:
        """Every item of every group checked first (one bad item refuses the call), then each
        group committed in order under a ticket of its own; all `removed` go to the first."""
        items = [item for group in groups for item in group]
        self._check_size(items)
        self._check_epoch()
        if not groups or not all(groups):
            raise BadRequest("empty commit")
        reqs, seen = {}, set()
        for item in items:
            if item.rid in seen:
                raise BadRequest(f"request {item.rid} appears twice in the commit")
            seen.add(item.rid)
            r = self.s.req.get(item.rid)
            if r is None:
                raise UnknownEntity(f"unknown request {item.rid}")
            self._check_commit(item, r)
            reqs[item.rid] = r
        first, removed = self.s.ticket + 1, []
        committed = [[self._commit_item(item, reqs[item.rid], first + g, removed) for item in group]
                     for g, group in enumerate(groups)]
        return [CommitResult(self._new_ticket([i.rid for i in group]), out,
                             removed if g == 0 else [])
                for g, (group, out) in enumerate(zip(groups, committed))]

    def _commit_item(self, item: CommitItem, r: dict[str, Any], ticket: int,
                     removed: list[Removal]) -> CommittedRequest:
        for pend in [p for p in r["pend"] if p["unpin"] >= 0]:
            self._unpin(pend["unpin"])
        r["pend"] = [p for p in r["pend"] if p["unpin"] < 0]
        blob = b"\0" * (r["hoff"] * self.HL) + self.s.reqh[item.rid]
        p = {"t": ticket, "fills": {}, "unpin": -1, "ck": -1, "ckh": b""}
        first = r["reg"]
        count = self._register_endpoints(item.rid, r, blob, item.stop // self.B, p["fills"])
        stored = [self._h(blob, i) for i in range(first + 1, r["reg"] + 1)]
        parent = self._h(blob, first) if first > 0 else None
        state = "none"
        if item.checkpoint_tokens > 0:
            state = self._register_checkpoint(item.rid, r, blob, item.checkpoint_tokens // self.B,
                                              item.checkpoint_class, p, ticket, removed)
        elif r["ck"] >= 0:
            self._free_set(self.s.pages[r["ck"]])
            r["ck"] = -1
        if item.stop == r["tokens"]:
            self._settle_restored(r, blob)
        r["pend"].append(p)
        r["pos"] = r["stop"] = item.stop
        r["tix"].append(ticket)
        return CommittedRequest(item.rid, count, state, stored, parent, p["ckh"] or None)

    def _check_commit(self, item: CommitItem, r: dict[str, Any]) -> None:
        if r["stop"] == r["pos"]:
            raise BadRequest(f"{item.rid}: no planned step to commit")
        if not r["pos"] < item.stop <= r["stop"]:
            raise BadRequest(f"{item.rid}: stop must be an integer in ({r['pos']}, {r['stop']}]")
        c = item.checkpoint_tokens
        if c < 0:
            raise BadRequest(f"{item.rid}: ckpt_tokens must be an integer >= 0")
        if c > 0:
            if c % self.B:
                raise BadRequest(f"{item.rid}: ckpt_tokens {c} is not on a hash block boundary")
            if c <= r["pos"] or c > item.stop:
                raise BadRequest(f"{item.rid}: ckpt_tokens out of range")
            if r["ck"] < 0:
                raise BadRequest(f"{item.rid}: no checkpoint pages were planned for this step")

    def _attach(self, rid: str, rec: dict[str, Any], slot: int, blob: bytes) -> bool:
        path, par = b"", -1
        if slot > 0:
            e = self.s.ep.get(self._h(blob, slot * self.PB))
            if e is None:
                return False
            parent = self.s.pages[e[0]]
            if parent["rf"] < self.PB and parent["owner"] != rid:
                return False
            path, par = parent["path"] + pack_ids(parent["pages"]), e[0]
            parent["kids"] += 1
            self._save_lead(e[0], parent)
        rec.update(path=path, par=par, st="pending", depth=(slot + 1) * self.PB * self.B, eps=[], cks=[], rf=0, fill=0,
                   cn=[0] * len(CLASSES), cg=[0] * len(CLASSES))
        return True

    def _register_endpoints(self, rid: str, r: dict[str, Any], blob: bytes, upto: int,
                            fills: dict[int, int]) -> int:
        count = 0
        for i in range(r["reg"] + 1, upto + 1):
            h = self._h(blob, i)
            if h not in self.s.ep:
                slot = (i - 1) // self.PB
                lead = r["own"][slot - r["shared"]]
                rec = self.s.pages[lead]
                if rec["st"] == "private" and not self._attach(rid, rec, slot, blob):
                    return count
                rec["fill"] = i - slot * self.PB
                rec["eps"].append([h, rec["fill"]])
                self.s.ep[h] = (lead, rec["fill"])
                self._save_lead(lead, rec)
                fills[lead] = rec["fill"]
                count += 1
            r["reg"] = i
        return count

    def _register_checkpoint(self, rid: str, r: dict[str, Any], blob: bytes, blocks: int,
                             kind: str, p: dict[str, Any], ticket: int,
                             removed: list[Removal]) -> str:
        h = self._h(blob, blocks)
        existing = self.s.ck.get(h)
        e = self.s.ep.get(h)
        ck_lead, r["ck"] = r["ck"], -1
        if existing is not None or e is None:
            self._free_set(self.s.pages[ck_lead])
            if existing is not None and kind != "intermediate":
                rec = self.s.pages[existing]
                if rec["cls"] in ("intermediate", "superseded"):
                    self._reclass(existing, rec, kind)
            return "duplicate" if existing is not None else "unanchored"
        rec = self.s.pages[ck_lead]
        rec.update(st="pending", ref=0, owner="", h=h, anchor=e[0], cls=kind,
                   gain=(blocks - r["pck"]) * self.B, depth=blocks * self.B, tk=ticket,
                   dur=int(kind != "intermediate"))
        self._stamp(rec)
        self._save_lead(ck_lead, rec)
        self.s.ck[h] = ck_lead
        self.s.durable_cks += rec["dur"]
        anchor = self.s.pages[e[0]]
        anchor["cks"].append(h)
        i = CLASSES.index(kind)
        anchor["cn"][i] += 1
        anchor["cg"][i] += rec["gain"]
        self._save_lead(e[0], anchor)
        p["ck"], p["ckh"] = ck_lead, h
        if kind not in ("intermediate", "spec"):
            r["pck"] = blocks
        if r["inter"]:
            old = self.s.ck.get(r["inter"])
            if old is not None:
                orec = self.s.pages[old]
                if orec["st"] == "ready" and orec["ref"] == 0 and orec["cls"] == "intermediate":
                    self._drop_checkpoint(r["inter"], removed)
        r["inter"] = h if kind == "intermediate" else b""
        return "registered"

    def _reclass(self, lead: int, rec: dict[str, Any], cls: str) -> None:
        anchor = self.s.pages[rec["anchor"]]
        i, j = CLASSES.index(rec["cls"]), CLASSES.index(cls)
        anchor["cn"][i] -= 1
        anchor["cg"][i] -= rec["gain"]
        anchor["cn"][j] += 1
        anchor["cg"][j] += rec["gain"]
        self.s.durable_cks += int(cls != "intermediate") - rec["dur"]
        rec["cls"], rec["dur"] = cls, int(cls != "intermediate")
        self._save_lead(rec["anchor"], anchor)
        self._save_lead(lead, rec)

    def _settle_restored(self, r: dict[str, Any], blob: bytes) -> None:
        if self.kda == 0 or r["hit"] == 0:
            return
        lead = self.s.ck.get(self._h(blob, r["hit"] // self.B))
        if lead is None or self.s.pages[lead]["cls"] not in ("turn", "superseded"):
            return
        own_resend_point = r["hit"] == (r["tokens"] - 1) // self.B * self.B
        cls = "superseded" if r["pck"] * self.B > r["hit"] and not own_resend_point else "turn"
        if cls != self.s.pages[lead]["cls"]:
            self._reclass(lead, self.s.pages[lead], cls)
        if cls == "superseded" and r["hit"] > self.B:  # its resend point goes with it
            partner = self.s.ck.get(self._h(blob, r["hit"] // self.B - 1))
            if partner is not None and self.s.pages[partner]["cls"] == "turn":
                self._reclass(partner, self.s.pages[partner], "superseded")

    # -- confirm.lua --------------------------------------------------------------------------
    async def confirm(self, ticket: int) -> int:
        (count,) = await self.confirm_many([ticket])
        if count is None:
            raise UnknownEntity(f"unknown ticket {ticket}")
        return count

    async def confirm_many(self, tickets: Sequence[int]) -> list[int | None]:
        """A ticket's counter and nonce must both be those issued (index.tickets); an unknown
        one confirms nothing (None) and the others are confirmed all the same, in order."""
        self._check_size(tickets)
        self._check_epoch()
        if not tickets:
            raise BadRequest("no ticket to confirm")
        return [self._confirm_one(ticket) if ticket in self.s.tix else None for ticket in tickets]

    def _confirm_one(self, ticket: int) -> int:
        number, _ = split(ticket)
        count = 0
        for rid in self.s.tix.pop(ticket):
            r = self.s.req.get(rid)
            if r is None:
                continue
            keep = []
            for item in r["pend"]:
                if item["t"] <= number:
                    self._settle(item)
                else:
                    keep.append(item)
            r["pend"] = keep
            r["tix"].remove(number)
            count += 1
        return count

    def _settle(self, item: dict[str, Any]) -> None:
        if item["unpin"] >= 0:
            self._unpin(item["unpin"])
        for lead, fill in item["fills"].items():
            rec = self.s.pages.get(lead)
            if rec is not None and rec["st"] != "private" and rec["rf"] < fill:
                rec["rf"], rec["st"] = fill, "ready"
                self._save_lead(lead, rec)
        if self._pending_checkpoint(item):
            rec = self.s.pages[item["ck"]]
            rec["st"] = "ready"
            self._save_lead(item["ck"], rec)

    # -- release.lua --------------------------------------------------------------------------
    async def release(self, rids: Sequence[str]) -> ReleaseResult:
        self._check_epoch()
        return self._release(list(rids))

    async def reap(self, count: int) -> ReleaseResult:
        """release.lua's reaper: the `count` earliest leases at or past now (ZRANGEBYSCORE's
        order: deadline, then id)."""
        self._check_epoch()
        if not 1 <= count <= 10000:
            raise BadRequest("the reaper needs now (ms) and a count in [1, 10000]")
        now = int(self.clock() * 1000)
        due = sorted((d, rid) for rid, d in self.s.lease.items() if d <= now)[:count]
        result = self._release([rid for _, rid in due])
        return ReleaseResult(result.released, [], result.removed)

    def _release(self, rids: list[str]) -> ReleaseResult:
        removed: list[Removal] = []
        unknown, released = [], 0
        for rid in rids:
            self.s.lease.pop(rid, None)
            r = self.s.req.get(rid)
            if r is None:
                unknown.append(rid)
                continue
            for item in r["pend"]:
                if item["unpin"] >= 0:
                    self._unpin(item["unpin"])
                if self._pending_checkpoint(item):
                    self._drop_checkpoint(item["ckh"], removed)
            for lead in reversed(r["own"]):
                self._release_page(lead, removed)
            if r["pin"] >= 0:
                self._unpin(r["pin"])
            for lead in (r["state"], r["ck"]):
                if lead >= 0:
                    self._free_set(self.s.pages[lead])
            for t in r["tix"]:
                self._leave_ticket(t, rid)
            del self.s.req[rid]
            del self.s.reqh[rid]
            released += 1
        return ReleaseResult(released, unknown, removed)

    def _leave_ticket(self, number: int, rid: str) -> None:
        """Requests name their tickets by counter (as in Redis); `tix` is keyed by ticket."""
        ticket = next(t for t in self.s.tix if split(t)[0] == number)
        rids = [r for r in self.s.tix[ticket] if r != rid]
        if rids:
            self.s.tix[ticket] = rids
        else:
            del self.s.tix[ticket]

    def _release_page(self, lead: int, removed: list[Removal]) -> None:
        rec = self.s.pages[lead]
        if rec["st"] == "private":
            self._free_set(rec)
            return
        keep = []
        for h, fill in rec["eps"]:
            if fill > rec["rf"]:
                ck = self.s.ck.get(h)
                if ck is not None and self.s.pages[ck]["anchor"] == lead:
                    self._drop_checkpoint(h, removed)
                del self.s.ep[h]
            else:
                keep.append([h, fill])
        rec = self.s.pages[lead]
        rec["eps"], rec["fill"] = keep, rec["rf"]
        if rec["rf"] == 0:
            if rec["par"] >= 0:
                parent = self.s.pages[rec["par"]]
                parent["kids"] -= 1
                self._save_lead(rec["par"], parent)
            self._free_set(rec)
            return
        rec["owner"] = ""
        rec["ref"] -= 1
        self._stamp(rec)
        self._save_lead(lead, rec)

    # -- evict.lua, invalidate_pool.lua ------------------------------------------------------
    async def evict(self, count: int) -> EvictResult:
        self._check_epoch()
        removed: list[Removal] = []
        n = 0
        while n < count and self._evict_one(removed):
            n += 1
        return EvictResult(n, removed)

    async def reweigh(self, weights: EvictionWeights, batch: int = 4096) -> int:
        """reweigh.lua walked from the first page id to the last, `batch` ids per call: every
        member rescored. Returns the number of calls that walk takes."""
        self._check_epoch()
        if not 1 <= batch <= 100000:
            raise BadRequest("N must be an integer in [1, 100000]")
        self.weights = self.pool.weights = weights
        for lead in self.s.lru:
            self.s.lru[lead] = self._score(self.s.pages[lead])
        return max(1, math.ceil(self.s.fresh / batch))

    async def invalidate(self, seen_epoch: int | None = None) -> int:
        """Start a new epoch; with `seen_epoch`, only if the pool is still in that epoch."""
        s = self.s
        if seen_epoch is None or seen_epoch == s.epoch:
            self.pool.state = PoolState(epoch=s.epoch + 1, tick=s.tick, ticket=s.ticket,
                                        clock=s.clock)
        self.epoch = self.s.epoch
        return self.epoch


def entry_of(rec: dict[str, Any]) -> Entry:
    """What the score reads of a registered lead record: a checkpoint counts as one of its class;
    an MLA page carries its anchored checkpoints' counts and gains per class."""
    if rec["k"] == "K":
        counts = tuple(int(c == rec["cls"]) for c in CLASSES)
        gains = tuple(rec["gain"] * n for n in counts)
    else:
        counts, gains = tuple(rec["cn"]), tuple(rec["cg"])
    return Entry(rec["k"] == "M", rec["lu"], rec["lc"], rec["depth"], len(rec["pages"]), counts, gains)


def pack_ids(ids: list[int]) -> bytes:
    """Page ids as little-endian uint32, the way the scripts store page-table paths."""
    return struct.pack(f"<{len(ids)}I", *ids)
