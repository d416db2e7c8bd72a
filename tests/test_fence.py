"""The data path's epoch fence (issue 14, wrong hit 1): a writer planned in a voided epoch never
lands in the page ids the next epoch hands out.

The zombie sequence, replayed deterministically with the real service, a real agent and a worker
attached to its pool: a request is planned in epoch N; the pool's epoch is bumped while its
agent lives on (a liveness "offline", or another replica losing its link); a request of the new
epoch gets the same page ids, writes them, commits and confirms; the old request's writer writes
late; a hit on the new request must read its bytes, not the zombie's. Once with the zombie as a
worker writing in place, once as a copy batch of another service replica that arrives late.

A writer that never leaves its section (issue 34, finding 5: a hung worker, or any co-located
process holding a shared lock of the fence file) stopped the pool until the service's copy
timeout, again at every bump after. Replayed with the holder in a process of its own: the bump
waits the agent's `fence_wait_s` only and moves the pool to new memory; the holder's write in
progress lands in the old memory, none of it in the bytes a hit of the new epoch reads, and its
next write is refused. A writer that leaves within the wait is still waited for, in place.

The fence per request (`gpu_pool.claims`; issue 34, finding 2): a pass that outlived its
request's lease wrote, still in its plan's epoch, into pages the reaper had freed and the next
step had handed to another request. Replayed with the service's reaper: the late pass is refused
on the pages handed on, a claim waits for a writer in its pages, and a hung one costs a retryable
step and a new epoch, never a wrong hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
import torch

from cachetier.client import CacheTierClient
from cachetier.errors import ErrorCode, RemoteError, StaleOrder, WriterStalled
from cachetier.service.fleet import AgentLink
from cachetier.service.reaper import ReaperSettings
from cachetier.wire.protocol import CopyBatch
from gpu_pool import PagedPool, PoolHandle
from gpu_pool.claims import runs
from gpu_pool.fence import OrderFence
from index.records import RequestPlan, StepPlan, StepRefusal
from index.tickets import write_stamp
from tests.cluster_harness import (BLOCK, PAGE, TINY, TOKEN, assert_no_pins, eventually,
                                   running_agent, running_service)
from tests.index_harness import commit_item, new_request, only

DOC = [7 + (11 * i) % 900 for i in range(300)]
ZOMBIE, FRESH = DOC[:100], [5000 + t for t in DOC[:100]]


def pattern(tokens: list[int], group: int, nbytes: int) -> torch.Tensor:
    """The bytes of the checkpoint of `tokens` in KDA group `group`: unique per prefix."""
    seed = hashlib.blake2b(repr((tokens, group)).encode(), digest_size=64).digest()
    return torch.frombuffer(bytearray(seed * -(-nbytes // 64)), dtype=torch.uint8)[:nbytes]


def write(view: PagedPool, plan: StepPlan, step: RequestPlan, tokens: list[int]) -> None:
    """A worker's forward pass of `step` of `plan`, under the pool's fence and claims."""
    with writing(view, plan, step):
        write_pages(view, step, tokens)


def writing(view: PagedPool, plan: StepPlan, step: RequestPlan):
    """The section a worker writes `step` of `plan` in."""
    return view.writing(plan.epoch, write_stamp(plan.ticket), step.written_pages(PAGE))


def write_pages(view: PagedPool, step: RequestPlan, tokens: list[int]) -> None:
    """The bytes of a pass: each token's value into its MLA rows, the checkpoint pattern into
    the checkpoint pages."""
    ck = commit_item(step, step.stop, True, True, BLOCK).checkpoint_tokens
    for group in step.mla_pages:
        for pos in range(step.start, step.stop):
            view.mla_view(group[pos // PAGE])[:, pos % PAGE, :] = float(tokens[pos])
    for group, page in enumerate(step.checkpoint_pages):
        view.buffer[:, page] = pattern(tokens[:ck], group, view.buffer.shape[-1])


def holds_checkpoint(view: PagedPool, step: RequestPlan, tokens: list[int]) -> bool:
    """Whether `step`'s checkpoint pages hold its pass's pattern in `view`."""
    ck = commit_item(step, step.stop, True, True, BLOCK).checkpoint_tokens
    return all(torch.equal(view.buffer[:, page],
                           pattern(tokens[:ck], group, view.buffer.shape[-1])
                           .expand_as(view.buffer[:, page]))
               for group, page in enumerate(step.checkpoint_pages))


def wrong_bytes(view: PagedPool, step: RequestPlan, tokens: list[int]) -> int:
    """Bytes of the hit's restored state and cached MLA rows that are not its prefix's."""
    hit, wrong = step.hit_tokens, 0
    restores = [c for c in step.copies if c.dst in step.state_pages]
    assert [c.dst for c in restores] == step.state_pages, step
    for group, c in enumerate(restores):
        expected = pattern(tokens[:hit], group, view.buffer.shape[-1])[c.offset:c.offset + c.nbytes]
        got = view.buffer[:, c.dst, c.offset:c.offset + c.nbytes]
        wrong += int((got != expected.expand_as(got)).sum())
    for group in step.mla_pages:
        for first in range(0, hit, PAGE):
            rows = view.mla_view(group[first // PAGE])[:, :min(PAGE, hit - first), :]
            expected = torch.tensor(tokens[first:first + rows.shape[1]], dtype=torch.float32)
            wrong += int((rows != expected[None, :, None]).sum()) * rows.element_size()
    return wrong


def written_pages(step: RequestPlan) -> set[int]:
    """The pages a hit on `step`'s request reads: its MLA pages and its checkpoint."""
    return {p for group in step.mla_pages for p in group} | set(step.checkpoint_pages)


async def serve(tier: CacheTierClient, view: PagedPool, rid: str,
                tokens: list[int]) -> RequestPlan:
    """Plan, write, commit, confirm and release a whole prompt, as an engine does."""
    plan = await tier.plan("p", [new_request(rid, tokens, len(tokens), BLOCK)])
    return await finish(tier, view, plan, rid, tokens)


async def finish(tier: CacheTierClient, view: PagedPool, plan: StepPlan | StepRefusal, rid: str,
                 tokens: list[int]) -> RequestPlan:
    """`serve` once the plan is answered."""
    assert isinstance(plan, StepPlan), plan
    step = only(plan)
    write(view, plan, step, tokens)
    done = await tier.commit("p", [commit_item(step, step.stop, True, True, BLOCK)])
    await tier.confirm("p", done.ticket)
    await tier.release("p", [rid])
    return step


async def bumped(tier: CacheTierClient, epoch: int) -> int:
    """The pool's epoch once it has moved past `epoch` and rank 0 serves again."""
    stats = await eventually(lambda: tier.stats("p"),
                             lambda s: s.epoch > epoch and s.ranks == [0])
    return stats.epoch


async def hit_on(tier: CacheTierClient, tokens: list[int]) -> RequestPlan:
    probe = tokens + [1]
    step = only(await tier.plan("p", [new_request("hit", probe, len(probe), BLOCK)]))
    assert step.hit_tokens == len(tokens) // BLOCK * BLOCK and step.copies, step
    return step


async def test_a_late_in_place_writer_of_a_voided_epoch_is_refused(service, agent, tier, redis):
    view = PagedPool.attach(agent.handle())
    planned = await tier.plan("p", [new_request("zombie", ZOMBIE, len(ZOMBIE), BLOCK)])
    zombie, old = only(planned), planned.epoch
    await service.agent_lost("p", 0)  # "offline" about an agent that lives on, bytes and all
    new = await bumped(tier, old)
    fresh = await serve(tier, view, "fresh", FRESH)
    assert written_pages(fresh) & written_pages(zombie), "the new epoch reuses the page ids"
    with pytest.raises(StaleOrder):
        write(view, planned, zombie, ZOMBIE)  # the old epoch's forward pass, late
    assert agent.fence.epoch == new and view.fence.epoch() == new
    hit = await hit_on(tier, FRESH)
    assert wrong_bytes(view, hit, FRESH) == 0
    await tier.release("p", ["hit", "zombie"])
    await assert_no_pins(redis)


async def test_a_late_copy_batch_of_a_voided_epoch_is_refused(redis, redis_url, monkeypatch):
    """Replica `a` planned a restore in epoch N; replica `b` lost the agent's link (epoch N+1)
    and handed the same page ids to a new request before `a`'s batch reached the agent."""
    held, caught, original = asyncio.Event(), asyncio.Event(), AgentLink.copy
    armed, targets = False, set()

    async def copy(link: AgentLink, batch: CopyBatch) -> None:
        nonlocal armed
        if armed:
            armed = False
            targets.update(dst for _, dst, _, _ in batch.copies)
            caught.set()
            await held.wait()  # the batch is slow to leave `a`: a loaded host, a slow network
        await original(link, batch)

    monkeypatch.setattr(AgentLink, "copy", copy)
    async with running_service(redis_url) as a, running_service(redis_url) as b, \
            running_agent(a.url, b.url) as agent, \
            CacheTierClient(a.url, token=TOKEN) as tier_a, \
            CacheTierClient(b.url, token=TOKEN) as tier_b:
        view = PagedPool.attach(agent.handle())
        for tier in (tier_a, tier_b):  # the agent registers with each replica in turn
            await eventually(lambda: tier.stats("p"), lambda s: s.ranks == [0])
        await serve(tier_a, view, "doc", ZOMBIE)
        old = (await tier_a.stats("p")).epoch
        armed = True
        probe = ZOMBIE + [2]
        late = asyncio.create_task(tier_a.plan("p", [new_request("z", probe, len(probe), BLOCK)]))
        await asyncio.wait_for(caught.wait(), 10)
        await b.agent_lost("p", 0)
        await bumped(tier_b, old)
        # a request in flight holds the new epoch's first ids, so the next one's pages line up
        # with the late batch's targets (asserted below: the overlap is the hazard)
        spacer = DOC[200:210]
        await tier_b.plan("p", [new_request("spacer", spacer, len(spacer), BLOCK)])
        fresh = await serve(tier_b, view, "fresh", FRESH)
        held.set()
        with pytest.raises(RemoteError) as err:
            await late
        assert err.value.code == ErrorCode.COPY_FAILED and err.value.retryable
        assert "fenced" in str(err.value), err.value
        assert targets & written_pages(fresh), "the late batch aims at the new request's pages"
        hit = await hit_on(tier_b, FRESH)
        assert wrong_bytes(view, hit, FRESH) == 0
        await tier_b.release("p", ["hit", "spacer"])
        await assert_no_pins(redis)


async def test_a_fence_waits_for_the_writers_in_a_section_and_refuses_their_epoch_after():
    with PagedPool.create(TINY.model, TINY.cache) as pool:
        worker = PagedPool.attach(pool.handle())
        fence = OrderFence(lambda epoch: pool.fence.advance(epoch, 5))
        assert await fence.advance(3) == 3
        with worker.writing(3, 0, []):
            raising = asyncio.create_task(fence.advance(4))
            await asyncio.sleep(0.2)
            assert not raising.done() and fence.epoch == 3  # it waits for the section
        assert await asyncio.wait_for(raising, 5) == 4
        with pytest.raises(StaleOrder), worker.writing(3, 0, []):
            pytest.fail("a writer of a fenced-off epoch entered its section")
        with worker.writing(4, 0, []):
            pass


async def test_a_fence_waits_for_the_orders_running_and_refuses_older_ones_after():
    fence = OrderFence()
    order = fence.order(2)
    await order.__aenter__()
    raising = asyncio.create_task(fence.advance(3))
    await asyncio.sleep(0.05)
    assert not raising.done()
    await order.__aexit__(None, None, None)
    assert await asyncio.wait_for(raising, 5) == 3
    with pytest.raises(StaleOrder):
        async with fence.order(2):
            pass
    async with fence.order(4):  # an order of a newer epoch raises the fence first
        assert fence.epoch == 4
    assert await fence.advance(1) == 4  # never lowered


WAIT = 0.5  # the agent's fence_wait_s in the tests of writers that stay in their section
SPAWN = multiprocessing.get_context("spawn")


def hung_writer(handle: PoolHandle, plan: StepPlan, step: RequestPlan, tokens: list[int],
                entered: Any, resume: Any, told: Any) -> None:
    """A worker, in a process of its own, whose pass of `step` of `plan` hangs inside its
    section (after the fence check, before its bytes) until `resume`, then writes them; then it
    tries the pass again and tells how that went."""
    view = PagedPool.attach(handle)
    with writing(view, plan, step):
        entered.set()
        resume.wait(60)
        write_pages(view, step, tokens)
    try:
        write(view, plan, step, tokens)
        told.put("written")
    except StaleOrder as exc:
        told.put(f"refused: {exc}")


def brief_writer(handle: PoolHandle, epoch: int, page: int, entered: Any, leaving: Any) -> None:
    """A worker, in a process of its own, that stays 0.3 s in its section writing `page` and
    says it is leaving just before it does."""
    view = PagedPool.attach(handle)
    with view.writing(epoch, 0, []):  # no page checked: the epoch fence alone
        entered.set()
        time.sleep(0.3)
        view.buffer[:, page] = 0xA5
        leaving.set()


@contextlib.contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[BaseProcess]:
    """`target(*args)` in a spawned process: a lock holder and a mapping of its own. Ended at
    the end, whatever it was doing."""
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    try:
        yield process
    finally:
        process.kill()
        process.join()


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "gpu_pool.agent" and r.levelno == logging.WARNING
            and "held past" in r.getMessage()]


async def test_a_writer_hung_in_its_section_holds_a_bump_up_for_the_fence_wait_only(
        redis, redis_url, caplog):
    """The holder planned in epoch N hangs in its section; the pool is bumped and the next
    plan fences the agent: it is answered after about `WAIT`, not after the service's copy
    timeout (30 s here, as in the finding). The new epoch reuses the zombie's page ids; the
    holder's write, let go only then, reaches the old memory, none of the new epoch's bytes,
    and its next pass is refused."""
    async with running_service(redis_url, copy_timeout_s=30) as service, \
            running_agent(service.url, fence_wait_s=WAIT) as agent, \
            CacheTierClient(service.url, token=TOKEN, timeout=60) as tier:
        old_view = PagedPool.attach(agent.handle())
        planned = await tier.plan("p", [new_request("zombie", ZOMBIE, len(ZOMBIE), BLOCK)])
        zombie, old = only(planned), planned.epoch
        entered, resume, told = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
        with child(hung_writer, agent.handle(), planned, zombie, ZOMBIE, entered, resume,
                   told) as holder:
            assert await asyncio.to_thread(entered.wait, 60), "the writer never entered"
            await service.agent_lost("p", 0)
            await bumped(tier, old)
            begin = time.monotonic()
            plan = await tier.plan("p", [new_request("fresh", FRESH, len(FRESH), BLOCK)])
            took = time.monotonic() - begin
            assert WAIT <= took < 4 * WAIT, took  # it waited for the holder, boundedly
            [warning] = stall_warnings(caplog)
            assert f"pids [{holder.pid}]" in warning, warning
            view = PagedPool.attach(agent.handle())
            assert view.buffer.data_ptr() != old_view.buffer.data_ptr()
            fresh = await finish(tier, view, plan, "fresh", FRESH)
            assert written_pages(fresh) & written_pages(zombie), "the new epoch reuses the ids"
            resume.set()  # the holder wakes up and writes its pass's bytes
            told_how = await asyncio.to_thread(told.get, True, 60)
            assert told_how.startswith("refused") and "retired" in told_how, told_how
        assert holds_checkpoint(old_view, zombie, ZOMBIE), "the late write landed, in old memory"
        hit = await hit_on(tier, FRESH)
        assert wrong_bytes(view, hit, FRESH) == 0
        await tier.release("p", ["hit", "zombie"])
        await assert_no_pins(redis)


async def test_a_writer_leaving_within_the_fence_wait_is_waited_for_in_place(service, caplog):
    """The bound does not cut a writer short: one in its section for 0.3 s of a 20 s wait
    holds the raise until it leaves, its bytes stay in the pool, which keeps its memory."""
    async with running_agent(service.url, fence_wait_s=20) as agent:
        assert await agent.fence.advance(3) == 3
        handle = agent.handle()
        entered, leaving = SPAWN.Event(), SPAWN.Event()
        with child(brief_writer, handle, 3, 5, entered, leaving):
            assert await asyncio.to_thread(entered.wait, 60), "the writer never entered"
            assert await asyncio.wait_for(agent.fence.advance(4), 10) == 4
            assert leaving.is_set(), "the fence was raised with a writer in its section"
        assert agent.handle() == handle and not stall_warnings(caplog)  # the same memory
        view = PagedPool.attach(handle)
        assert (view.buffer[:, 5] == 0xA5).all() and view.fence.epoch() == 4
        with pytest.raises(StaleOrder, match="fenced at epoch 4"), view.writing(3, 0, []):
            pytest.fail("a writer of a fenced-off epoch entered its section")


REAP_FAST = ReaperSettings(every_s=0.05)
# a zombie's lease, reaped within the tests' wait; longer than a plan that waits the fence out
# (a plan outliving its own lease is reaped before its confirm)
LEASE_S = 1.0


def test_runs_are_the_sorted_consecutive_stretches():
    assert runs([7, 1, 2, 3, 9, 8, 2]) == [(1, 3), (7, 3)]
    assert runs([]) == []


def test_a_page_claimed_by_a_later_step_refuses_the_earlier_ones_writes():
    with PagedPool.create(TINY.model, TINY.cache) as pool:
        worker = PagedPool.attach(pool.handle())
        with pytest.raises(StaleOrder):  # never claimed: no step may write it
            with worker.writing(0, 5, [1]):
                pass
        pool.claims.claim(5, [1, 2, 3], 1.0)
        with worker.writing(0, 5, [1, 2, 3]):
            worker.buffer[:, 1] = 1
        pool.claims.claim(6, [2], 1.0)  # page 2 handed to step 6
        with pytest.raises(StaleOrder, match=r"pages \[2\]"), worker.writing(0, 5, [1, 2]):
            pytest.fail("a write of step 5 entered a section over a page of step 6")
        with worker.writing(0, 6, [2]), worker.writing(0, 5, [1, 3]):
            pass


def in_section(handle: PoolHandle, stamp: int, page: int, entered: Any, hold_s: float,
               claimed: Any, told: Any) -> None:
    """A worker that stays `hold_s` in its section over `page`, writes it, then tries again
    once told the page was claimed."""
    view = PagedPool.attach(handle)
    with view.writing(0, stamp, [page]):
        entered.set()
        time.sleep(hold_s)
        view.buffer[:, page] = 0x5A
    claimed.wait(60)
    try:
        with view.writing(0, stamp, [page]):
            told.put("written")
    except StaleOrder:
        told.put("refused")


def test_a_claim_waits_for_a_writer_in_the_page_and_its_next_write_is_refused():
    """The race where the release lands mid-write: the claim that hands the page on is granted
    once the writer left its section (its bytes come before the new owner's), and its next
    section over the page is refused."""
    with PagedPool.create(TINY.model, TINY.cache) as pool:
        pool.claims.claim(5, [4], 1.0)
        entered, claimed, told = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
        with child(in_section, pool.handle(), 5, 4, entered, 0.4, claimed, told):
            assert entered.wait(60), "the writer never entered"
            begin = time.monotonic()
            pool.claims.claim(6, [4, 5], 10.0)
            assert time.monotonic() - begin >= 0.2, "claimed with a writer in the page"
            assert (pool.buffer[:, 4] == 0x5A).all()  # its bytes landed before the claim
            claimed.set()
            assert told.get(timeout=30) == "refused"
        pool.claims.claim(7, [5], 1.0)  # other pages were never held


def test_a_claim_over_a_hung_writer_stalls_within_its_wait_and_claims_nothing():
    with PagedPool.create(TINY.model, TINY.cache) as pool:
        pool.claims.claim(5, [4], 1.0)
        entered, told = SPAWN.Event(), SPAWN.Queue()
        with child(in_section, pool.handle(), 5, 4, entered, 60.0, SPAWN.Event(), told):
            assert entered.wait(60), "the writer never entered"
            begin = time.monotonic()
            with pytest.raises(WriterStalled):
                pool.claims.claim(6, [3, 4], 0.3)
            assert time.monotonic() - begin < 5
            assert [pool.claims.stamp(p) for p in (3, 4)] == [0, 5]  # all or nothing


async def test_a_pass_that_outlived_its_lease_is_refused_on_the_pages_handed_on(redis,
                                                                                 redis_url):
    """The zombie's scheduler stalls past its lease: the reaper releases it and frees its pages,
    the next step hands them to `fresh` (same epoch), whose pass and commit complete; the
    zombie's late pass is then refused, and hits on `fresh`'s prefix read its bytes only."""
    async with running_service(redis_url, request_lease_s=LEASE_S, reaper=REAP_FAST) as service, \
            running_agent(service.url) as agent, \
            CacheTierClient(service.url, token=TOKEN, timeout=10) as tier:
        view = PagedPool.attach(agent.handle())
        planned = await tier.plan("p", [new_request("zombie", ZOMBIE, len(ZOMBIE), BLOCK)])
        zombie = only(planned)
        await eventually(lambda: tier.stats("p"), lambda s: s.requests == 0)  # reaped
        fresh_plan = await tier.plan("p", [new_request("fresh", FRESH, len(FRESH), BLOCK)])
        assert fresh_plan.epoch == planned.epoch, "the same epoch: the epoch fence is no help"
        fresh = only(fresh_plan)
        shared = set(zombie.written_pages(TINY.cache.page_tokens)) & \
            set(fresh.written_pages(TINY.cache.page_tokens))
        assert shared, "the next step reuses the reaped request's pages"
        await finish(tier, view, fresh_plan, "fresh", FRESH)
        with pytest.raises(StaleOrder, match="handed to another request"):
            write(view, planned, zombie, ZOMBIE)
        hit = await hit_on(tier, FRESH)
        assert wrong_bytes(view, hit, FRESH) == 0
        await tier.release("p", ["hit"])
        await assert_no_pins(redis)


def stalled_zombie(handle: PoolHandle, plan: Any, step: Any, tokens: list[int],
                   entered: Any) -> None:
    """The zombie's pass, hung inside its section over its pages."""
    view = PagedPool.attach(handle)
    with writing(view, plan, step):
        entered.set()
        time.sleep(120)
        write_pages(view, step, tokens)


async def test_a_hung_late_writer_costs_a_retryable_step_and_an_epoch_not_a_wrong_hit(
        redis, redis_url):
    """The zombie hangs in its section over pages the next step claims: the claim stalls past
    the agent's wait, the step is refused (retryable) and the pool starts a new epoch, which
    moves it to new memory away from the holder; planning again then succeeds."""
    async with running_service(redis_url, request_lease_s=LEASE_S, reaper=REAP_FAST) as service, \
            running_agent(service.url, fence_wait_s=0.3) as agent, \
            CacheTierClient(service.url, token=TOKEN, timeout=20) as tier:
        planned = await tier.plan("p", [new_request("zombie", ZOMBIE, len(ZOMBIE), BLOCK)])
        entered = SPAWN.Event()
        with child(stalled_zombie, agent.handle(), planned, only(planned), ZOMBIE, entered):
            assert await asyncio.to_thread(entered.wait, 60), "the zombie never entered"
            await eventually(lambda: tier.stats("p"), lambda s: s.requests == 0)  # reaped
            with pytest.raises(Exception) as refused:
                await tier.plan("p", [new_request("fresh", FRESH, len(FRESH), BLOCK)])
            assert getattr(refused.value, "retryable", False), refused.value
            assert (await tier.stats("p")).epoch > planned.epoch
            # the new epoch's fence moves the pool away from the holder, then the step runs
            again = await tier.plan("p", [new_request("fresh", FRESH, len(FRESH), BLOCK)])
            await finish(tier, PagedPool.attach(agent.handle()), again, "fresh", FRESH)
        await assert_no_pins(redis)
