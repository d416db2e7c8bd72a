"""The request lifecycle, written once: plan -> copies -> confirm -> forward -> commit -> confirm ->
release, over any `index.face.Index` (`PrefixIndex`, `ReferenceIndex`, a pool of the service).

Callers differ only in who runs a plan's copies, which is why that part is a hook (`settle`):

- through the service (`CacheTierClient.pool`), `plan` already ran the copies on every rank and
  confirmed the plan: no hook;
- in the service, the hook is the copies on every rank's agent, then the confirm of the plan's
  ticket;
- with no agent (replay), no hook either: the plan's ticket is never confirmed on its own, since
  `commit` drops the restore pins and confirmation is cumulative per request, so the commit's
  confirm settles both (one script fewer per step).

What it adds to the bare calls is the guarantee that nothing a failure interrupts is left pinned:
a hook that raises releases the step's requests, and `async with RequestLifecycle(index) as
steps:` releases every request planned in the block that is still held when it ends, however it
ends. A plan whose outcome the caller cannot know (its reply lost with the connection, timed out,
cancelled, or not acknowledged by a replica) may have run: its requests are released too, so the
caller (the service's, which answers a retryable error) can plan them again at once; without
that, a plan that did run would hold them, and planning them again would be refused as a
continuation of a step never committed. An invalidated pool answers those releases with
`StaleEpoch`, which is swallowed: the pins are void already. Each method is the same script
calls, in the same order, with the same arguments, that the callers made by hand, so no figure
depends on going through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from index.errors import StaleEpoch
from index.face import Index
from index.redis_link import WriteNotAcknowledged
from index.records import (CommitItem, CommitResult, ReleaseResult, StepPlan, StepRefusal,
                           StepRequest)

Settle = Callable[[StepPlan], Awaitable[object]]

# A call that raised one of these may have run: Redis's or the service's connection lost
# mid-call, a reply that timed out, a write no replica acknowledged (`redis_link`), and the
# client's `ConnectionLost` and `RequestTimeout` (built-in ConnectionError and TimeoutError).
MAYBE_RAN = (RedisConnectionError, RedisTimeoutError, WriteNotAcknowledged, ConnectionError,
             TimeoutError)


class RequestLifecycle:
    """One caller's requests on one `Index`: plans steps, finishes forward passes, releases.

    `settle(plan)` runs right after a plan succeeds, before its forward pass: the copies of its
    copy list and the confirm of its ticket, where the caller's agents run them."""

    def __init__(self, index: Index, settle: Settle | None = None) -> None:
        self.index = index
        self.settle = settle
        self._held: dict[str, None] = {}  # planned and not released, in planning order

    async def plan(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        """Plan one step, then settle it; a refusal changed nothing and is returned as is. If
        settling fails, or the plan may have run without its caller knowing the plan (see the
        module docstring), the step's requests are released before the error propagates."""
        try:
            outcome = await self.index.plan_step(requests)
        except (*MAYBE_RAN, asyncio.CancelledError):  # planned, maybe: not acted on
            await self._release_quietly([r.rid for r in requests], storage_down_too=True)
            raise
        if isinstance(outcome, StepRefusal):
            return outcome
        rids = [r.rid for r in requests]  # a plan covers its whole batch
        self._held.update(dict.fromkeys(rids))
        if self.settle is not None:
            try:
                await self.settle(outcome)
            except BaseException:
                await self._release_quietly(rids)
                raise
        return outcome

    async def finish(self, items: Sequence[CommitItem]) -> CommitResult:
        """After a forward pass: commit what it computed, then confirm the commit's ticket (the
        bytes are written once the pass returns)."""
        committed = await self.index.commit(items)
        await self.index.confirm(committed.ticket)
        return committed

    async def release(self, rids: Sequence[str]) -> ReleaseResult:
        result = await self.index.release(rids)
        for rid in rids:
            self._held.pop(rid, None)
        return result

    async def __aenter__(self) -> RequestLifecycle:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._held:
            await self._release_quietly(list(self._held))

    async def _release_quietly(self, rids: list[str], storage_down_too: bool = False) -> None:
        """Release `rids` on the way out of a failure, which is the error the caller sees: an
        invalidated pool's `StaleEpoch` is swallowed (the pins are void already) and, with
        `storage_down_too`, so is the release's own loss (the storage that lost the plan may be
        down yet: the requests' leases end them, or the caller releases them)."""
        quiet = (StaleEpoch, *MAYBE_RAN) if storage_down_too else (StaleEpoch,)
        with contextlib.suppress(*quiet):
            await self.release(rids)
        for rid in rids:  # a stale release still ends them here
            self._held.pop(rid, None)
