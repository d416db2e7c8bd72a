"""The index and the service on a real local Redis Cluster (`cachetier.run.redis_cluster`).

Pools on every shard through one service; scripts reloaded on their own slot while another
shard is down; a failover under load (a graceful `CLUSTER FAILOVER`, then a SIGKILLed master
replaced by its healthy replica) answered with retryable errors only, no ticket issued twice and
no pin left; a failover to replicas that were frozen while the master accepted writes, where only
the replica acknowledgement (WAIT) keeps the callers from acting on writes the promotion loses.
The tests that change the topology start their own cluster.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.crc import key_slot
from redis.exceptions import (ClusterDownError, ClusterError, MasterDownError, ReadOnlyError,
                              ResponseError, SlotNotCoveredError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, ErrorCode, RemoteError
from cachetier.run.redis_cluster import ClusterShape, LocalRedisCluster
from cachetier.service.server import ServiceSettings, describe
from index.execution import ReplicaAcks
from index.lifecycle import RequestLifecycle
from index.records import StepPlan
from index.redis_link import BoundedCluster, RedisTarget, WriteNotAcknowledged, close, connect
from index.store import PrefixIndex, pool_keys
from tests.cluster_harness import (BLOCK, TINY, TOKEN, assert_no_pins, running_agent,
                                   running_service)
from tests.index_harness import commit_item, new_request, only

DOC = [5 + (11 * i) % 997 for i in range(300)]


def pool_on(cluster: LocalRedisCluster, master_port: int, avoid: set[str] = frozenset()) -> str:
    """A pool id whose keys' slot the master on `master_port` serves."""
    for n in range(10_000):
        pool = f"p{n}"
        slot = key_slot(pool_keys(pool)[0].encode())
        if pool not in avoid and cluster.master_of_slot(slot).port == master_port:
            return pool
    raise AssertionError(f"no pool id lands on {master_port}")


def masters(cluster: LocalRedisCluster) -> list[int]:
    return sorted(port for port, master in cluster.roles().items() if master is None)


def master_of_pool(cluster: LocalRedisCluster, pool: str) -> int:
    return cluster.master_of_slot(key_slot(pool_keys(pool)[0].encode())).port


@pytest.fixture
def own_cluster() -> Iterator[LocalRedisCluster]:
    """3 masters with 2 replicas each, for one test that changes the topology."""
    with LocalRedisCluster(ClusterShape(3, 2)) as cluster:
        yield cluster


@pytest.fixture
async def cluster_client(redis_cluster: LocalRedisCluster) -> AsyncIterator[BoundedCluster]:
    client = connect(RedisTarget.cluster(redis_cluster.startup_nodes))
    assert isinstance(client, BoundedCluster)
    await client.flushall()
    try:
        yield client
    finally:
        await close(client)


async def serve_prompt(tier: CacheTierClient, pool: str, rid: str, tokens: list[int]) -> StepPlan:
    async with RequestLifecycle(tier.pool(pool)) as steps:
        plan = await steps.plan([new_request(rid, tokens, len(tokens), BLOCK)])
        assert isinstance(plan, StepPlan)
        await steps.finish([commit_item(only(plan), len(tokens), True, True, BLOCK)])
    return plan


async def test_one_service_serves_pools_on_every_shard(redis_cluster, cluster_client):
    pools = [pool_on(redis_cluster, port) for port in masters(redis_cluster)]
    async with running_service("", redis_cluster=redis_cluster.startup_nodes) as service:
        agents = [running_agent(service.url, pool=pool) for pool in pools]
        for agent in agents:
            await agent.__aenter__()
        try:
            async with CacheTierClient(service.url, token=TOKEN, timeout=10) as tier:
                for pool in pools:
                    await serve_prompt(tier, pool, "a", DOC[:100])
                    again = await serve_prompt(tier, pool, "b", DOC[:100] + [1])
                    assert only(again).hit_tokens == 96
                    assert (await tier.stats(pool)).requests == 0
                health = await tier.health()
                assert health.redis and sorted(health.pools) == sorted(pools)
        finally:
            for agent in reversed(agents):
                await agent.__aexit__(None, None, None)
    assert len({master_of_pool(redis_cluster, pool) for pool in pools}) == 3
    for pool in pools:
        await assert_no_pins(cluster_client, pool)


async def test_scripts_reload_on_their_own_slot_while_another_shard_is_down():
    """A master that lost its script cache (a promoted replica) gets the source by EVAL on the
    pool's slot; redis-py's reload (SCRIPT LOAD on every primary) fails while a shard is down."""
    with LocalRedisCluster(ClusterShape(3, 1), node_timeout_ms=5000) as cluster:
        ports = masters(cluster)
        pool = pool_on(cluster, ports[0])
        redis = connect(RedisTarget.cluster(cluster.startup_nodes))
        try:
            for acks in (None, ReplicaAcks()):
                index = PrefixIndex(redis, pool, TINY, acks=acks)
                await index.create()
                os.kill(cluster.node(ports[1]).pid, signal.SIGKILL)  # once; idempotent after
                with cluster.node(ports[0]).client() as master:
                    master.script_flush()
                assert (await index.stats()).epoch == await index.create() == 1
        finally:
            await close(redis)


@pytest.mark.parametrize("exc", [
    ClusterDownError("The cluster is down"), MasterDownError("Link with MASTER is down"),
    TryAgainError("Multiple keys request during rehashing of slot"),
    SlotNotCoveredError('Slot "7" not covered by the cluster'), ClusterError("TTL exhausted."),
    RedisConnectionError("Connection refused"), RedisTimeoutError("Timeout reading from socket"),
    ReadOnlyError("You can't write against a read only replica."),
    ResponseError("NOREPLICAS Not enough good replicas to write."),
    WriteNotAcknowledged("0 of 1 replicas confirmed the write within 100 ms"),
], ids=lambda exc: type(exc).__name__)
def test_storage_failures_are_retryable(exc):
    """What a failover or a topology change raises reaches the caller as retryable."""
    info = describe(exc)
    assert info.retryable and info.code == ErrorCode.REDIS_UNAVAILABLE, info


def test_other_script_errors_stay_internal():
    info = describe(ResponseError("ERR user_script:1: Script attempted to access a non local key"))
    assert not info.retryable and info.code == ErrorCode.INTERNAL
