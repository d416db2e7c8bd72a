"""Test helpers for the index: a small config, prompts built from shared documents, a byte model
of the pool that plays the agent, so tests can check what a hit's pages really hold, and `make` /
`serve` to open a Redis pool and prefill a prompt on it the way an engine does.

The byte model applies a step's copies and a forward pass's writes only when their ticket is
confirmed, the latest moment a real device could have finished them. A page that is matched while
still pending therefore holds its previous owner's bytes here too, and the content checks fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachetier.config import CacheSpec, Config, ModelSpec
from index.hashing import chain_hashes, namespace_root
from index.lifecycle import RequestLifecycle
from index.records import CommitItem, RequestPlan, StepPlan, StepRequest
from index.store import PrefixIndex

ROOT = namespace_root("test-model")


FAMILIES = ("kda-mla", "gdn-gqa")


def small_config(kda_groups: int = 3, mla_groups: int = 1, num_pages: int = 48,
                 block: int = 4, page: int = 16, family: str = "kda-mla") -> Config:
    """4-token hash blocks in 16-token pages: every boundary case is a few tokens away. The
    `gdn-gqa` family has other copy sizes (8-byte token rows: K and V of one KV head)."""
    if family == "kda-mla":
        model = ModelSpec(kda_groups=kda_groups, mla_groups=mla_groups, layers_per_group=1,
                          kda_heads=1, kda_head_k_dim=2, kda_head_v_dim=2, mla_latent_dim=1)
    else:
        model = ModelSpec(linear_kind="gdn", attention_kind="gqa", kda_groups=kda_groups,
                          mla_groups=mla_groups, layers_per_group=1, kda_heads=2,
                          kda_key_heads=1, kda_head_k_dim=2, kda_head_v_dim=2, mla_latent_dim=0,
                          gqa_kv_heads=1, gqa_head_dim=1)
    return Config(model, CacheSpec(hash_block_tokens=block, page_tokens=page, num_pages=num_pages,
                                   page_alignment=16, max_batch=8))


def new_request(rid: str, tokens: list[int], compute: int, block: int, checkpoint: bool = True,
                root: bytes = ROOT) -> StepRequest:
    return StepRequest(rid, compute, len(tokens), chain_hashes(tokens, root, block), checkpoint)


@dataclass
class PageBytes:
    """What each page id holds: MLA pages a token per position, KDA pages the prefix they encode."""

    mla_tokens: int
    mla_token_bytes: int
    content: dict[int, Any] = field(default_factory=dict)
    deferred: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)

    def defer(self, rid: str, ticket: int, write: Any) -> None:
        self.deferred.setdefault(rid, []).append((ticket, write))

    def settle(self, rids: list[str], ticket: int) -> None:
        for rid in rids:
            todo = self.deferred.get(rid, [])
            for _, write in [w for w in todo if w[0] <= ticket]:
                write()
            self.deferred[rid] = [w for w in todo if w[0] > ticket]

    def forget(self, rid: str) -> None:
        self.deferred.pop(rid, None)

    def mla(self, page: int) -> list[Any]:
        current = self.content.get(page)
        if not isinstance(current, list):
            current = [None] * self.mla_tokens
            self.content[page] = current
        return current

    def copy(self, src: int, dst: int, nbytes: int, kind: str) -> None:
        if kind == "K":
            self.content[dst] = self.content.get(src)
        else:
            n = nbytes // self.mla_token_bytes
            self.mla(dst)[:n] = list(self.mla(src)[:n])


def forward_write(bytes_: PageBytes, plan: RequestPlan, tokens: list[int], stop: int,
                  ckpt_tokens: int, page_tokens: int):
    """The forward pass: MLA tokens [start, stop) into the page table, the KDA state at the
    checkpoint boundary into the checkpoint pages, and the running state into the state pages."""
    def write() -> None:
        for group in plan.mla_pages:
            for pos in range(plan.start, stop):
                bytes_.mla(group[pos // page_tokens])[pos % page_tokens] = tokens[pos]
        for page in plan.checkpoint_pages if ckpt_tokens else []:
            bytes_.content[page] = ("state", tuple(tokens[:ckpt_tokens]))
        for page in plan.state_pages:
            bytes_.content[page] = ("state", tuple(tokens[:stop]))
    return write


def check_hit(bytes_: PageBytes, plan: RequestPlan, tokens: list[int], page_tokens: int,
              block: int) -> None:
    """Everything a hit reads holds exactly the declared prefix: the shared pages, the prefix the
    copy-on-write takes from its source, and the checkpoint restored into private state."""
    hit = plan.hit_tokens
    assert hit % block == 0 and hit < len(tokens)
    full = hit // page_tokens
    for group in plan.mla_pages:
        for slot in range(full):
            held = bytes_.mla(group[slot])
            assert held == tokens[slot * page_tokens:(slot + 1) * page_tokens], (
                f"{plan.rid}: shared page {group[slot]} holds the wrong tokens")
    for c in plan.copies:
        if c.dst in plan.state_pages:
            assert bytes_.content.get(c.src) == ("state", tuple(tokens[:hit])), (
                f"{plan.rid}: checkpoint page {c.src} does not hold the state at {hit}")
        else:
            n = c.nbytes // bytes_.mla_token_bytes
            assert full * page_tokens + n == hit
            assert bytes_.mla(c.src)[:n] == tokens[full * page_tokens:hit], (
                f"{plan.rid}: copy-on-write source {c.src} holds the wrong prefix")


def commit_item(plan: RequestPlan, stop: int, durable: bool = False, with_checkpoint: bool = True,
                block: int = 4) -> CommitItem:
    ck = stop // block * block if with_checkpoint and plan.checkpoint_pages else 0
    if ck <= plan.start:
        ck = 0
    return CommitItem(plan.rid, stop, ck, durable)


def only(plan: StepPlan) -> RequestPlan:
    assert isinstance(plan, StepPlan), plan
    (r,) = plan.requests
    return r


class Driver:
    """Drives an index (Redis or reference) like an engine would, with `PageBytes` as the agent:
    it remembers each request's tokens and plan, defers the device's work to confirmation, and
    checks the bytes behind every hit. It has the index's face itself (`plan_step` for requests
    whose tokens it knows), so `index.lifecycle` drives it like any index."""

    def __init__(self, index: Any, config: Config) -> None:
        self.index = index
        self.block = config.cache.hash_block_tokens
        self.page_tokens = config.cache.page_tokens
        self.bytes = PageBytes(config.cache.page_tokens, config.model.mla_token_bytes)
        self.tokens: dict[str, list[int]] = {}
        self.plans: dict[str, RequestPlan] = {}
        self.tickets: dict[int, list[str]] = {}

    @property
    def epoch(self) -> int:
        return self.index.epoch

    async def plan_step(self, requests: list[StepRequest]):
        return await self.plan(requests, {})

    async def plan(self, requests: list[StepRequest], tokens: dict[str, list[int]]):
        result = await self.index.plan_step(requests)
        if not isinstance(result, StepPlan):
            return result
        self.tokens.update(tokens)
        self.tickets[result.ticket] = [r.rid for r in result.requests]
        for plan in result.requests:
            self.plans[plan.rid] = plan
            if plan.start == plan.hit_tokens and plan.hit_tokens > 0:
                check_hit(self.bytes, plan, self.tokens[plan.rid], self.page_tokens, self.block)
            self.bytes.defer(plan.rid, result.ticket, self._copier(plan))
        return result

    def _copier(self, plan: RequestPlan):
        def copy_all() -> None:
            for c in plan.copies:
                self.bytes.copy(c.src, c.dst, c.nbytes, "K" if c.dst in plan.state_pages else "M")
        return copy_all

    async def commit(self, items: list[CommitItem]):
        result = await self.index.commit(items)
        self._forward_writes(items, result.ticket)
        return result

    async def commit_groups(self, groups: list[list[CommitItem]]):
        results = await self.index.commit_groups(groups)
        for items, result in zip(groups, results):
            self._forward_writes(items, result.ticket)
        return results

    def _forward_writes(self, items: list[CommitItem], ticket: int) -> None:
        """The forward pass's writes of a commit, on the device once `ticket` is confirmed."""
        self.tickets[ticket] = [i.rid for i in items]
        for item in items:
            plan = self.plans[item.rid]
            write = forward_write(self.bytes, plan, self.tokens[item.rid], item.stop,
                                  item.checkpoint_tokens, self.page_tokens)
            self.bytes.defer(item.rid, ticket, write)

    async def confirm(self, ticket: int) -> int:
        count = await self.index.confirm(ticket)
        self.bytes.settle(self.tickets.pop(ticket, []), ticket)
        return count

    async def confirm_many(self, tickets: list[int]) -> list[int | None]:
        counts = await self.index.confirm_many(tickets)
        for ticket, count in zip(tickets, counts):
            if count is not None:
                self.bytes.settle(self.tickets.pop(ticket, []), ticket)
        return counts

    async def release(self, rids: list[str]):
        result = await self.index.release(rids)
        self.forget(rids)
        return result

    def forget(self, rids: list[str]) -> None:
        """What this driver knows of released requests (by `release`, or reaped) goes."""
        for rid in rids:
            self.bytes.forget(rid)
            self.plans.pop(rid, None)

    async def evict(self, count: int):
        return await self.index.evict(count)

    def invalidated(self) -> None:
        self.bytes.content.clear()
        self.bytes.deferred.clear()
        self.plans.clear()
        self.tickets.clear()


async def make(redis: Any, config: Config, pool: str = "p") -> Driver:
    """A fresh Redis pool of `config`, driven by a `Driver`."""
    index = PrefixIndex(redis, pool, config)
    await index.create()
    return Driver(index, config)


async def serve(d: Driver, rid: str, tokens: list[int], chunk: int, durable: bool = True,
                block: int | None = None) -> list[StepPlan]:
    """Prefill a whole prompt in chunks the way an engine does (`index.lifecycle`): plan,
    confirm, forward, commit, confirm; then release. Returns the plans of each step."""
    block = block or d.block
    plans = []
    d.tokens[rid] = tokens
    step = new_request(rid, tokens, chunk, block)
    async with RequestLifecycle(d, settle=lambda plan: d.confirm(plan.ticket)) as steps:
        while True:
            plan = await steps.plan([step])
            plans.append(plan)
            r = only(plan)
            done = r.stop == len(tokens)
            await steps.finish([commit_item(r, r.stop, durable and done, True, block)])
            if done:
                return plans
            step = StepRequest(rid, chunk)
