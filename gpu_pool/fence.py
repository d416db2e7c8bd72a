"""The epoch fence of a pool's data path: no writer of a voided epoch touches a page after it.

An epoch bump makes every page id free again, and the next epoch hands them out anew; a copy or
a forward pass planned in the old epoch that writes late would land in another request's pages.
So every write names the epoch it was planned in, and the agent owning the pool keeps a fence
epoch that only grows: a write of an older epoch is refused, and raising the fence waits for
every write already under way. The service hands out a new epoch's pages only once every rank's
agent has raised its fence to that epoch (`cachetier.service.fleet.fence_links`), so nothing
planned before can write them.

Two kinds of writers, two halves:

- `OrderFence`: the agent's own orders (copy batches, fetches), in its event loop. An order runs
  under `order(epoch)`; `advance` refuses older orders from then on and waits for those running.
- `WriterFence`: workers that map the pool in place (`PagedPool.attach`) and write pages
  directly. The fence epoch is the 8 bytes of a small file beside the pool's bytes; a worker writes
  under a shared `flock` of it, after reading that the fence still is its plan's epoch, and the
  agent raises it under an exclusive lock, which the kernel grants only once every writer in a
  section has left it. A writer killed mid-section drops its lock with its last descriptor, so a
  dead worker never holds the fence. A section must not wait on the service (the fence would
  wait for it while the service waits for the fence): it holds only the byte writes.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import fcntl
import os
import struct
import weakref

from cachetier.errors import StaleOrder

_EPOCH = struct.Struct("<q")


class WriterFence:
    """One process's descriptor of a pool's fence file, 8 zero bytes to begin with (the pool
    handle's `fence` segment); each one opened is a lock holder of its own."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def epoch(self) -> int:
        return _EPOCH.unpack(os.pread(self._fd, _EPOCH.size, 0))[0]

    @contextlib.contextmanager
    def writing(self, epoch: int) -> collections.abc.Iterator[None]:
        """Write pages planned in `epoch`: `StaleOrder` if the pool's agent has fenced it off
        (or not fenced up to it yet: such a plan cannot come from the service)."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            fenced = self.epoch()
            if fenced != epoch:
                raise StaleOrder(f"a write planned in epoch {epoch}; the pool is fenced at "
                                 f"epoch {fenced}")
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def advance(self, epoch: int) -> None:
        """Blocking: raise the fence to `epoch` once no writer is in a section. Never lowers it."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if epoch > self.epoch():
                os.pwrite(self._fd, _EPOCH.pack(epoch), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._closer()


class OrderFence:
    """The agent's fence epoch and the orders running under it (see the module docstring).

    Raising the fence holds `_lock`, so no order starts meanwhile; it waits for the running ones
    (all of older epochs), then raises the writers' fence (`writers`, run off the event loop,
    since it waits for other processes). An order of a newer epoch than the fence raises it
    first, so an order never runs beside a writer of an older epoch either."""

    def __init__(self) -> None:
        self.epoch = 0
        self.writers: WriterFence | None = None  # set once the pool exists
        self._lock = asyncio.Lock()
        self._running = 0
        self._idle = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def order(self, epoch: int) -> collections.abc.AsyncIterator[None]:
        async with self._lock:
            if epoch < self.epoch:
                raise StaleOrder(f"an order of epoch {epoch}; this agent is fenced at epoch "
                                 f"{self.epoch}")
            if epoch > self.epoch:
                await self._raise(epoch)
            self._running += 1
        try:
            yield
        finally:
            async with self._idle:
                self._running -= 1
                self._idle.notify_all()

    async def advance(self, epoch: int) -> int:
        """Fence off every epoch before `epoch`; returns the fence epoch (maybe higher)."""
        async with self._lock:
            if epoch > self.epoch:
                await self._raise(epoch)
            return self.epoch

    async def _raise(self, epoch: int) -> None:
        """Under `_lock`. The epoch moves last: a raise cut short (its order cancelled) is done
        again in full by the next one."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._running == 0)
        if self.writers is not None:
            await asyncio.to_thread(self.writers.advance, epoch)
        self.epoch = epoch
