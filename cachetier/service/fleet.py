"""One replica's view of a pool's agents: who serves each rank, and which steps wait on them.

This is connection state, not metadata: it is rebuilt from registrations whenever a service
starts, and losing it loses nothing (Redis holds the pool). It exists so that a lost agent fails
exactly the steps of its pool that are in flight here (`StepGuard`), and so that a copy batch
reaches every tensor-parallel rank before the plan is confirmed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from cachetier.errors import (AgentLost, AgentUnavailable, CacheTierError, ConnectionLost,
                              CopyFailed, CopyTimeout, ErrorCode, RemoteError, WriterStalled)
from cachetier.wire.channel import Channel
from cachetier.wire.protocol import AgentIdentity, CopyBatch, Fence
from index.records import StepPlan
from index.tickets import write_stamp


@dataclass(eq=False)
class AgentLink:
    """A registered agent's connection as the service sees it: copy batches out, acks back."""

    identity: AgentIdentity
    channel: Channel
    data_url: str = ""  # where peers pull this rank's pages
    loss: asyncio.Task[None] | None = None  # the service's handling of this link's loss, once
    fenced: int = 0  # the agent has fenced off every epoch before this one (`gpu_pool.fence`)

    @property
    def rank(self) -> int:
        return self.identity.rank

    async def copy(self, batch: CopyBatch) -> None:
        await self.channel.request(batch)

    async def fence(self, epoch: int) -> None:
        self.fenced = max(self.fenced, await self.channel.request(Fence(epoch)))


async def fence_links(links: list[AgentLink], epoch: int, timeout: float) -> None:
    """Every rank has fenced off the epochs before `epoch`: no copy or write planned in one of
    them runs any more, so the pages `epoch` hands out are its own. A link that acknowledged
    it once is not asked again; the errors are `run_copies`'."""
    late = [link for link in links if link.fenced < epoch]
    if late:
        await _on_every_rank(late, lambda link: link.fence(epoch), timeout, "a fence")


def step_order(plan: StepPlan, page_tokens: int, writes: int = 0) -> CopyBatch | None:
    """What every rank runs before a step's plan is answered: its copies, and the claims of the
    pages its requests write, for the step's stamp (`gpu_pool.claims`: a late writer of a request
    that is over, to which some of them belonged, is refused from then on). None: neither."""
    rows = [(c.src, c.dst, c.offset, c.nbytes) for r in plan.requests for c in r.copies]
    claims = sorted({page for r in plan.requests for page in r.written_pages(page_tokens)})
    if not rows and not claims:
        return None
    return CopyBatch(plan.epoch, rows, writes, claims, write_stamp(plan.ticket))


async def run_copies(links: list[AgentLink], batch: CopyBatch, timeout: float) -> None:
    """Run `batch` on every rank and wait for all acks. `CopyTimeout` and `AgentLost` name the
    ranks that missed the deadline or dropped; `CopyFailed` is an agent refusing the batch."""
    await _on_every_rank(links, lambda link: link.copy(batch), timeout, "a copy batch")


async def _on_every_rank(links: list[AgentLink], send: Callable[[AgentLink], Awaitable[None]],
                         timeout: float, what: str) -> None:
    tasks = [asyncio.create_task(send(link)) for link in links]
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*tasks)
    except TimeoutError:
        late = [link.rank for link, task in zip(links, tasks, strict=True) if task.cancelled()]
        raise CopyTimeout(f"ranks {late} did not ack {what} within {timeout:g} s",
                          late) from None
    except ConnectionLost as exc:
        dropped = [link.rank for link, task in zip(links, tasks, strict=True) if _dropped(task)]
        raise AgentLost(f"ranks {dropped} dropped during {what}: {exc}", dropped) from exc
    except RemoteError as exc:
        if exc.code == ErrorCode.WRITER_STALLED:
            raise WriterStalled(f"an agent could not run {what}: {exc}") from exc
        raise CopyFailed(f"an agent refused {what}: {exc}") from exc
    finally:
        for task in tasks:
            task.cancel()


def _dropped(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and isinstance(task.exception(), ConnectionLost)


@dataclass(eq=False)
class StepGuard:
    """One step in flight on a pool; a lost agent marks it so it stops at its next check."""

    failure: CacheTierError | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure


@dataclass
class PoolAgents:
    pool: str
    tp_degree: int
    links: dict[int, AgentLink] = field(default_factory=dict)
    steps: set[StepGuard] = field(default_factory=set)
    # agent processes this replica stopped using: a later report of their death is old news
    gone: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=256))

    def ready_links(self) -> list[AgentLink]:
        """Every rank's link; `AgentUnavailable` if a rank has none (a plan could not copy)."""
        missing = [r for r in range(self.tp_degree) if r not in self.links]
        if missing:
            raise AgentUnavailable(f"pool {self.pool}: no agent registered here for ranks "
                                   f"{missing}")
        return [self.links[r] for r in range(self.tp_degree)]

    def attach(self, link: AgentLink) -> None:
        self.links[link.rank] = link
        with contextlib.suppress(ValueError):  # a process that came back is not gone any more
            self.gone.remove(link.identity.agent_id)

    def detach(self, link: AgentLink) -> bool:
        """Remove `link` if it still serves its rank; False when it was already replaced."""
        if self.links.get(link.rank) is not link:
            return False
        del self.links[link.rank]
        self.gone.append(link.identity.agent_id)
        return True

    @contextlib.contextmanager
    def step(self) -> Iterator[StepGuard]:
        guard = StepGuard()
        self.steps.add(guard)
        try:
            yield guard
        finally:
            self.steps.discard(guard)

    def fail_steps(self, failure: CacheTierError) -> None:
        for guard in self.steps:
            guard.failure = guard.failure or failure
