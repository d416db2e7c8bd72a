"""Test helpers for storage that misbehaves: a redis-server whose RDB file outlives it (so a test
can restart it from an older snapshot, or from nothing), and a scheduler that also plays the
inference worker on an in-process agent's pool, checking every hit's bytes as the chaos test
does: MLA pages hold each token's value, checkpoint pages a pattern of (prefix, group), so a hit
on pages rewritten since its entry was registered reads someone else's bytes and is counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from redis.asyncio import Redis

from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, RemoteError
from cachetier.run.servers import RedisServer
from gpu_pool import PagedPool
from index.records import RequestPlan, StepRefusal
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from tests.index_harness import commit_item, new_request


class DurableRedis(RedisServer):
    """A TCP redis-server whose `dump.rdb` lives in `data_dir`: `snapshot` saves it aside,
    `restart` kills the server and starts it again (same port) from a saved snapshot, or from
    nothing (a restart without persistence)."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(tcp=True)
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)

    def _command(self, workdir: Path) -> list[str]:
        command = super()._command(workdir)
        command[command.index("--dir") + 1] = str(self.data_dir)
        return command

    async def snapshot(self, redis: Redis, name: str) -> Path:
        """SAVE now (what an RDB schedule, a backup or a lagging replica holds) and keep it."""
        await redis.save()
        kept = self.data_dir / f"{name}.rdb"
        shutil.copyfile(self.data_dir / "dump.rdb", kept)
        return kept

    def restart(self, snapshot: Path | None) -> None:
        """SIGKILL, then start again from `snapshot` (None: an empty server)."""
        os.kill(self.pid, signal.SIGKILL)
        self.stop()
        (self.data_dir / "dump.rdb").unlink(missing_ok=True)
        if snapshot is not None:
            shutil.copyfile(snapshot, self.data_dir / "dump.rdb")
        self.start()


def state_pattern(tokens: list[int], group: int, nbytes: int) -> torch.Tensor:
    """The bytes a checkpoint of `tokens` holds in KDA group `group`: unique per prefix."""
    seed = hashlib.blake2b(repr((tokens, group)).encode(), digest_size=64).digest()
    return torch.frombuffer(bytearray(seed * -(-nbytes // len(seed))), dtype=torch.uint8)[:nbytes]


@dataclass
class Worker:
    """One scheduler on pool `pool` through the service, writing and checking the bytes of the
    in-process agent's pool `view`; every plan's epoch is logged in order, and every ticket a
    plan or commit was answered with, as (epoch, ticket)."""

    tier: CacheTierClient
    view: PagedPool
    pool: str
    block: int
    page: int
    epochs: list[int] = field(default_factory=list)
    tickets: list[tuple[int, int]] = field(default_factory=list)
    hits: int = 0
    wrong: list[str] = field(default_factory=list)
    retryable: dict[str, int] = field(default_factory=dict)

    async def plan(self, rid: str, tokens: list[int]) -> RequestPlan:
        """Plan a new request (retrying retryable errors for up to 10 s, releasing it first as a
        scheduler must: the plan may have run); its hit is checked."""
        async with asyncio.timeout(10):
            while True:
                try:
                    plan = await self.tier.plan(self.pool, [new_request(rid, tokens, len(tokens),
                                                                        self.block)])
                    break
                except RemoteError as exc:
                    if not exc.retryable:
                        raise
                    self.retryable[exc.code] = self.retryable.get(exc.code, 0) + 1
                    await self.release(rid)  # the plan may have run: released before again
                    await asyncio.sleep(0.02)
        assert not isinstance(plan, StepRefusal), plan
        self.epochs.append(plan.epoch)
        self.tickets.append((plan.epoch, plan.ticket))
        (step,) = plan.requests
        if step.hit_tokens:
            self.hits += 1
            self.wrong += self.check(step, tokens)
        return step

    async def serve(self, rid: str, tokens: list[int]) -> RequestPlan:
        """Plan, forward, commit, confirm and release one prompt in one step."""
        step = await self.plan(rid, tokens)
        try:
            self.forward(step, tokens)
            done = await self.tier.commit(self.pool, [commit_item(step, step.stop, True, True,
                                                                  self.block)])
            self.tickets.append((self.epochs[-1], done.ticket))
            await self.tier.confirm(self.pool, done.ticket)
        finally:
            await self.release(rid)
        return step

    async def release(self, rid: str) -> None:
        async with asyncio.timeout(10):
            while True:
                try:
                    await self.tier.release(self.pool, [rid])
                    return
                except CacheTierError as exc:
                    assert exc.retryable, exc
                    await asyncio.sleep(0.02)

    def check(self, step: RequestPlan, tokens: list[int]) -> list[str]:
        """What the hit's restored state and cached MLA pages hold that its prefix does not."""
        wrong, hit = [], step.hit_tokens
        page_bytes = self.view.buffer.shape[-1]
        restores = [c for c in step.copies if c.dst in step.state_pages]
        for group, c in enumerate(restores):
            expected = state_pattern(tokens[:hit], group, page_bytes)[c.offset:c.offset + c.nbytes]
            got = self.view.buffer[:, c.dst, c.offset:c.offset + c.nbytes]
            if not torch.equal(got, expected.expand_as(got)):
                wrong.append(f"{step.rid}: state page {c.dst} is not the checkpoint of {hit}")
        for group in step.mla_pages:
            for first in range(0, hit, self.page):
                page, n = group[first // self.page], min(self.page, hit - first)
                expected = torch.tensor(tokens[first:first + n], dtype=torch.float32)
                got = self.view.mla_view(page)[:, :n, :]
                if not torch.equal(got, expected[None, :, None].expand_as(got)):
                    wrong.append(f"{step.rid}: MLA page {page} lacks tokens {first}..{first + n}")
        return wrong

    def forward(self, step: RequestPlan, tokens: list[int]) -> None:
        """The forward pass: token values into the MLA pages, the pattern into the checkpoint."""
        for group in step.mla_pages:
            for pos in range(step.start, step.stop):
                self.view.mla_view(group[pos // self.page])[:, pos % self.page, :] = float(
                    tokens[pos])
        ck = commit_item(step, step.stop, True, True, self.block).checkpoint_tokens
        if ck:
            for group, page in enumerate(step.checkpoint_pages):
                self.view.buffer[:, page] = state_pattern(tokens[:ck], group,
                                                          self.view.buffer.shape[-1])


def strictly_increasing_epochs(epochs: list[int]) -> list[int]:
    """The distinct epochs in the order they were seen; a repeat after a later one is kept, so
    `== sorted(set(...))` fails on any epoch coming back."""
    seen: list[int] = []
    for epoch in epochs:
        if not seen or epoch != seen[-1]:
            seen.append(epoch)
    return seen


async def assert_nothing_held(redis: Redis, pool: str, num_pages: int, blocks_per_page: int) -> None:
    """No request, no ticket, no pin, and every invariant holds."""
    state = await read_pool(redis, pool_keys(pool))
    sanity_check(state, num_pages, blocks_per_page)
    assert state.req == {} and state.tix == {}, (list(state.req), state.tix)
    pinned = [(lead, rec["ref"]) for lead, rec in state.pages.items() if rec.get("ref", 0)]
    assert pinned == [], f"pinned after every request was released: {pinned}"
