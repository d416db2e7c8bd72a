"""Concurrent plans of one pool share one plan script call (`cachetier.service.batching`); so do
concurrent commits, confirms and releases.

Through a real service, agent and Redis: the plan script calls are counted by wrapping the
service's `PrefixIndex.plan_step` of the pool (the call still goes to Redis). The timing and the
cancellation while a merged step runs are checked on `PlanCoalescer` itself, with a step the test
holds open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from cachetier.cli import main
from cachetier.client import CacheTierClient
from cachetier.errors import RemoteError
from cachetier.service.batching import PlanCoalescer
from cachetier.service.server import CacheTierService, ServiceSettings
from index.lifecycle import RequestLifecycle
from index.records import (CommitItem, ReleaseResult, RequestPlan, StepPlan, StepRefusal,
                           StepRequest)
from index.store import pool_keys
from index.tickets import split
from tests.cluster_harness import (BLOCK, SECRET, TINY, TOKEN, assert_no_pins, eventually,
                                   running_agent, running_service)
from tests.index_harness import commit_item, new_request

TICK = 0.2  # long enough that the callers a test starts together are sure to share a step


def prompt(n: int, length: int = 100) -> list[int]:
    return [1 + (n * 131 + 7 * i) % 997 for i in range(length)]


@dataclass
class Batching:
    """A service with a long tick and its agent; the batch size of every plan script call, and
    the first calls held (their script has run) until their `holds` are set, so the callers that come
    next find a step in flight and gather."""

    service: CacheTierService
    sizes: list[int] = field(default_factory=list)
    holds: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event()])

    @property
    def first_done(self) -> asyncio.Event:
        return self.holds[0]


@pytest.fixture
async def batching(redis, redis_url) -> AsyncIterator[Batching]:
    async with running_service(redis_url, batch_tick_s=TICK) as service, \
            running_agent(service.url):
        seen = Batching(service)
        index = service._pools["p"].index
        plan_step = index.plan_step

        async def counted(requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
            seen.sizes.append(len(requests))
            call = len(seen.sizes) - 1
            outcome = await plan_step(requests)
            if call < len(seen.holds):
                await seen.holds[call].wait()
            return outcome

        index.plan_step = counted  # type: ignore[method-assign]
        yield seen


async def clients(url: str, n: int) -> list[CacheTierClient]:
    return [await CacheTierClient(url, token=TOKEN, timeout=10).__aenter__() for _ in range(n)]


async def test_concurrent_callers_share_one_script_call_and_get_their_own_plans(batching, redis):
    service, sizes = batching.service, batching.sizes
    tiers = await clients(service.url, 5)
    try:
        batches = {n: [new_request(f"c{n}.{k}", prompt(10 * n + k), 100, BLOCK)
                       for k in range(n % 2 + 1)] for n in range(5)}
        first = asyncio.create_task(tiers[0].plan("p", batches[0]))  # the idle pool: sent at once
        await asyncio.sleep(0.01)
        rest = await asyncio.gather(*(tiers[n].plan("p", batches[n]) for n in range(1, 5)))
        batching.first_done.set()
        plans = [await first] + list(rest)
        assert sizes == [1, sum(len(batches[n]) for n in range(1, 5))]
        for n, plan in enumerate(plans):
            assert isinstance(plan, StepPlan)
            assert [r.rid for r in plan.requests] == [r.rid for r in batches[n]]
            assert all(r.hit_tokens == 0 and r.stop == 100 for r in plan.requests)
        # one merged step, one ticket: its counter (each caller's view masks the rest)
        counters = [split(p.ticket)[0] for p in plans]
        assert len(set(counters[1:])) == 1 and counters[0] != counters[1]
        pages = [page for p in plans for r in p.requests for g in r.mla_pages for page in g]
        assert len(pages) == len(set(pages))  # nobody got another caller's pages
        # each caller finishes on its own: commits, confirms its own commit ticket, releases
        for n, plan in enumerate(plans):
            done = await RequestLifecycle(tiers[n].pool("p")).finish(
                [commit_item(r, r.stop, True, True, BLOCK) for r in plan.requests])
            assert sorted(r.rid for r in done.requests) == sorted(r.rid for r in plan.requests)
            await tiers[n].release("p", [r.rid for r in plan.requests])
        await assert_no_pins(redis)
        again = await tiers[1].plan("p", [new_request("again", prompt(10), 100, BLOCK)])
        assert isinstance(again, StepPlan) and again.requests[0].hit_tokens > 0
        await tiers[1].release("p", ["again"])
    finally:
        for tier in tiers:
            await tier.close()
    await assert_no_pins(redis)


async def test_a_refused_or_invalid_caller_does_not_fail_the_others(batching, redis):
    service, sizes = batching.service, batching.sizes
    tiers = await clients(service.url, 5)
    try:
        huge = 64 * (TINY.cache.num_pages + 8)  # more pages than the pool holds
        first = asyncio.create_task(tiers[0].plan("p", [new_request("a", prompt(1), 100, BLOCK)]))
        await asyncio.sleep(0.01)
        refused, unknown, twice, fine = await asyncio.gather(
            tiers[1].plan("p", [new_request("big", prompt(2, huge), huge, BLOCK)]),
            tiers[2].plan("p", [StepRequest("never-planned", 16, 100)]),
            # its own "a" again, in flight: another scheduler's "a" would be another request
            tiers[0].plan("p", [new_request("a", prompt(3), 100, BLOCK)]),
            tiers[4].plan("p", [new_request("b", prompt(4), 100, BLOCK)]),
            return_exceptions=True)
        batching.first_done.set()
        assert isinstance(await first, StepPlan)
        assert sizes[:2] == [1, 4]  # the merged step was tried, then each caller alone
        assert isinstance(refused, StepRefusal)
        assert isinstance(unknown, RemoteError) and isinstance(twice, RemoteError)
        assert isinstance(fine, StepPlan) and [r.rid for r in fine.requests] == ["b"]
        await tiers[0].release("p", ["a"])
        await tiers[4].release("p", ["b"])
    finally:
        for tier in tiers:
            await tier.close()
    await assert_no_pins(redis)


async def test_a_caller_leaving_mid_tick_or_mid_step_loses_nothing_of_the_others(batching, redis):
    """The callers here are the coalescer's own (a closed client connection does not cancel its
    requests in the service; `close()` does, for all at once)."""
    service, sizes = batching.service, batching.sizes
    coalescer = service._pools["p"].plans
    assert coalescer is not None
    second_done = asyncio.Event()
    batching.holds.append(second_done)
    first = asyncio.create_task(coalescer.submit([new_request("a", prompt(1), 100, BLOCK)]))
    await asyncio.sleep(0.01)
    leaving = asyncio.create_task(coalescer.submit([new_request("x", prompt(2), 100, BLOCK)]))
    held = [asyncio.create_task(coalescer.submit([new_request(rid, prompt(n), 100, BLOCK)]))
            for n, rid in ((3, "y"), (4, "z"))]
    await asyncio.sleep(TICK / 4)
    leaving.cancel()  # mid-tick: dropped from its batch
    await asyncio.sleep(TICK)
    assert sizes == [1, 2]  # y and z, planned and held
    held[1].cancel()  # mid-step: its requests are released once the step is planned
    second_done.set()
    assert [r.rid for r in (await held[0]).requests] == ["y"]
    batching.holds[0].set()
    assert [r.rid for r in (await first).requests] == ["a"]
    await asyncio.gather(leaving, held[1], return_exceptions=True)
    await service._pools["p"].index.release(["a", "y"])  # the coalescer's ids: no owner's
    await eventually(lambda: redis.hlen(pool_keys("p")[6]), lambda n: n == 0)
    await assert_no_pins(redis)


async def test_concurrent_releases_share_one_script_call_and_get_their_own_results(batching,
                                                                                  redis):
    service, index = batching.service, batching.service._pools["p"].index
    tiers = await clients(service.url, 4)
    sizes: list[int] = []
    first_done = asyncio.Event()
    release = index.release

    async def counted(rids: Sequence[str]) -> ReleaseResult:
        sizes.append(len(rids))
        result = await release(rids)
        if len(sizes) == 1:
            await first_done.wait()
        return result

    try:
        batching.first_done.set()
        for n in range(4):
            await tiers[n].plan("p", [new_request(f"r{n}.{k}", prompt(10 * n + k), 100, BLOCK)
                                      for k in range(2)])
        index.release = counted  # type: ignore[method-assign]
        first = asyncio.create_task(tiers[0].release("p", ["r0.0", "r0.1"]))
        await asyncio.sleep(0.01)
        results = await asyncio.gather(tiers[1].release("p", ["r1.0", "r1.1"]),
                                       tiers[2].release("p", ["r2.0", "gone"]),
                                       tiers[3].release("p", ["r3.0"]))
        first_done.set()
        assert (await first).released == 2 and sizes == [2, 5]
        assert [(r.released, r.unknown) for r in results] == [(2, []), (1, ["gone"]), (1, [])]
        # each scheduler names its own request and another's: only its own is released
        twice = await asyncio.gather(*(tiers[n].release("p", ["r2.1", "r3.1"]) for n in (2, 3)))
        assert [(r.released, r.unknown) for r in twice] == [(1, ["r3.1"]), (1, ["r2.1"])]
        assert sizes[:2] == [2, 5] and sum(sizes[2:]) == 4
    finally:
        for tier in tiers:
            await tier.close()
    await assert_no_pins(redis)


def held_calls(index: object, name: str, sizes: list[list[int]]) -> asyncio.Event:
    """Wraps `index.<name>` (commit_groups or confirm_many, which the single calls go through
    too): each call's sizes (items per group, or one per ticket) recorded, the first one held
    after its script ran until the returned event is set."""
    call = getattr(index, name)
    first_done = asyncio.Event()

    async def counted(batch):
        grouped = name == "commit_groups"
        sizes.append([len(group) for group in batch] if grouped else [1] * len(batch))
        result = await call(batch)
        if len(sizes) == 1:
            await first_done.wait()
        return result

    setattr(index, name, counted)
    return first_done


def count_merged(service: CacheTierService) -> None:
    """The pool's coalescers call the index's merged calls bound when the pool was set up: send
    them through the wrappers of `held_calls` too."""
    state = service._pools["p"]
    state.commits._run_groups = state.index.commit_groups  # type: ignore[union-attr]
    state.confirms._run_many = state.index.confirm_many  # type: ignore[union-attr]


async def test_concurrent_commits_and_confirms_share_one_script_call_each(batching, redis):
    """Each caller keeps a ticket of its own: confirming it settles its own writes, so a hit on
    its prefix comes after its own confirm, not a neighbour's; an unknown ticket or a bad commit
    fails its own caller only (a merged commit the index refuses runs per caller)."""
    service, index = batching.service, batching.service._pools["p"].index
    tiers = await clients(service.url, 5)
    commits: list[list[int]] = []
    confirms: list[list[int]] = []
    try:
        batching.first_done.set()
        plans = [await tiers[n].plan("p", [new_request(f"k{n}.{k}", prompt(20 * n + k), 100, BLOCK)
                                           for k in range(n % 2 + 1)]) for n in range(4)]
        commit_done = held_calls(index, "commit_groups", commits)
        confirm_done = held_calls(index, "confirm_many", confirms)
        count_merged(service)
        items = [[commit_item(r, r.stop, True, True, BLOCK) for r in plan.requests]
                 for plan in plans]
        first = asyncio.create_task(tiers[0].commit("p", items[0]))
        await asyncio.sleep(0.01)
        rest = await asyncio.gather(*(tiers[n].commit("p", items[n]) for n in range(1, 4)),
                                    tiers[4].commit("p", [CommitItem("never-planned", 50, 0)]),
                                    return_exceptions=True)
        commit_done.set()
        done = [await first, *rest[:3]]
        # the first alone; one call of four groups, refused whole (the unknown request); then
        # each of the four alone
        assert commits == [[1], [2, 1, 2, 1], [2], [1], [2], [1]]
        assert isinstance(rest[3], RemoteError)
        assert len({d.ticket for d in done}) == 4
        for n, result in enumerate(done):
            assert [r.rid for r in result.requests] == [r.rid for r in plans[n].requests]
        first = asyncio.create_task(tiers[0].confirm("p", done[0].ticket))
        await asyncio.sleep(0.01)
        counts = await asyncio.gather(tiers[1].confirm("p", done[1].ticket),
                                      tiers[2].confirm("p", 10**9),
                                      tiers[3].confirm("p", done[3].ticket),
                                      return_exceptions=True)
        confirm_done.set()
        assert await first == 1 and confirms == [[1], [1, 1, 1]]
        assert counts[0] == 2 and counts[2] == 2 and isinstance(counts[1], RemoteError)
        for n, prompt_of in ((1, prompt(20)), (2, prompt(40))):  # confirmed, not confirmed
            probe = await tiers[n].plan("p", [new_request(f"probe{n}", prompt_of, 100, BLOCK)])
            assert (probe.requests[0].hit_tokens > 0) == (n == 1), n
            await tiers[n].release("p", [f"probe{n}"])
        assert await tiers[2].confirm("p", done[2].ticket) == 1
        for n, plan in enumerate(plans):
            await tiers[n].release("p", [r.rid for r in plan.requests])
    finally:
        for tier in tiers:
            await tier.close()
    await assert_no_pins(redis)


class HeldSteps:
    """A `PlanCoalescer` step the test holds open: records when each batch was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, list[str]]] = []
        self.released: list[list[str]] = []
        self.go = asyncio.Event()

    async def run(self, requests: Sequence[StepRequest]) -> StepPlan:
        self.sent.append((time.perf_counter(), [r.rid for r in requests]))
        await self.go.wait()
        return StepPlan(len(self.sent), 1, [RequestPlan(r.rid, 0, 0, 1, [], [], [], 0, [])
                                            for r in requests], 0)

    async def release(self, rids: Sequence[str]) -> None:
        self.released.append(list(rids))


async def test_a_caller_waits_at_most_the_tick_and_one_leaving_mid_step_is_released():
    held = HeldSteps()
    coalescer = PlanCoalescer(held.run, held.release, tick_s=0.05, max_batch=8)
    begin = time.perf_counter()
    alone = asyncio.create_task(coalescer.submit([StepRequest("a", 1, 1)]))
    await asyncio.sleep(0)
    assert held.sent[0][0] - begin < 0.01  # an idle pool: sent at once
    arrived = time.perf_counter()
    waiting = [asyncio.create_task(coalescer.submit([StepRequest(rid, 1, 1)])) for rid in "bc"]
    await asyncio.sleep(0.1)  # the first step is still held open
    sent_at, rids = held.sent[1]
    assert rids == ["b", "c"] and sent_at - arrived < 0.05 + 0.02
    waiting[0].cancel()  # leaves while its merged step runs
    held.go.set()
    assert [r.rid for r in (await waiting[1]).requests] == ["c"]
    assert (await alone).requests[0].rid == "a"
    full = await coalescer.submit([StepRequest(f"f{n}", 1, 1) for n in range(8)])
    assert len(full.requests) == 8 and len(held.sent) == 3
    await coalescer.close()  # waits for the release of the caller that left
    assert held.released == [["b"]]


@pytest.mark.parametrize("flags, tick", [([], 0.001), (["--batch-tick", "0"], 0.0),
                                         (["--batch-tick", "0.004"], 0.004)])
def test_serve_takes_its_batch_tick_from_the_command_line(monkeypatch, flags, tick):
    settings: list[ServiceSettings] = []

    async def run_service(given: ServiceSettings, *_: object) -> None:
        settings.append(given)

    monkeypatch.setattr("cachetier.run.nodes.run_service", run_service)
    monkeypatch.setenv("CACHETIER_SECRET", SECRET)
    assert main(["serve", "--redis", "redis://127.0.0.1:1", *flags]) == 0
    assert [s.batch_tick_s for s in settings] == [tick]


def test_a_negative_batch_tick_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("CACHETIER_SECRET", SECRET)
    assert main(["serve", "--redis", "redis://127.0.0.1:1", "--batch-tick", "-1"]) == 2
    assert "cachetier: --batch-tick:" in capsys.readouterr().err
