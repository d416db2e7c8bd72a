"""Request leases: what a scheduler that disappeared left in a pool is released after its lease.

Every request a service plans (and every reader it pins) holds a lease, renewed by each of its
steps (`index.store.PrefixIndex`, `lease_s`): a scheduler killed between plan and release, or
whose release was lost, stops renewing it. The reaper releases the requests whose lease ran
out, as `release` would (pins, private pages, unconfirmed registrations, tickets), through the
release script's bounded form: at most `batch` requests per call, earliest deadline first, and
at most `calls` calls per pool per round, so a backlog drains over rounds without any call
walking the keyspace. Every replica reaps the pools it knows; two reaping one pool is harmless
(each call is atomic, and a request is released once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from index.errors import CacheIndexError, StaleEpoch
from index.records import ReleaseResult
from index.store import PrefixIndex

logger = logging.getLogger("cachetier.service.reaper")


@dataclass(frozen=True)
class ReaperSettings:
    every_s: float = 1.0  # between rounds
    batch: int = 100      # requests per call
    calls: int = 10       # calls per pool per round


async def reap_pool(index: PrefixIndex, settings: ReaperSettings) -> list[ReleaseResult]:
    """One round on one pool: calls until one releases less than a full batch, `calls` at most."""
    results = []
    for _ in range(settings.calls):
        try:
            result = await index.reap(settings.batch)
        except StaleEpoch:  # another replica started an epoch: its requests are void anyway
            result = await index.reap(settings.batch)
        results.append(result)
        if result.released < settings.batch:
            break
    return results


async def run_reaper(pools: Callable[[], Iterable[tuple[str, PrefixIndex]]],
                     reaped: Callable[[str, ReleaseResult], None],
                     settings: ReaperSettings) -> None:
    """Reap every pool `pools()` names, a round every `every_s`, until cancelled; `reaped` hears
    each call that released something. A pool whose round fails (Redis away, the pool gone) is
    tried again next round."""
    while True:
        await asyncio.sleep(settings.every_s)
        for name, index in list(pools()):
            try:
                for result in await reap_pool(index, settings):
                    if result.released:
                        logger.info("pool %s: %d requests released after their lease", name,
                                    result.released)
                        reaped(name, result)
            except (CacheIndexError, RedisConnectionError, RedisTimeoutError) as exc:
                logger.info("pool %s: lease reaper: %s", name, exc)
