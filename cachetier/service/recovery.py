"""One replica's checks of a pool's storage, and the recovery of a pool whose storage went back
in time or forgot it (`index.identity` says how either is detected).

A pool is *verified* once this replica's view of it has been reconciled with the storage holding
it (`PrefixIndex.reconcile`): when the replica first uses it, at each registration, and again
after any Redis connection error (a restart or a failover may have happened behind it; the write
count then tells a clean restart, which changes nothing, from a lossy one). A call that finds the
pool behind its view, or gone, starts a *recovery*: the pool's steps in flight fail, every call
meanwhile is answered `PoolRecovering` (retryable) and `health` lists the pool, and the pool is
created again if it is gone and started over in a fresh epoch, from this replica's view and the
registrations of its agents (the geometry, the ranks), with no action of anyone. Redis being
down meanwhile only makes the recovery retry.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from cachetier.errors import PoolRecovering
from cachetier.service.fleet import PoolAgents
from cachetier.service.observer import ServiceObserver
from index.holder import storage_holder
from index.identity import PoolView, fresh_epoch
from index.redis_link import is_transient
from index.store import PrefixIndex

logger = logging.getLogger("cachetier.service.recovery")
RETRY_MIN_S, RETRY_MAX_S = 0.05, 1.0


@dataclass(eq=False)
class PoolRecovery:
    index: PrefixIndex
    agents: PoolAgents
    observer: ServiceObserver
    verified: bool = False
    task: asyncio.Task[None] | None = None
    _verifying: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def recovering(self) -> bool:
        return self.task is not None and not self.task.done()

    async def ready(self) -> None:
        """Before a call: `PoolRecovering` while a recovery runs; a pool not verified since
        this replica last lost Redis is reconciled first."""
        if self.recovering:
            raise PoolRecovering(f"pool {self.agents.pool}: its storage is being recovered")
        if not self.verified:
            async with self._verifying:
                if not self.verified:
                    await self.reconcile()

    async def reconcile(self, also_seen: PoolView = PoolView()) -> str:
        """Reconcile the pool (which must exist) with this replica's view and `also_seen` (an
        agent's registration); returns why it started over, "" if it did not."""
        seen = self.index.view.merge(also_seen)
        holder = await storage_holder(self.index.redis, self.index.keys[0])
        why = await self.index.reconcile(seen, holder, fresh_epoch(seen))
        self.verified = True
        if why:
            logger.warning("pool %s: storage %s: started over in epoch %d", self.agents.pool,
                           why, self.index.epoch)
            self.agents.fail_steps(PoolRecovering(f"pool {self.agents.pool}: {why}"))
            self.observer.invalidated(self.agents.pool, self.index.epoch)
        return why

    def start(self, cause: BaseException) -> PoolRecovering:
        """Recover in the background (once at a time); returns the error to answer with."""
        if not self.recovering:
            logger.warning("pool %s: %s; recovering", self.agents.pool, cause)
            self.agents.fail_steps(PoolRecovering(f"pool {self.agents.pool}: {cause}"))
            self.task = asyncio.create_task(self._recover())
        return PoolRecovering(f"pool {self.agents.pool}: recovering its storage ({cause})")

    async def _recover(self) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                seen = self.index.view
                await self.index.create()  # again, if the storage lost it
                await self.reconcile(seen)
                return
            except (RedisError, OSError) as exc:
                if isinstance(exc, RedisError) and not is_transient(exc):
                    raise
                logger.info("pool %s: recovery waits for Redis: %s", self.agents.pool, exc)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
