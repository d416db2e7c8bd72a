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
  directly. The fence epoch is the first 8 bytes of a small file beside the pool's bytes (the
  9th says the file was retired, below); a worker writes
  under a shared `flock` of it, after reading that the fence still is its plan's epoch, and the
  agent raises it under an exclusive lock, which the kernel grants only once every writer in a
  section has left it. A writer killed mid-section drops its lock with its last descriptor, so a
  dead worker never holds the fence. A section must not wait on the service (the fence would
  wait for it while the service waits for the fence): it holds only the byte writes.

A writer that does not leave (hung, or any process that took a shared lock of the file) must not
stop the pool, so the exclusive lock is waited for a bounded time only (`WriterFence.advance`).
Past it, the agent cannot know what the holder does: it may be between its check and its last
byte, and no process can revoke another's mapping (of host memory or of a CUDA IPC buffer). So
the new epoch does not start in that memory: the agent moves the pool to new memory (new data,
tag and fence segments, its next handle; `gpu_pool.agent.Agent`), retires the old fence file
(`retire`: its retired byte set, so every later section on it is refused and its writer learns
to attach the new handle), and drops its own mapping of the old
bytes. The holder's late bytes land in the old segment, which nothing serves from again: it stays
alive while the holder maps it and is never handed out (its name is unlinked; torch keeps a CUDA
buffer exported over IPC until every consumer let it go). Replacing the fence file alone would
not do: the late bytes would reach the pages the new epoch hands out. The new epoch's bytes start
zeroed, which loses nothing, since a bump voids every page of the old epoch; what it costs is a
second pool's memory until the holder lets the old one go.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import fcntl
import os
import struct
import time
import weakref

from cachetier.errors import StaleOrder

_FENCE = struct.Struct("<q?")  # the fence epoch, then whether the file was retired
FENCE_BYTES = _FENCE.size
_EPOCH = struct.Struct("<q")
_RETIRED_AT = _EPOCH.size
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.001, 0.02  # between tries of the exclusive lock


class WriterFence:
    """One process's descriptor of a pool's fence file, `FENCE_BYTES` zero bytes to begin with
    (the pool handle's `fence` segment); each one opened is a lock holder of its own."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def epoch(self) -> int:
        return _EPOCH.unpack(os.pread(self._fd, _EPOCH.size, 0))[0]

    @contextlib.contextmanager
    def writing(self, epoch: int) -> collections.abc.Iterator[None]:
        """Write pages planned in `epoch`: `StaleOrder` if the pool's agent has fenced it off
        (or not fenced up to it yet: such a plan cannot come from the service), or has moved
        the pool to new memory since this file was mapped (`retire`)."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            fenced, retired = _FENCE.unpack(os.pread(self._fd, _FENCE.size, 0))
            if retired:
                raise StaleOrder(f"a write planned in epoch {epoch}; this mapping of the pool "
                                 "was retired (its fence was held past the agent's wait): "
                                 "attach the agent's current handle")
            if fenced != epoch:
                raise StaleOrder(f"a write planned in epoch {epoch}; the pool is fenced at "
                                 f"epoch {fenced}")
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def advance(self, epoch: int, wait_s: float) -> bool:
        """Blocking: raise the fence to `epoch` once no writer is in a section, and True; False,
        the fence unchanged, when one still is after `wait_s` (the agent then moves the pool to
        new memory, see the module docstring). Never lowers it."""
        if not self._lock_exclusive(wait_s):
            return False
        try:
            if epoch > self.epoch():
                os.pwrite(self._fd, _EPOCH.pack(epoch), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def retire(self) -> None:
        """Refuse every section from now on. Written without the lock, which a holder keeps,
        and in a byte of its own, so a writer's read of the fence sees it set or not, and the
        epoch beside it whole: one that read it unset (it was already in its section, or reads
        as this is written) holds an epoch before the new one and writes on, into memory the
        agent no longer serves from."""
        os.pwrite(self._fd, b"\x01", _RETIRED_AT)

    def holders(self) -> list[int]:
        """The pids holding a lock of this file now (/proc/locks), to name a stall's culprit;
        empty when none is seen."""
        st = os.fstat(self._fd)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        try:
            with open("/proc/locks") as locks:
                rows = [line.split() for line in locks]
        except OSError:
            return []
        return sorted({int(row[4]) for row in rows
                       if len(row) > 5 and row[1] == "FLOCK" and row[5] == inode})

    def close(self) -> None:
        self._closer()

    def _lock_exclusive(self, wait_s: float) -> bool:
        """Try the exclusive lock until `wait_s` has passed: a blocking `flock` could not be
        given up. The pause between tries doubles up to 20 ms, which is what a writer leaving
        its section may add to a raise."""
        deadline = time.monotonic() + wait_s
        pause = _FIRST_PAUSE_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(pause, left))
                pause = min(2 * pause, _LONGEST_PAUSE_S)


class OrderFence:
    """The agent's fence epoch and the orders running under it (see the module docstring).

    Raising the fence holds `_lock`, so no order starts meanwhile; it waits for the running ones
    (all of older epochs), then fences the in-place writers: `writers(epoch)`, blocking (it
    waits for other processes, so it runs off the event loop), the agent's. An order of a newer
    epoch than the fence raises it first, so an order never runs beside a writer of an older
    epoch either."""

    def __init__(self, writers: collections.abc.Callable[[int], None] | None = None) -> None:
        self.epoch = 0
        self.writers = writers
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
        again in full by the next one, and never beside the writers' fencing of the one cut
        short, which is waited for (it is bounded: `WriterFence.advance`), since it may be
        moving the pool to new memory."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._running == 0)
        if self.writers is not None:
            await to_the_end(asyncio.to_thread(self.writers, epoch))
        self.epoch = epoch


async def to_the_end(work: collections.abc.Awaitable[None]) -> None:
    """Await `work`, and if cancelled, still wait for it before leaving: a thread cannot be
    stopped, and what it does (a copy's bytes, a raise of the writers' fence) must be over
    before the next order or raise may start."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
