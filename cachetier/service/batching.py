"""One script call for the plans (commits, confirms, releases) concurrent callers send one pool.

Under many clients a step's cost is mostly fixed (a script call, its reply, a copy batch per
rank, a confirm), so `PlanCoalescer` gathers the plans that arrive for a pool while one of its
steps is in flight, for at most `tick_s` (and at most `max_batch` requests), and runs them as one
step: one plan script, one copy batch per rank, one confirm. Each caller gets back only its own
requests' plans (and the merged step's one ticket, confirmed already); the step's evictions
(`evicted`, `removed`) go to its first caller only, so counted over callers they are counted
once. A plan that arrives for an idle pool is sent at once: a lone caller waits for nothing, and
a caller under load at most the tick. `CommitCoalescer`, `ConfirmCoalescer` and
`ReleaseCoalescer` do the same for commits (each caller keeps a ticket of its own), confirms
and releases.

A plan script is all-or-nothing, so one caller must not fail the others: when the merged step is
refused or the index rejects it (a bad or duplicate request, a continuing request of an old
epoch), every caller's plan is run again on its own, and each gets the answer it would have got
alone. A failure after the plan script (a copy, an agent, the confirm) failed the step for all:
its requests are released and every caller gets that retryable error, as it would alone.
Releases naming one rid in two callers, or a merged release that fails, run per caller too;
so do merged commits and confirms the index rejects.

A caller that goes away (cancelled) before its batch is sent is dropped from it; one that goes
away after has its requests released here once the step is planned, so nothing stays pinned.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from index.errors import CacheIndexError, StaleEpoch
from index.records import (CommitItem, CommitResult, ReleaseResult, StepPlan, StepRefusal,
                           StepRequest)
from index.store import unknown_ticket

logger = logging.getLogger("cachetier.service.batching")
Outcome = StepPlan | StepRefusal
PlanCall = Callable[[Sequence[StepRequest]], Awaitable[Outcome]]
ReleaseCall = Callable[[Sequence[str]], Awaitable[ReleaseResult]]
CommitCall = Callable[[Sequence[CommitItem]], Awaitable[CommitResult]]
GroupCommitCall = Callable[[Sequence[Sequence[CommitItem]]], Awaitable[list[CommitResult]]]
ConfirmCall = Callable[[Sequence[int]], Awaitable[int]]  # one ticket: its count
ManyConfirmCall = Callable[[Sequence[int]], Awaitable[list[int | None]]]
Item = TypeVar("Item")
Out = TypeVar("Out")
T = TypeVar("T")


@dataclass(eq=False)
class _Caller(Generic[Item, Out]):
    items: Sequence[Item]
    answer: asyncio.Future[Out]


class _Coalescer(abc.ABC, Generic[Item, Out]):
    """`await coalescer.submit(items)` is `run(items)`, shared with the calls of other callers
    that arrive within `tick_s` while a call is in flight; `_merged` says how to share one."""

    def __init__(self, run: Callable[[Sequence[Item]], Awaitable[Out]], tick_s: float,
                 max_batch: int) -> None:
        self._run = run
        self.tick_s = tick_s
        self.max_batch = max_batch
        self._pending: list[_Caller[Item, Out]] = []
        self._pending_items = 0
        self._timer: asyncio.TimerHandle | None = None
        self._steps: set[asyncio.Task[None]] = set()
        self._alone = 0  # calls in flight that were sent at once, on their own

    async def submit(self, items: Sequence[Item]) -> Out:
        if len(items) >= self.max_batch or not (self._steps or self._pending or self._alone):
            # a full batch, or a pool with no call in flight here: nothing to wait for
            self._alone += 1
            try:
                return await self._run(items)
            finally:
                self._alone -= 1
        if self._pending_items + len(items) > self.max_batch:
            self._send()
        caller: _Caller[Item, Out] = _Caller(items, asyncio.get_running_loop().create_future())
        self._pending.append(caller)
        self._pending_items += len(items)
        if self._pending_items >= self.max_batch:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._send)
        return await caller.answer  # cancelling the caller cancels its answer

    async def close(self) -> None:
        """Stop the calls in flight (a plan's requests are released) and fail what waits."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for caller in self._pending:
            caller.answer.cancel()
        self._pending, self._pending_items = [], 0
        for task in list(self._steps):
            task.cancel()
        await asyncio.gather(*self._steps, return_exceptions=True)

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        callers, self._pending, self._pending_items = self._pending, [], 0
        if callers:
            task = asyncio.create_task(self._step(callers))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)

    async def _step(self, callers: list[_Caller[Item, Out]]) -> None:
        try:
            live = [c for c in callers if not c.answer.done()]
            if len(live) == 1:
                await self._answer(live[0], self._run(live[0].items))
            elif live:
                await self._merged(live)
        finally:
            for caller in callers:  # this task was cancelled (`close()`)
                if not caller.answer.done():
                    caller.answer.cancel()

    @abc.abstractmethod
    async def _merged(self, callers: list[_Caller[Item, Out]]) -> None:
        """Run the callers' items as one call and give each its own share of the answer."""

    async def _shared(self, callers: list[_Caller[Item, Out]], call: Awaitable[T]) -> T | None:
        """The merged call's answer, or None once the callers are answered here: each alone
        when the index rejected the call (all-or-nothing, so it wrote nothing), or every caller
        the error it failed with otherwise, as each would have got it."""
        try:
            return await call
        except CacheIndexError:
            await self._each_alone(callers)
        except Exception as exc:
            for caller in callers:
                _settle(caller.answer, exc)
        return None

    async def _each_alone(self, callers: list[_Caller[Item, Out]]) -> None:
        await asyncio.gather(*(self._answer(c, self._run(c.items)) for c in callers))

    async def _answer(self, caller: _Caller[Item, Out], call: Awaitable[Out]) -> None:
        try:
            out = await call
        except Exception as exc:
            _settle(caller.answer, exc)
            return
        self._deliver(caller, out)

    def _deliver(self, caller: _Caller[Item, Out], out: Out) -> None:
        if not caller.answer.done():
            caller.answer.set_result(out)


class PlanCoalescer(_Coalescer[StepRequest, Outcome]):
    """Plans: `run` is the whole unbatched step (plan script, copies, confirm, release on
    failure); `release` ends requests whose caller left."""

    def __init__(self, run: PlanCall, release: ReleaseCall, tick_s: float,
                 max_batch: int) -> None:
        super().__init__(run, tick_s, max_batch)
        self._release = release
        self._abandoned: set[asyncio.Task[None]] = set()

    async def _merged(self, callers: list[_Caller[StepRequest, Outcome]]) -> None:
        # rejected, e.g. a rid twice across callers: nothing was pinned
        outcome = await self._shared(callers, self._run([r for c in callers for r in c.items]))
        if outcome is None:
            return
        if isinstance(outcome, StepRefusal):  # the merged step is too big for the pool
            await self._each_alone(callers)
            return
        by_rid = {r.rid: r for r in outcome.requests}
        for n, caller in enumerate(callers):
            self._deliver(caller, StepPlan(outcome.ticket, outcome.epoch,
                                           [by_rid[r.rid] for r in caller.items],
                                           outcome.evicted if n == 0 else 0,
                                           outcome.removed if n == 0 else []))

    def _deliver(self, caller: _Caller[StepRequest, Outcome], out: Outcome) -> None:
        if not caller.answer.done():
            super()._deliver(caller, out)
        elif isinstance(out, StepPlan):  # the caller left while its step ran
            task = asyncio.create_task(self._abandon(out))
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)

    async def close(self) -> None:
        await super().close()
        await asyncio.gather(*self._abandoned, return_exceptions=True)

    async def _abandon(self, plan: StepPlan) -> None:
        try:
            await self._release([r.rid for r in plan.requests])
        except StaleEpoch:
            pass  # invalidated meanwhile: the pins are void already
        except Exception:  # noqa: BLE001 - nobody waits for this answer: say it here
            logger.exception("releasing the requests of a caller that left failed")


class CommitCoalescer(_Coalescer[CommitItem, CommitResult]):
    """Commits: one commit script for every caller's items, each caller a group of its own
    (`PrefixIndex.commit_groups`: its own ticket, so confirming it settles its own writes only,
    and its own requests); `removed` goes to the first. A merged commit the index rejects (one
    caller's bad item refuses the whole call, which then wrote nothing) runs per caller, so each
    gets the answer it would have got alone."""

    def __init__(self, run: CommitCall, run_groups: GroupCommitCall, tick_s: float,
                 max_batch: int) -> None:
        super().__init__(run, tick_s, max_batch)
        self._run_groups = run_groups

    async def _merged(self, callers: list[_Caller[CommitItem, CommitResult]]) -> None:
        results = await self._shared(callers, self._run_groups([c.items for c in callers]))
        for caller, result in zip(callers, results or []):
            self._deliver(caller, result)


class ConfirmCoalescer(_Coalescer[int, int]):
    """Confirms (one ticket per caller): one confirm script for every caller's ticket, in order
    (`PrefixIndex.confirm_many`); a caller whose ticket is unknown gets `UnknownEntity`, as
    alone, and the others their counts. A merged call the index refuses runs per caller."""

    def __init__(self, run: ConfirmCall, run_many: ManyConfirmCall, tick_s: float,
                 max_batch: int) -> None:
        super().__init__(run, tick_s, max_batch)
        self._run_many = run_many

    async def _merged(self, callers: list[_Caller[int, int]]) -> None:
        # rejected, e.g. a stale epoch: each alone runs it again
        counts = await self._shared(callers, self._run_many([t for c in callers for t in c.items]))
        for caller, count in zip(callers, counts or []):
            if count is None:
                _settle(caller.answer, unknown_ticket(caller.items[0]))
            else:
                self._deliver(caller, count)


class ReleaseCoalescer(_Coalescer[str, ReleaseResult]):
    """Releases: one release script for the rids of every caller; each caller's `unknown` is its
    own rids the script did not know, its `released` the others; `removed` goes to the first."""

    async def _merged(self, callers: list[_Caller[str, ReleaseResult]]) -> None:
        rids = [rid for c in callers for rid in c.items]
        if len(set(rids)) < len(rids):  # who released it first would depend on the order
            await self._each_alone(callers)
            return
        try:
            result = await self._run(rids)
        except Exception:  # noqa: BLE001 - each caller alone gets its own answer, or error
            await self._each_alone(callers)
            return
        unknown = set(result.unknown)
        for n, caller in enumerate(callers):
            own = [rid for rid in caller.items if rid in unknown]
            self._deliver(caller, ReleaseResult(len(caller.items) - len(own), own,
                                                result.removed if n == 0 else []))


def _settle(answer: asyncio.Future[Out], exc: BaseException) -> None:
    if not answer.done():
        answer.set_exception(exc)
