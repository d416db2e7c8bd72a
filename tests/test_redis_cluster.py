"""The index and the service on a real local Redis Cluster (`cachetier.run.redis_cluster`).

Pools on every shard through one service; scripts reloaded on their own slot while another
shard is down; a failover under load (a graceful `CLUSTER FAILOVER`, then a SIGKILLed master
replaced by its healthy replica) answered with retryable errors only, no ticket issued twice and
no pin left; a failover to replicas that were frozen while the master accepted writes, where only
the replica acknowledgement (WAIT) keeps the callers from acting on writes the promotion loses;
the same two failovers under load with every hit's bytes checked. The pool's holder is its slot
master's, and a failover that lost writes moves it. A route is one round trip per shard, from the
masters or the replicas. The tests that change the topology start their own cluster.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
import signal
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TypeVar

import pytest
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import (ClusterDownError, ClusterError, MasterDownError, ReadOnlyError,
                              ResponseError, SlotNotCoveredError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachetier.cli import build_parser
from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, ErrorCode, RemoteError
from cachetier.run.chaos_load import release_for_sure
from cachetier.run.redis_cluster import ClusterShape, LocalRedisCluster
from cachetier.service.server import ServiceSettings, describe
from index.errors import StorageRollback
from index.execution import ReplicaAcks
from index.hashing import chain_hashes
from index.holder import storage_holder
from index.identity import PoolView, fresh_epoch
from index.lifecycle import RequestLifecycle
from index.meta import CORE_FIELD, decode_core
from index.records import StepPlan
from index.redis_link import BoundedCluster, RedisTarget, WriteNotAcknowledged, close, connect
from index.routing import probe_pools
from index.placement import ShardPlacement, tag_slot
from index.store import PrefixIndex, pool_keys
from index.tickets import split
from tests.cluster_harness import (BLOCK, OPERATOR_LOGIN, PAGE, SERVICE_LOGIN, TINY, TOKEN,
                                   assert_no_pins, running_agent, running_service)
from tests.index_harness import ROOT, commit_item, new_request, only
from tests.storage_harness import Worker

DOC = [5 + (11 * i) % 997 for i in range(300)]
T = TypeVar("T")
BALLAST = 32 << 20  # bytes: more than the kernel buffers of a replication link on loopback


def pools_by_crc(cluster: LocalRedisCluster, master_port: int, count: int) -> list[str]:
    """Pool ids that CRC16 alone (the `{pool}` tag) would all put on `master_port`."""
    slots = cluster.slot_map()
    pools = [f"p{n}" for n in range(10_000)
             if cluster.master_of_slot(key_slot(pool_keys(f"p{n}")[0].encode()), slots).port
             == master_port]
    return pools[:count]


def masters(cluster: LocalRedisCluster) -> list[int]:
    return sorted(port for port, master in cluster.roles().items() if master is None)


async def placed_tag(cluster: LocalRedisCluster, pool: str) -> str:
    """The hash tag the service's placement chose for `pool`."""
    node = cluster.live_nodes()[0]
    redis = connect(RedisTarget.cluster(node.address, **node.operator_login))
    try:
        tag = await ShardPlacement(redis).resolve(pool, create=False)
    finally:
        await close(redis)
    assert tag is not None, f"pool {pool} was never placed"
    return tag


async def master_of_pool(cluster: LocalRedisCluster, pool: str) -> int:
    return cluster.master_of_slot(tag_slot(await placed_tag(cluster, pool))).port


async def assert_clean(cluster: LocalRedisCluster, pool: str) -> None:
    """No request, ticket or pin left in `pool`, read on the master serving it now."""
    tag = await placed_tag(cluster, pool)
    master = cluster.master_of_slot(tag_slot(tag))
    redis = connect(RedisTarget(f"redis://{master.address}", **master.operator_login))
    try:
        await assert_no_pins(redis, pool, tag)
    finally:
        await close(redis)


@pytest.fixture
def own_cluster() -> Iterator[LocalRedisCluster]:
    """3 masters with 2 replicas each, for one test that changes the topology."""
    with LocalRedisCluster(ClusterShape(3, 2)) as cluster:
        yield cluster


@pytest.fixture
async def cluster_client(redis_cluster: LocalRedisCluster) -> AsyncIterator[BoundedCluster]:
    """A client of the shared cluster, emptied first (pools and placements of other tests)."""
    client = connect(RedisTarget.cluster(redis_cluster.startup_nodes, **OPERATOR_LOGIN))
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


async def test_one_service_spreads_pools_evenly_and_serves_them_on_every_shard(redis_cluster,
                                                                             cluster_client):
    """Six pools whose ids CRC16 would all put on one master are placed two per master, and
    each is served there through the same service."""
    pools = pools_by_crc(redis_cluster, masters(redis_cluster)[0], 6)
    async with running_service("", redis_cluster=redis_cluster.startup_nodes,
                               redis_user="cachetier",
                               redis_password=SERVICE_LOGIN["password"]) as service:
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
    placed = [await master_of_pool(redis_cluster, pool) for pool in pools]
    assert sorted(Counter(placed).values()) == [2, 2, 2]
    for pool in pools:
        await assert_clean(redis_cluster, pool)


async def test_the_library_reloads_on_its_own_slot_while_another_shard_is_down():
    """A master without the library (restarted empty, flushed) gets it by FUNCTION LOAD on the
    pool's slot; redis-py's FUNCTION LOAD (on every primary) fails while a shard is down."""
    with LocalRedisCluster(ClusterShape(3, 1), node_timeout_ms=5000) as cluster:
        ports = masters(cluster)
        pool = pools_by_crc(cluster, ports[0], 1)[0]  # PrefixIndex alone: the `{pool}` tag
        redis = connect(RedisTarget.cluster(cluster.startup_nodes))
        try:
            # a replica's ack took over 100 ms once in a few runs here, with or without a library
            # to load (the call under test is the load, not WAIT's latency): a longer wait
            for acks in (None, ReplicaAcks(timeout_ms=2000)):
                index = PrefixIndex(redis, pool, TINY, acks=acks)
                await index.create()
                os.kill(cluster.node(ports[1]).pid, signal.SIGKILL)  # once; idempotent after
                with cluster.node(ports[0]).client() as master:
                    master.function_flush()
                assert (await index.stats()).epoch == await index.create() == 1
        finally:
            await close(redis)


class RoundTrips:
    """Every pipeline and command the cluster client sends to a node, by node port."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[int] = []
        for name in ("execute_pipeline", "execute_command"):
            real = getattr(ClusterNode, name)

            async def counted(node, *args, _real=real, **kwargs):
                self.sent.append(node.port)
                return await _real(node, *args, **kwargs)
            monkeypatch.setattr(ClusterNode, name, counted)

    async def count(self, call: Awaitable[T]) -> tuple[T, list[int]]:
        self.sent.clear()
        result = await call
        return result, sorted(self.sent)


async def hold_growing_prefixes(indexes: list[PrefixIndex]) -> None:
    """Pool n created and holding DOC's first n + 1 blocks (committed and confirmed)."""
    for n, index in enumerate(indexes):
        await index.create()
        async with RequestLifecycle(index) as steps:
            tokens = DOC[:BLOCK * (n + 1) + 1]
            plan = await steps.plan([new_request("w", tokens, len(tokens), BLOCK)])
            await steps.finish([commit_item(only(plan), len(tokens), True, True, BLOCK)])


async def test_route_probes_every_shard_in_one_round_trip_and_answers_as_each_pool(
        redis_cluster, cluster_client, monkeypatch):
    """Six pools placed two per shard, each holding a different prefix of one prompt: a route
    is one pipeline per shard (three round trips, counted at the client's nodes), from the
    masters or from the replicas (READONLY), and its answers are the pools' own probes; a
    replica lagging behind a caller's epoch reports no hit, never a rollback."""
    acks = ReplicaAcks(timeout_ms=2000)  # WAIT answers at the ack: a slow replica is no failure
    placement = ShardPlacement(cluster_client, acks)
    indexes = []
    for n in range(6):
        pool = f"route{n}"
        indexes.append(PrefixIndex(cluster_client, pool, TINY, acks=acks,
                                   tag=await placement.resolve(pool, create=True)))
    await hold_growing_prefixes(indexes)
    hashes = chain_hashes(DOC[:200], ROOT, BLOCK)
    own = [await index.probe(200, hashes) for index in indexes]
    assert sorted(p.hit_tokens for p in own) == [BLOCK * n for n in range(1, 7)]
    trips = RoundTrips(monkeypatch)
    shards = sorted({(await master_of_pool(redis_cluster, i.pool_id)) for i in indexes})
    routed, sent = await trips.count(probe_pools(indexes, 200, hashes))
    assert routed == own and sent == shards
    roles = redis_cluster.roles()
    async with asyncio.timeout(10):  # until the replicas have the confirms (not waited for) and
        while True:  # the slot map names them (a replica at offset 0 is left out of it)
            routed, sent = await trips.count(probe_pools(indexes, 200, hashes, replicas=True))
            assert all(r.hit_tokens <= o.hit_tokens for r, o in zip(routed, own))
            if routed == own and all(roles[port] is not None for port in sent):
                break
            await asyncio.sleep(0.05)
    routed, sent = await trips.count(probe_pools(indexes, 200, hashes, replicas=True))
    assert routed == own and len(sent) == 3 and sorted(roles[port] for port in sent) == shards
    indexes[0].epoch += 1  # a caller that saw a later epoch: on a replica that is lag
    routed = await probe_pools(indexes, 200, hashes, replicas=True)
    assert routed[0].hit_tokens == 0 and routed[1:] == own[1:]
    with pytest.raises(StorageRollback):  # on the master it is the storage gone back
        await probe_pools(indexes, 200, hashes)


async def test_route_on_one_server_is_one_round_trip_for_every_pool(redis, redis_operator,
                                                                    monkeypatch):
    """One server is one shard: the probes of every pool go in one pipeline, answers as the
    pools' own probes (and a node without the library loads it and asks again in a second)."""
    indexes = [PrefixIndex(redis, f"one{n}", TINY) for n in range(3)]
    await hold_growing_prefixes(indexes)
    hashes = chain_hashes(DOC[:200], ROOT, BLOCK)
    own = [await index.probe(200, hashes) for index in indexes]
    await redis_operator.function_flush()
    sent: list[int] = []  # one write per round trip: the client then waits for the replies
    real = AbstractConnection.send_packed_command

    async def counted(connection, command, *args, **kwargs):
        sent.append(1)
        return await real(connection, command, *args, **kwargs)
    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    assert await probe_pools(indexes, 200, hashes) == own and len(sent) == 2
    sent.clear()
    assert await probe_pools(indexes, 200, hashes) == own and len(sent) == 1


async def test_a_call_whose_reply_is_lost_is_not_sent_again(cluster_client, monkeypatch):
    """The node ran the write and its reply never came back: the caller learns that (a
    transient error) rather than redis-py's cluster client sending it again, which would run it
    twice (INCR stands for a write script: a second confirm finds its ticket gone)."""
    real = AbstractConnection.read_response
    lost: list[object] = []

    async def lose_the_first_reply(connection, *args, **kwargs):
        reply = await real(connection, *args, **kwargs)
        if not lost:
            lost.append(reply)
            raise RedisConnectionError("connection lost before the reply was read")
        return reply
    await cluster_client.set("{lost}n", 0)
    monkeypatch.setattr(AbstractConnection, "read_response", lose_the_first_reply)
    with pytest.raises(RedisConnectionError):
        await cluster_client.incr("{lost}n")
    monkeypatch.undo()
    assert lost == [1]
    assert int(await cluster_client.get("{lost}n")) == 1  # it ran, once
    assert await cluster_client.incr("{lost}n") == 2      # and the next call goes through


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


class Tickets:
    """Every ticket counter a caller was given (plans and commits draw from one counter per
    pool), by epoch, and every error: a counter given twice means a write a caller acted on was
    lost (its nonce differs: `index.tickets`)."""

    def __init__(self) -> None:
        self.given: list[tuple[int, int]] = []
        self.retryable: dict[str, int] = {}
        self.bad: list[str] = []
        self.steps = 0

    def failed(self, op: str, exc: BaseException) -> None:
        if isinstance(exc, RemoteError) and exc.retryable:
            self.retryable[exc.code] = self.retryable.get(exc.code, 0) + 1
        else:
            self.bad.append(f"{op}: {type(exc).__name__}: {exc}")

    def reused(self) -> list[tuple[int, int]]:
        return sorted({t for t in self.given if self.given.count(t) > 1})


async def one_request(tier: CacheTierClient, pool: str, rid: str, tokens: list[int],
                      tickets: Tickets, release_timeout_s: float = 30) -> None:
    """Plan, commit, confirm; released whatever happens (retried while the storage settles, for
    at most `release_timeout_s`: TimeoutError after)."""
    op = "plan"
    try:
        plan = await tier.plan(pool, [new_request(rid, tokens, len(tokens), BLOCK)])
        if not isinstance(plan, StepPlan):
            return
        tickets.given.append((plan.epoch, split(plan.ticket)[0]))
        op = "commit"
        done = await tier.commit(pool, [commit_item(only(plan), len(tokens), True, True, BLOCK)])
        tickets.given.append((plan.epoch, split(done.ticket)[0]))
        op = "confirm"
        await tier.confirm(pool, done.ticket)
        tickets.steps += 1
    except CacheTierError as exc:
        tickets.failed(op, exc)
        await asyncio.sleep(0.02)
    finally:
        await release_for_sure(tier, pool, rid, tickets.failed, timeout_s=release_timeout_s)


async def load(url: str, pool: str, n: int, stop: asyncio.Event, tickets: Tickets) -> None:
    async with CacheTierClient(url, token=TOKEN, timeout=15, connect_timeout=10) as tier:
        i = 0
        while not stop.is_set():
            tokens = DOC[:40 + (7 * i + 13 * n) % 200] + [n, i]
            await one_request(tier, pool, f"c{n}-{i}", tokens, tickets)
            i += 1


async def more_steps(tickets: Tickets, count: int, timeout_s: float = 30) -> None:
    target = tickets.steps + count
    async with asyncio.timeout(timeout_s):
        while tickets.steps < target:
            await asyncio.sleep(0.02)


async def until_master(cluster: LocalRedisCluster, port: int) -> None:
    async with asyncio.timeout(30):
        while (await asyncio.to_thread(cluster.roles)).get(port, 0) is not None:
            await asyncio.sleep(0.05)


def replicas_of(cluster: LocalRedisCluster, port: int) -> list[int]:
    return sorted(p for p, master in cluster.roles().items() if master == port)


async def test_a_failover_under_load_loses_nothing_a_caller_acted_on(own_cluster):
    """Four clients plan, commit, confirm and release while the pool's master hands over to a
    replica (CLUSTER FAILOVER), and then that new master is SIGKILLed and replaced by a healthy
    replica: only retryable errors, every new master (no scripts cached) serves, no ticket is
    given twice, and nothing is left pinned."""
    cluster = own_cluster
    pool = "p"
    tickets, stop = Tickets(), asyncio.Event()
    async with running_service("", redis_cluster=cluster.startup_nodes, batch_tick_s=0) as service, \
            running_agent(service.url, pool=pool):
        first = await master_of_pool(cluster, pool)
        clients = [asyncio.create_task(load(service.url, pool, n, stop, tickets))
                   for n in range(4)]
        try:
            await more_steps(tickets, 20)
            handover = replicas_of(cluster, first)[0]
            with cluster.node(handover).client() as replica:
                replica.execute_command("CLUSTER", "FAILOVER")
            await until_master(cluster, handover)
            await more_steps(tickets, 20)
            os.kill(cluster.node(handover).pid, signal.SIGKILL)
            await asyncio.to_thread(cluster.wait_ready)
            assert await master_of_pool(cluster, pool) != handover
            await more_steps(tickets, 20)
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert tickets.bad == []
    assert tickets.reused() == []
    assert tickets.retryable, "the failovers were not seen at all"
    await assert_clean(cluster, pool)


@pytest.mark.parametrize("acks", [None, 0], ids=["acknowledged", "unacknowledged"])
async def test_a_failover_to_frozen_replicas_loses_only_writes_no_caller_acted_on(own_cluster,
                                                                                 acks):
    """Both replicas of the pool's master are frozen (SIGSTOP) while it takes writes (behind a
    ballast that fills the links' socket buffers, so they stay in the master's output buffer),
    then it is SIGKILLed and one of them promoted without those writes. Acknowledged (the default on a
    cluster), the plans made meanwhile were answered retryable, so no caller acted on them and
    no ticket is given twice; unacknowledged, the writes callers acted on are lost, and the
    storage identity catches it: the pool is recovered, no ticket is given twice either."""
    cluster = own_cluster
    pool = "p"
    tickets = Tickets()
    async with running_service("", redis_cluster=cluster.startup_nodes,
                               redis_acks=acks) as service, running_agent(service.url, pool=pool):
        tag = await placed_tag(cluster, pool)
        master = cluster.master_of_slot(tag_slot(tag)).port
        frozen = replicas_of(cluster, master)
        async with CacheTierClient(service.url, token=TOKEN, timeout=15) as tier:
            await one_request(tier, pool, "before", DOC[:100], tickets)
            for port in frozen:
                os.kill(cluster.node(port).pid, signal.SIGSTOP)
            with cluster.node(master).client() as direct:  # fills the frozen links' buffers, so
                direct.set(f"ballast{{{tag}}}", b"x" * BALLAST)  # what follows stays on the master
            unreleased = []
            try:
                for i in range(3):
                    try:
                        await one_request(tier, pool, f"frozen-{i}", DOC[:60] + [i], tickets,
                                          release_timeout_s=5)
                    except TimeoutError:
                        # a master with no good replica refuses writes (NOREPLICAS) until one
                        # migrates to it, which a loaded machine may not see in time: released
                        # once the failover is over, as a scheduler retrying would
                        unreleased.append(f"frozen-{i}")
            finally:
                os.kill(cluster.node(master).pid, signal.SIGKILL)
                for port in frozen:
                    os.kill(cluster.node(port).pid, signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_ready)
            for rid in unreleased:
                await release_for_sure(tier, pool, rid, tickets.failed, timeout_s=30)
            steps = tickets.steps
            async with asyncio.timeout(30):
                for i in range(3):
                    while tickets.steps == steps + i:
                        await one_request(tier, pool, f"after-{i}", DOC[:80] + [i], tickets)
    assert tickets.bad == []
    assert tickets.reused() == []
    if acks == 0:
        # without WAIT the promotion lost writes callers acted on (on main before the storage
        # identity, tickets were handed out twice here): the service finds the pool behind its
        # view and starts it over in a fresh epoch, its ticket counter above every one issued
        assert tickets.retryable.get(ErrorCode.RECOVERING), tickets.retryable
        return
    assert tickets.retryable.get(ErrorCode.REDIS_UNAVAILABLE)
    assert tickets.reused() == []
    await assert_clean(cluster, pool)


@pytest.mark.parametrize("text, shape", [("3x2", ClusterShape(3, 2)), ("3", ClusterShape(3, 1)),
                                         ("6x0", ClusterShape(6, 0))])
def test_cluster_shapes_parse(text, shape):
    assert ClusterShape.parse(text) == shape and shape.nodes == shape.masters * (1 + shape.replicas)


@pytest.mark.parametrize("text", ["2x1", "3x", "x2", "3x-1", ""])
def test_bad_cluster_shapes_are_refused(text):
    with pytest.raises(ValueError):
        ClusterShape.parse(text)


def test_cluster_nodes_parse_and_bad_ones_are_refused():
    target = RedisTarget.cluster("10.0.0.1:7000, :7001")
    assert target.cluster_nodes == (("10.0.0.1", 7000), ("127.0.0.1", 7001)) and target.is_cluster
    for bad in ("", "host", "host:0", "host:x", "host:70000"):
        with pytest.raises(ValueError):
            RedisTarget.cluster(bad)
    with pytest.raises(ValueError):
        RedisTarget(url="redis://r", cluster_nodes=(("h", 1),))


def test_serve_takes_a_server_or_a_cluster_not_both():
    parser = build_parser()
    assert parser.parse_args(["serve", "--redis-cluster", "h:1,h:2"]).redis_cluster == "h:1,h:2"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--redis", "redis://r", "--redis-cluster", "h:1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve"])


@pytest.mark.parametrize("cluster, acks, expected", [
    ("", None, None), ("h:1", None, ReplicaAcks(1, 100)), ("", 1, ReplicaAcks(1, 100)),
    ("h:1", 0, None), ("h:1", 2, ReplicaAcks(2, 100))])
def test_writes_are_acknowledged_by_default_on_a_cluster_only(cluster, acks, expected):
    settings = ServiceSettings("redis://r" if not cluster else "", "s", TINY,
                               redis_cluster=cluster, redis_acks=acks)
    assert settings.replica_acks() == expected


async def test_a_plan_no_replica_acknowledged_is_released_and_raised(redis):
    """On one server with no replica, WAIT 1 counts none: the plan ran, so the lifecycle releases
    its requests before raising (nobody will copy into its pages), and the pool holds none."""
    plain = PrefixIndex(redis, "p", TINY)
    await plain.create()
    acked = PrefixIndex(redis, "p", TINY, acks=ReplicaAcks(1, 10))
    acked.epoch = plain.epoch
    with pytest.raises(WriteNotAcknowledged):
        async with RequestLifecycle(acked) as steps:
            await steps.plan([new_request("a", DOC[:100], 100, BLOCK)])
    assert (await plain.stats()).requests == 0
    await assert_no_pins(redis)
    with pytest.raises(WriteNotAcknowledged):  # the bump ran, and says no replica holds it
        await acked.invalidate()
    assert await plain.current_epoch() == plain.epoch + 1


async def test_the_holder_is_the_slot_masters_and_a_failover_that_lost_writes_moves_it(
        own_cluster):
    """On a cluster a pool's holder is the master of its slot (node id and run id), whichever
    node a call reaches, so callers agree on it; its replicas frozen (SIGSTOP) while it takes
    writes, then SIGKILLed and one of them promoted without those writes, a caller that saw no
    write (a service just started: the write count cannot tell) finds the holder moved and
    starts the pool over in a fresh epoch."""
    cluster = own_cluster
    redis = connect(RedisTarget.cluster(cluster.startup_nodes))
    try:
        index = PrefixIndex(redis, "p", TINY, acks=ReplicaAcks(2, 1000))  # the `{p}` tag
        await index.create()
        key = index.keys[0]
        master = cluster.master_of_slot(key_slot(key.encode()))
        with master.client() as direct:
            expected = (f"{direct.execute_command('CLUSTER', 'MYID').decode()}/"
                        f"{direct.info('server')['run_id']}")
        assert {await storage_holder(redis, key) for _ in range(6)} == {expected}
        assert await index.reconcile(index.view, expected, fresh_epoch(index.view)) == ""
        assert await PrefixIndex(redis, "p", TINY).reconcile(PoolView(), expected, 0) == ""
        writer = PrefixIndex(redis, "p", TINY)  # unacknowledged: what the promotion loses
        writer.epoch = index.epoch
        frozen = replicas_of(cluster, master.port)
        for port in frozen:
            os.kill(cluster.node(port).pid, signal.SIGSTOP)
        try:
            with master.client() as direct:
                direct.set("ballast{p}", b"x" * BALLAST)
            for i in range(3):
                plan = await writer.plan_step([new_request(f"w{i}", DOC[:60] + [i], 61, BLOCK)])
                await writer.confirm(plan.ticket)
        finally:
            os.kill(master.pid, signal.SIGKILL)
            for port in frozen:
                os.kill(cluster.node(port).pid, signal.SIGCONT)
        await asyncio.to_thread(cluster.wait_ready)
        await redis.refresh_topology()
        core = await redis.hget(key, CORE_FIELD)
        assert core is None or decode_core(core)["wc"] < writer.writes, "no write was lost"
        moved = await storage_holder(redis, key)
        assert moved != expected and moved.split("/")[0] != expected.split("/")[0]
        fresh = PrefixIndex(redis, "p", TINY)
        why = await fresh.reconcile(PoolView(), moved, fresh_epoch(PoolView()))
        assert why.startswith("holder moved"), why
        assert fresh.epoch > writer.epoch and (await fresh.stats()).requests == 0
        assert await PrefixIndex(redis, "p", TINY).reconcile(PoolView(), moved, 0) == ""
    finally:
        await close(redis)


FAILOVER_DOCS = [[900 * (d + 1) + (7 * i + d) % 89 for i in range(120)] for d in range(3)]


async def checked_load(worker: Worker, n: int, stop: asyncio.Event, bad: list[str]) -> None:
    """One scheduler serving prompts that share prefixes (so most plans hit, their bytes
    checked), retrying what the storage answers retryable, until `stop`."""
    i = 0
    while not stop.is_set():
        tokens = FAILOVER_DOCS[(n + i) % 3][:60 + (7 * i + 11 * n) % 60] + [n, i]
        try:
            await worker.serve(f"w{n}-{i}", tokens)
        except CacheTierError as exc:  # a commit or confirm (plans retry within `serve`)
            if not exc.retryable:
                bad.append(f"{type(exc).__name__}: {exc}")
            code = getattr(exc, "code", type(exc).__name__)
            worker.retryable[code] = worker.retryable.get(code, 0) + 1
            await asyncio.sleep(0.02)
        i += 1


def replica_meta(cluster: LocalRedisCluster, port: int, key: str) -> dict[str, int] | None:
    """The pool's epoch and ticket counter on a replica (READONLY), read directly; None if it
    holds no pool."""
    with cluster.node(port).client() as direct:
        direct.execute_command("READONLY")
        core = direct.hget(key, CORE_FIELD)
    return None if core is None else {f: int(decode_core(core)[f]) for f in ("epoch", "ticket")}


async def served(workers: list[Worker], count: int) -> None:
    target = sum(len(w.tickets) for w in workers) + 2 * count
    async with asyncio.timeout(30):
        while sum(len(w.tickets) for w in workers) < target:
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("freeze", [False, True], ids=["healthy-replica", "frozen-replicas"])
async def test_a_failover_under_load_serves_no_wrong_byte_and_loses_no_acknowledged_write(
        own_cluster, freeze):
    """Three schedulers plan, write the pages (as the inference worker, into the agent's pool),
    commit, confirm and release prompts sharing prefixes while the pool's master is SIGKILLed:
    with a healthy replica promoted; or with both its replicas frozen (SIGSTOP) longer than the
    node timeout behind a ballast (what the master takes meanwhile stays in its output buffer),
    one of them promoted without it once they resume. Every hit's bytes are checked (restored
    state, cached MLA pages), no ticket counter is given twice in an epoch (an acknowledged
    write lost), the pool's counter holds every one given before the failover, and nothing is
    left pinned once every request is released."""
    cluster = own_cluster
    pool, stop, bad = "p", asyncio.Event(), []
    async with running_service("", redis_cluster=cluster.startup_nodes,
                               batch_tick_s=0) as service, \
            running_agent(service.url, pool=pool) as agent:
        tag = await placed_tag(cluster, pool)
        master = cluster.master_of_slot(tag_slot(tag))
        replicas = replicas_of(cluster, master.port)
        tiers = [CacheTierClient(service.url, token=TOKEN, timeout=15) for _ in range(3)]
        for tier in tiers:
            await tier.__aenter__()
        workers = [Worker(tier, agent.pool, pool, BLOCK, PAGE) for tier in tiers]
        load = [asyncio.create_task(checked_load(w, n, stop, bad)) for n, w in enumerate(workers)]
        try:
            await served(workers, 15)
            if freeze:
                for port in replicas:
                    os.kill(cluster.node(port).pid, signal.SIGSTOP)
                with master.client() as direct:
                    direct.set(f"ballast{{{tag}}}", b"x" * BALLAST)
                await asyncio.sleep(2 * cluster.node_timeout_ms / 1000)
            before = [t for w in workers for t in w.tickets]
            hits_before = sum(w.hits for w in workers)
            os.kill(master.pid, signal.SIGKILL)
            if freeze:
                for port in replicas:
                    os.kill(cluster.node(port).pid, signal.SIGCONT)
            await asyncio.sleep(0.1)  # what each replica holds, before the service can recover
            held = {port: replica_meta(cluster, port, pool_keys(pool, tag)[0]) for port in replicas}
            await asyncio.to_thread(cluster.wait_ready)
            promoted = cluster.master_of_slot(tag_slot(tag))
            await served(workers, 15)
        finally:
            stop.set()
            await asyncio.gather(*load)
            for tier in tiers:
                await tier.__aexit__(None, None, None)
    assert promoted.port in replicas and bad == []
    given = [(epoch, split(ticket)[0]) for w in workers for epoch, ticket in w.tickets]
    assert sorted(t for t in set(given) if given.count(t) > 1) == [], "a counter given twice"
    meta = held[promoted.port]
    assert meta is not None, f"the promoted replica held no pool: {held}, {cluster.roles()}"
    lost = sorted((e, n) for e, n in {(e, split(t)[0]) for e, t in before}
                  if e == meta["epoch"] and n > meta["ticket"])
    assert lost == [], f"{len(lost)} acknowledged tickets lost by the promotion: {lost[:5]}..."
    hits = sum(w.hits for w in workers)
    assert hits_before >= 5 and hits >= hits_before + 5, (hits_before, hits)  # both sides checked
    assert [x for w in workers for x in w.wrong] == []
    assert sum(sum(w.retryable.values()) for w in workers), "the failover was not seen"
    await assert_clean(cluster, pool)
