"""Storage that goes back in time or forgets (issue 14): a redis-server restarted from an older
snapshot (a rollback, as after a restore or a failover to a lagging replica) and one restarted
empty (no persistence). Each is detected on the service's next call and answered in a fresh epoch,
never issued before, by the service alone: 0 wrong hits (bytes checked), epochs that only go up,
nothing left pinned, and `stats` and `health` telling the truth meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from cachetier.client import CacheTierClient
from cachetier.errors import ErrorCode, RemoteError
from index.hashing import chain_hashes
from index.store import PrefixIndex
from tests.cluster_harness import BLOCK, PAGE, TINY, TOKEN, running_agent, running_service
from tests.index_harness import ROOT, new_request
from tests.storage_harness import (DurableRedis, Worker, assert_nothing_held,
                                   strictly_increasing_epochs)

POOL = "p"
SMALL = dataclasses.replace(TINY, cache=dataclasses.replace(TINY.cache, num_pages=32))
DOCS = [[100 * (d + 1) + (7 * i + d) % 89 for i in range(150)] for d in range(12)]


@pytest.fixture
async def durable(tmp_path):
    server = DurableRedis(tmp_path / "redis-data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def cached_depth(tier: CacheTierClient, tokens: list[int]) -> int:
    """What the pool would serve of `tokens` now (a read-only probe)."""
    (probe,) = await tier.route([POOL], len(tokens), chain_hashes(tokens, ROOT, BLOCK))
    return probe.hit_tokens


async def first_error(call: Callable[[], Awaitable[object]]) -> RemoteError:
    """The error `call()` answers with once Redis answers again (the service's connections to
    the killed server may fail first, retryably)."""
    while True:
        try:
            await call()
        except RemoteError as exc:
            if exc.code != ErrorCode.REDIS_UNAVAILABLE:
                return exc
        else:
            raise AssertionError("the call succeeded")


async def test_a_rollback_to_an_older_snapshot_is_detected_and_never_serves_wrong_bytes(
        durable):
    async with (running_service(durable.url, config=SMALL) as service,
                running_agent(service.url) as agent,
                CacheTierClient(service.url, token=TOKEN, timeout=10) as tier):
        worker = Worker(tier, agent.pool, POOL, BLOCK, PAGE)
        await worker.serve("a1", DOCS[0])
        assert (await worker.serve("a2", DOCS[0] + [1])).hit_tokens == 144
        held = await worker.plan("held", DOCS[0] + [2])  # pinned when the snapshot is taken
        assert held.hit_tokens == 144
        async with Redis.from_url(durable.url) as redis:
            snapshot = await durable.snapshot(redis, "older")
        await worker.release("held")
        for d, doc in enumerate(DOCS[1:], 1):  # A's pages are evicted and written again
            await worker.serve(f"d{d}", doc)
        assert await cached_depth(tier, DOCS[0]) == 0
        before = max(worker.epochs)

        durable.restart(snapshot)  # the snapshot still says A is cached, on those pages

        hits = worker.hits
        for d, doc in enumerate(DOCS):  # each twice: the second time a hit, its bytes checked
            await worker.serve(f"after-{d}", doc + [3])
            await worker.serve(f"again-{d}", doc + [4])
        assert worker.wrong == [], worker.wrong
        assert worker.hits >= hits + len(DOCS), worker
        epochs = strictly_increasing_epochs(worker.epochs)
        assert epochs == sorted(set(epochs)) and len(epochs) == 2, worker.epochs
        assert epochs[1] > before + 1, epochs  # a jump: never the next epoch a bump would give
        stats = await tier.stats(POOL)
        assert (stats.epoch, stats.requests, stats.pending_tickets) == (epochs[1], 0, 0), stats
        assert agent.epoch == epochs[1]
        async with Redis.from_url(durable.url) as redis:
            await assert_nothing_held(redis, POOL, SMALL.cache.num_pages,
                                      SMALL.cache.blocks_per_page)


async def test_a_redis_restarted_empty_is_recovered_by_the_service_recovering_then_healthy(
        durable, monkeypatch):
    gate = asyncio.Event()
    create = PrefixIndex.create

    async def held_back(index: PrefixIndex) -> int:  # the recovery creates the pool again
        await gate.wait()
        return await create(index)

    async with (running_service(durable.url, config=SMALL) as service,
                running_agent(service.url) as agent,
                CacheTierClient(service.url, token=TOKEN, timeout=10) as tier):
        worker = Worker(tier, agent.pool, POOL, BLOCK, PAGE)
        await worker.serve("a1", DOCS[0])
        held = await worker.plan("held", DOCS[0] + [1])
        assert held.hit_tokens == 144
        before = max(worker.epochs)

        monkeypatch.setattr(PrefixIndex, "create", held_back)
        durable.restart(None)  # every key is gone

        lost = await first_error(lambda: tier.plan(POOL, [new_request("x", DOCS[1], 150, BLOCK)]))
        assert lost.retryable and lost.code == ErrorCode.RECOVERING, lost
        health = await tier.health()
        assert health.redis and health.recovering == [POOL] and health.pools == {POOL: [0]}
        during = await first_error(lambda: tier.stats(POOL))
        assert during.retryable and during.code == ErrorCode.RECOVERING, during
        gate.set()

        await worker.release("held")  # its pins went with the data: unknown, not an error
        await worker.serve("a2", DOCS[0])
        assert (await worker.serve("a3", DOCS[0] + [2])).hit_tokens == 144
        assert worker.wrong == [], worker.wrong
        epochs = strictly_increasing_epochs(worker.epochs)
        assert epochs == sorted(set(epochs)) and len(epochs) == 2, worker.epochs
        assert epochs[1] > before + 1, epochs
        assert (await tier.health()).recovering == []
        stats = await tier.stats(POOL)
        assert (stats.epoch, stats.ranks, stats.requests, stats.num_pages) == (
            epochs[1], [0], 0, SMALL.cache.num_pages), stats
        assert agent.epoch == epochs[1]
        async with Redis.from_url(durable.url) as redis:
            await assert_nothing_held(redis, POOL, SMALL.cache.num_pages,
                                      SMALL.cache.blocks_per_page)
