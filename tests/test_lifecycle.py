"""`index.lifecycle.RequestLifecycle` driving the real scripts (`PrefixIndex`), the reference model
(`ReferenceIndex`) and a pool of the service (`TierPool`): the calls it makes are the engine's, in
the engine's order, and whatever fails after a plan, or loses a plan's reply, nothing is left
pinned.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachetier.errors import ConnectionLost, RemoteError, RequestTimeout
from index.face import Index
from index.lifecycle import RequestLifecycle
from index.redis_link import WriteNotAcknowledged
from index.records import CommitItem, StepPlan, StepRefusal, StepRequest
from index.reference import PoolState, ReferenceIndex
from index.snapshot import read_pool, sanity_check
from index.store import PrefixIndex, pool_keys
from tests.cluster_harness import BLOCK, TINY
from tests.index_harness import commit_item, new_request, only, small_config

CONFIG = small_config(num_pages=48)
PROMPT = list(range(500, 540))  # 40 tokens: 2.5 pages of 16, ten 4-token blocks


class Boom(Exception):
    """A forward pass (or anything else of the caller's) failing mid-step."""


class Recording:
    """An `Index` that logs each call it passes on: what the lifecycle sends is the contract.
    `state()` reads the whole pool behind it."""

    def __init__(self, index: Any, state: Callable[[], Awaitable[PoolState]]) -> None:
        self.inner = index
        self.state = state
        self.calls: list[tuple[str, Any]] = []

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        self.calls.append(("plan_step", [r.rid for r in requests]))
        return await self.inner.plan_step(requests)

    async def commit(self, items: Sequence[CommitItem]):
        self.calls.append(("commit", [i.rid for i in items]))
        return await self.inner.commit(items)

    async def confirm(self, ticket: int) -> int:
        self.calls.append(("confirm", ticket))
        return await self.inner.confirm(ticket)

    async def release(self, rids: Sequence[str]):
        self.calls.append(("release", list(rids)))
        return await self.inner.release(rids)

    async def probe(self, prompt_tokens: int, hashes: bytes):
        return await self.inner.probe(prompt_tokens, hashes)

    async def stats(self):
        return await self.inner.stats()


class LostReplies(Recording):
    """A `Recording` whose next plan runs, then raises `lose_plan` as if its reply was lost (or
    timed out, or was cancelled): the caller cannot know it ran. `lose_releases` makes every
    release fail as if the storage were down."""

    def __init__(self, recording: Recording) -> None:
        super().__init__(recording.inner, recording.state)
        self.lose_plan: BaseException | None = None
        self.lose_releases: BaseException | None = None

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        outcome = await super().plan_step(requests)
        lost, self.lose_plan = self.lose_plan, None
        if lost is not None:
            raise lost
        return outcome

    async def release(self, rids: Sequence[str]):
        if self.lose_releases is not None:
            self.calls.append(("release", list(rids)))
            raise self.lose_releases
        return await super().release(rids)


async def on_redis(redis: Any, config: Any, pool_id: str = "p") -> Recording:
    index = PrefixIndex(redis, pool_id, config)
    await index.create()
    return Recording(index, lambda: read_pool(redis, index.keys))


async def on_reference(config: Any) -> Recording:
    index = ReferenceIndex(config)
    await index.create()

    async def state() -> PoolState:  # the reference derives meta.lru_pages; Redis stores it
        return dataclasses.replace(index.s, lru_page_count=index.s.lru_pages())
    return Recording(index, state)


@pytest.fixture(params=["redis", "reference"])
async def pool(request, redis) -> Recording:
    """A fresh pool of `CONFIG` behind the scripts or the reference model."""
    return await (on_redis(redis, CONFIG) if request.param == "redis" else on_reference(CONFIG))


async def assert_nothing_held(state: PoolState, num_pages: int, blocks_per_page: int) -> None:
    sanity_check(state, num_pages, blocks_per_page)
    assert state.req == {} and state.tix == {}, "a request or ticket outlived the lifecycle"
    assert all(rec.get("ref", 0) == 0 for rec in state.pages.values()), "a pin was left"
    assert all(rec["st"] != "private" for rec in state.pages.values() if "st" in rec)


async def prefill(steps: RequestLifecycle, rid: str, tokens: list[int], chunk: int) -> list[int]:
    """A whole prompt in chunks, its last step a turn end; returns each step's stop."""
    stops = []
    step = new_request(rid, tokens, chunk, CONFIG.cache.hash_block_tokens)
    while True:
        r = only(await steps.plan([step]))
        done = r.stop == len(tokens)
        await steps.finish([commit_item(r, r.stop, done, True, CONFIG.cache.hash_block_tokens)])
        stops.append(r.stop)
        if done:
            return stops
        step = StepRequest(rid, chunk)


async def test_without_agents_a_request_is_plan_commit_confirm_per_step_then_release(pool):
    """The replay's sequence: the plan's ticket is never confirmed on its own."""
    async with RequestLifecycle(pool) as steps:
        assert await prefill(steps, "a", PROMPT, chunk=16) == [16, 32, 40]
    names = [name for name, _ in pool.calls]
    assert names == ["plan_step", "commit", "confirm"] * 3 + ["release"]
    assert pool.calls[-1] == ("release", ["a"])
    await assert_nothing_held(await pool.state(), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)
    longer = PROMPT + [1, 2, 3]
    async with RequestLifecycle(pool) as steps:
        assert only(await steps.plan([new_request("b", longer, 3, 4)])).hit_tokens == 40


async def test_settle_runs_between_the_plan_and_the_forward_pass(pool):
    """The service's sequence: settle (copies, then the plan's confirm) before the commit."""
    settled: list[int] = []

    async def settle(plan: StepPlan) -> None:
        settled.append(plan.ticket)
        await pool.confirm(plan.ticket)

    async with RequestLifecycle(pool, settle) as steps:
        plan = await steps.plan([new_request("a", PROMPT, 40, 4)])
        assert settled == [plan.ticket]
        done = await steps.finish([commit_item(only(plan), 40, True, True, 4)])
    assert pool.calls == [("plan_step", ["a"]), ("confirm", plan.ticket), ("commit", ["a"]),
                          ("confirm", done.ticket), ("release", ["a"])]
    await assert_nothing_held(await pool.state(), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)


async def test_a_failure_between_plan_and_commit_releases_the_step(pool):
    cached = list(range(900, 920))
    async with RequestLifecycle(pool) as steps:
        await prefill(steps, "cached", cached, chunk=20)        # a checkpoint to restore from
        await steps.release(["cached"])
    before = len(pool.calls)
    with pytest.raises(Boom):
        async with RequestLifecycle(pool) as steps:
            plan = await steps.plan([new_request("hit", cached + [1], 21, 4),
                                     new_request("cold", PROMPT, 16, 4)])
            assert plan.requests[0].hit_tokens == 20          # the hit pinned its checkpoint
            raise Boom("the forward pass failed")
    assert pool.calls[before:] == [("plan_step", ["hit", "cold"]), ("release", ["hit", "cold"])]
    await assert_nothing_held(await pool.state(), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)


async def test_a_settle_that_fails_releases_the_step_before_the_error_propagates(pool):
    async def copies_fail(plan: StepPlan) -> None:
        raise Boom("an agent refused the copy batch")

    steps = RequestLifecycle(pool, copies_fail)  # no `async with`: the service's plan handler
    with pytest.raises(Boom):
        await steps.plan([new_request("a", PROMPT, 16, 4)])
    assert pool.calls == [("plan_step", ["a"]), ("release", ["a"])]
    await assert_nothing_held(await pool.state(), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)


@pytest.mark.parametrize("lost", [
    RedisConnectionError("connection lost before the reply was read"),
    RedisTimeoutError("Timeout reading from socket"),
    WriteNotAcknowledged("0 of 1 replicas confirmed the write within 100 ms"),
    ConnectionLost("the service's connection dropped"),
    RequestTimeout("plan: no reply within 10 s"), asyncio.CancelledError(),
], ids=lambda exc: type(exc).__name__)
async def test_a_plan_that_may_have_run_unbeknown_to_its_caller_is_released(pool, lost):
    """The plan ran and its caller never learnt it: its requests are released, so planning them
    again at once works (it would be refused as a step never committed) and nothing stays
    pinned, a continuing request's included."""
    pool = LostReplies(pool)
    cached = list(range(900, 920))
    steps = RequestLifecycle(pool)  # no `async with`: the service's plan handler
    await prefill(steps, "cached", cached, chunk=20)
    await steps.release(["cached"])
    going = only(await steps.plan([new_request("going", PROMPT, 16, 4)]))
    await steps.finish([commit_item(going, 16, False, True, 4)])
    before = len(pool.calls)
    pool.lose_plan = lost
    step = [new_request("hit", cached + [1], 21, 4), StepRequest("going", 16)]
    with pytest.raises(type(lost)):
        await steps.plan(step)
    assert pool.calls[before:] == [("plan_step", ["hit", "going"]), ("release", ["hit", "going"])]
    await assert_nothing_held(await pool.state(), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)
    async with RequestLifecycle(pool) as again:
        assert only(await again.plan([step[0]])).hit_tokens == 20


async def test_a_lost_plan_whose_release_is_lost_too_raises_the_plan_s_error(pool):
    """The storage that lost the plan's reply may be down yet: the release fails as well, and
    the caller sees why its plan failed (the requests' leases, or its own release, end them)."""
    pool = LostReplies(pool)
    pool.lose_plan = RedisConnectionError("connection lost before the reply was read")
    pool.lose_releases = RedisConnectionError("Connection refused")
    with pytest.raises(RedisConnectionError, match="before the reply"):
        await RequestLifecycle(pool).plan([new_request("a", PROMPT, 16, 4)])
    assert pool.calls == [("plan_step", ["a"]), ("release", ["a"])]


@pytest.mark.parametrize("side", ["redis", "reference"])
async def test_a_refused_step_is_returned_and_leaves_nothing_to_release(redis, side):
    tiny = small_config(num_pages=4)
    pool = await (on_redis(redis, tiny) if side == "redis" else on_reference(tiny))
    async with RequestLifecycle(pool) as steps:
        refusal = await steps.plan([new_request("a", PROMPT, 40, 4)])
    assert isinstance(refusal, StepRefusal) and refusal.pages_needed > refusal.pages_available
    assert pool.calls == [("plan_step", ["a"])]
    await assert_nothing_held(await pool.state(), 4, tiny.cache.blocks_per_page)


async def test_a_failure_in_an_invalidated_pool_is_raised_not_its_stale_release(redis):
    """Another replica bumped the epoch mid-step: the pins are void, the release answers
    `StaleEpoch`, and the caller sees its own failure."""
    index = PrefixIndex(redis, "p", CONFIG)
    await index.create()
    with pytest.raises(Boom):
        async with RequestLifecycle(index) as steps:
            await steps.plan([new_request("a", PROMPT, 16, 4)])
            await PrefixIndex(redis, "p", CONFIG).invalidate()
            raise Boom("the forward pass failed")
    await assert_nothing_held(await read_pool(redis, index.keys), CONFIG.cache.num_pages,
                              CONFIG.cache.blocks_per_page)


async def test_through_the_service_the_plan_is_settled_there_and_a_failure_releases(tier, agent,
                                                                                   redis):
    pool = tier.pool("p")
    assert isinstance(pool, Index)
    tokens = list(range(100, 140))
    async with RequestLifecycle(pool) as steps:
        plan = only(await steps.plan([new_request("a", tokens, 40, BLOCK)]))
        await steps.finish([commit_item(plan, 40, True, True, BLOCK)])
    with pytest.raises(Boom):
        async with RequestLifecycle(pool) as steps:
            hit = only(await steps.plan([new_request("b", tokens + [7], 41, BLOCK)]))
            assert hit.hit_tokens == 32 and hit.copies          # the agent ran the restore
            raise Boom("the forward pass failed")
    await assert_nothing_held(await read_pool(redis, pool_keys("p")), TINY.cache.num_pages,
                              TINY.cache.blocks_per_page)


async def test_a_plan_the_service_ran_but_whose_redis_reply_it_lost_can_be_planned_again(
        tier, agent, redis, monkeypatch):
    """Redis ran the service's plan script and the reply was lost: the caller gets a retryable
    error, and planning the same requests again works at once, without releasing them first."""
    real_plan_step = PrefixIndex.plan_step
    lost: list[StepPlan | StepRefusal] = []

    async def plan_then_lose_the_reply(index, requests):
        outcome = await real_plan_step(index, requests)
        if not lost:
            lost.append(outcome)
            raise RedisConnectionError("connection lost before the reply was read")
        return outcome
    monkeypatch.setattr(PrefixIndex, "plan_step", plan_then_lose_the_reply)
    step = [new_request("a", list(range(100, 140)), 40, BLOCK)]
    with pytest.raises(RemoteError) as failed:
        await tier.plan("p", step)
    assert failed.value.retryable and isinstance(lost[0], StepPlan)
    assert failed.value.code == "redis_unavailable" and "step released" in str(failed.value)
    async with RequestLifecycle(tier.pool("p")) as steps:
        plan = only(await steps.plan(step))
        await steps.finish([commit_item(plan, 40, True, True, BLOCK)])
    await assert_nothing_held(await read_pool(redis, pool_keys("p")), TINY.cache.num_pages,
                              TINY.cache.blocks_per_page)
