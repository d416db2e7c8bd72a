"""Storage identity: what a caller has seen of a pool, so that storage going back in time is
caught on the caller's next call instead of serving metadata about bytes that have moved on.

Redis can lose acknowledged writes while the pool's epoch stays the same: a restart from an older
RDB or AOF, a failover to a replica that lagged, a restored backup, or a restart with no
persistence at all. The pool's bytes (on the agents) have moved on meanwhile, so every entry the
older metadata holds may name pages written since by someone else. Three numbers only ever grow
in an honest history of a pool, and a caller keeps the highest of each it was answered with
(`PoolView`): the epoch, the write count `meta.wc` (every write script counts itself in it, and
every reply returns it) and the ticket counter. Every call sends the epoch and the write count
(`"epoch:writes"`, lib.lua `check_view`); a pool below either refuses with `CT_ROLLBACK` before
it writes anything (`StorageRollback`), and a pool the caller has seen that is not there any more
is `StorageLost`. The service then starts the pool over (`reconcile_pool.lua`) in an epoch drawn
above every epoch it and its agents have seen and above the wall clock in milliseconds
(`fresh_epoch`), with its write count and ticket counter above the view: nothing issued before is
ever issued again, so no old epoch, ticket or page id can become valid again.

A run id alone cannot tell a clean restart (an AOF fsynced on every write loses nothing) from a
rollback: both change it. So the write count decides, and the holder (the run id or cluster node
id `reconcile_pool` stamps in `meta.holder`) serves when no write count can: a caller that has
seen no write of the pool (a service just started) finding it held by another instance than the
last one vouched for cannot tell whether writes were lost, and starts it over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolView:
    """The highest epoch, write count and ticket a caller has been answered with by one pool."""

    epoch: int = 0
    writes: int = 0
    ticket: int = 0

    def merge(self, other: PoolView) -> PoolView:
        """What either has seen: each number's highest."""
        return PoolView(max(self.epoch, other.epoch), max(self.writes, other.writes),
                        max(self.ticket, other.ticket))

    @property
    def argument(self) -> str:
        """The view as every script's ARGV[1]."""
        return f"{self.epoch}:{self.writes}"


def fresh_epoch(seen: PoolView, now_s: float | None = None) -> int:
    """An epoch to start a pool over in: above every epoch seen, and a jump to the wall clock in
    milliseconds, so that even a pool whose every witness is gone (its service and agents
    restarted with it) never gets an epoch that an earlier life of it issued, as long as that
    life bumped its epoch less than once a millisecond on average."""
    now = time.time() if now_s is None else now_s
    return max(seen.epoch + 1, int(now * 1000))
