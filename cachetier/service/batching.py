"""One plan script call for the plans that concurrent callers send one pool within a short tick.

Under many clients a step's cost is mostly fixed (a script call, its reply, a copy batch per
rank, a confirm), so `PlanCoalescer` gathers the plans that arrive for a pool while one of its
steps is in flight, for at most `tick_s` (and at most `max_batch` requests), and runs them as one
step: one plan script, one copy
batch per rank, one confirm. Each caller gets back only its own requests' plans (and the merged
step's one ticket, confirmed already); the step's evictions (`evicted`, `removed`) go to its first
caller only, so counted over callers they are counted once. A plan that arrives for an idle
pool is sent at once: a lone caller waits for nothing, and a caller under load at most the tick.

A plan script is all-or-nothing, so one caller must not fail the others: when the merged step is
refused or the index rejects it (a bad or duplicate request, a continuing request of an old
epoch), every caller's plan is run again on its own, and each gets the answer it would have got
alone. A failure after the plan script (a copy, an agent, the confirm) failed the step for all:
its requests are released and every caller gets that retryable error, as it would alone.

A caller that goes away (cancelled) before its batch is sent is dropped from it; one that goes
away after has its requests released here once the step is planned, so nothing stays pinned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from index.errors import CacheIndexError, StaleEpoch

logger = logging.getLogger("cachetier.service.batching")
from index.records import StepPlan, StepRefusal, StepRequest

Outcome = StepPlan | StepRefusal
PlanCall = Callable[[Sequence[StepRequest]], Awaitable[Outcome]]
ReleaseCall = Callable[[Sequence[str]], Awaitable[object]]


@dataclass(eq=False)
class _Caller:
    requests: Sequence[StepRequest]
    answer: asyncio.Future[Outcome]


class PlanCoalescer:
    """`await coalescer.plan(requests)` is `run(requests)`, shared with the plans of other callers
    that arrive within `tick_s`. `run` is the whole unbatched step (plan script, copies, confirm,
    release on failure); `release` ends requests whose caller left."""

    def __init__(self, run: PlanCall, release: ReleaseCall, tick_s: float,
                 max_batch: int) -> None:
        self._run = run
        self._release = release
        self.tick_s = tick_s
        self.max_batch = max_batch
        self._pending: list[_Caller] = []
        self._pending_requests = 0
        self._timer: asyncio.TimerHandle | None = None
        self._steps: set[asyncio.Task[None]] = set()
        self._alone = 0  # steps in flight that were sent at once, on their own

    async def plan(self, requests: Sequence[StepRequest]) -> Outcome:
        if len(requests) >= self.max_batch or not (self._steps or self._pending or self._alone):
            # a full step, or a pool with no step in flight here: nothing to wait for
            self._alone += 1
            try:
                return await self._run(requests)
            finally:
                self._alone -= 1
        if self._pending_requests + len(requests) > self.max_batch:
            self._send()
        caller = _Caller(requests, asyncio.get_running_loop().create_future())
        self._pending.append(caller)
        self._pending_requests += len(requests)
        if self._pending_requests >= self.max_batch:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._send)
        return await caller.answer  # cancelling the caller cancels its answer

    async def close(self) -> None:
        """Stop the steps in flight (their requests are released) and fail what waits."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for caller in self._pending:
            caller.answer.cancel()
        self._pending, self._pending_requests = [], 0
        for task in list(self._steps):
            task.cancel()
        await asyncio.gather(*self._steps, return_exceptions=True)

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        callers, self._pending, self._pending_requests = self._pending, [], 0
        if callers:
            task = asyncio.create_task(self._step(callers))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)

    async def _step(self, callers: list[_Caller]) -> None:
        try:
            live = [c for c in callers if not c.answer.done()]
            if len(live) == 1:
                await self._answer(live[0], self._run(live[0].requests))
            elif live:
                await self._merged(live)
        finally:
            for caller in callers:  # this task was cancelled (`close()`)
                if not caller.answer.done():
                    caller.answer.cancel()

    async def _merged(self, callers: list[_Caller]) -> None:
        outcome: Outcome | None
        try:
            outcome = await self._run([r for c in callers for r in c.requests])
        except CacheIndexError:  # e.g. a rid twice across callers; nothing was pinned
            outcome = None
        except Exception as exc:
            for caller in callers:
                _settle(caller.answer, exc)
            return
        if not isinstance(outcome, StepPlan):
            await asyncio.gather(*(self._answer(c, self._run(c.requests)) for c in callers))
            return
        by_rid = {r.rid: r for r in outcome.requests}
        for n, caller in enumerate(callers):
            own = StepPlan(outcome.ticket, outcome.epoch, [by_rid[r.rid] for r in caller.requests],
                           outcome.evicted if n == 0 else 0, outcome.removed if n == 0 else [])
            if caller.answer.done():  # the caller left while its step ran
                await self._abandon(own)
            else:
                caller.answer.set_result(own)

    async def _answer(self, caller: _Caller, step: Awaitable[Outcome]) -> None:
        try:
            outcome = await step
        except Exception as exc:
            _settle(caller.answer, exc)
            return
        if caller.answer.done():
            if isinstance(outcome, StepPlan):
                await self._abandon(outcome)
        else:
            caller.answer.set_result(outcome)

    async def _abandon(self, plan: StepPlan) -> None:
        try:
            await self._release([r.rid for r in plan.requests])
        except StaleEpoch:
            pass  # invalidated meanwhile: the pins are void already
        except Exception:  # noqa: BLE001 - nobody waits for this answer: say it here
            logger.exception("releasing the requests of a caller that left failed")


def _settle(answer: asyncio.Future[Outcome], exc: BaseException) -> None:
    if not answer.done():
        answer.set_exception(exc)
