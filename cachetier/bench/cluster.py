"""`cachetier bench cluster`: the index on one redis-server and on a local Redis Cluster, same run.

The workload is the index's own, with no service or agent in between, so what is measured is the
storage: `--pools` pools, `--clients` concurrent callers per pool, each repeating one request's
life (`plan_step` of a new request sharing its pool's prefix, `commit` with a checkpoint,
`confirm`, `release`: four script calls) for `--duration` seconds. `single_rps` and
`cluster_rps` count those cycles per second; on the cluster the pools are placed evenly over
the shards (`index.placement`) and the plan and commit are acknowledged by a replica (WAIT).

`wait_p50_us` is what the acknowledgement costs a plan: the p50 of one caller's acknowledged
`plan_step` minus its unacknowledged p50 on the same cluster and pool (`wait_commit_p50_us`
likewise for the commit). With `--failover` (on by default) the master of the first pool's
shard is SIGKILLed half-way through the cluster run: `failover_unavailable_s` is the time from
the kill to the first cycle completed again on that shard's pools, and
`lost_acknowledged_writes` counts the ticket counters a caller was given by an acknowledged plan or
commit that the pool then issued again (what a failover that lost them would do).

This machine runs every shard, its replicas and the callers on the same few cores, so the
cluster's throughput here says little about scale-out. Each shard's CPU time per cycle
(`INFO cpu` of its master, before and after, over the cycles of its pools) is reported instead
(`shard_cpu_us_per_request`), and `one_core_per_shard_rps` is the throughput those figures allow
with a core per shard and the pools spread as placed: the least capacity of a shard (1 s over
its CPU per cycle) divided by its share of the pools, next to `single_one_core_rps` (1 s over
the single server's CPU per cycle).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from redis.crc import key_slot

from cachetier.config import PRESETS, Config, ConfigError
from cachetier.run.redis_cluster import ClusterShape, LocalRedisCluster
from cachetier.run.servers import RedisServer
from index.errors import CacheIndexError
from index.execution import ReplicaAcks
from index.hashing import chain_hashes, namespace_root
from index.lifecycle import RequestLifecycle
from index.placement import ShardPlacement
from index.records import CommitItem, StepPlan, StepRequest
from index.redis_link import RedisClient, RedisTarget, close, connect, is_transient
from index.store import PrefixIndex
from index.tickets import split

PREFIX_BLOCKS = 6  # the prefix every request of a pool shares, then 2 blocks of its own
_TIMING_SAMPLES = 300


@dataclass
class Tally:
    """What the callers of one run saw."""

    cycles: int = 0
    per_pool: Counter[str] = field(default_factory=Counter)
    tickets: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    first_ok_after: dict[str, float] = field(default_factory=dict)
    killed_at: float | None = None

    def done(self, pool: str, started: float) -> None:
        self.cycles += 1
        self.per_pool[pool] += 1
        if self.killed_at is not None and started > self.killed_at:
            self.first_ok_after.setdefault(pool, time.monotonic())

    def reused(self) -> int:
        return sum(n - 1 for given in self.tickets.values()
                   for n in Counter(given).values() if n > 1)


def bench_config() -> Config:
    tiny = PRESETS["tiny"]
    return Config(tiny.model, replace(tiny.cache, num_pages=4096))


def prompt(pool: int, n: int, block: int) -> list[int]:
    shared = [pool * 100_000 + i for i in range(PREFIX_BLOCKS * block)]
    return shared + [(n * 7919 + i) % 50_000 for i in range(2 * block)]


async def cycle(index: PrefixIndex, rid: str, tokens: list[int], root: bytes,
                tally: Tally) -> None:
    """One request's life; a storage error (a failover) is counted, the request released."""
    block = index.config.cache.hash_block_tokens
    request = StepRequest(rid, len(tokens), len(tokens), chain_hashes(tokens, root, block))
    given = tally.tickets.setdefault(index.pool_id, [])
    started = time.monotonic()
    try:
        async with RequestLifecycle(index) as steps:
            plan = await steps.plan([request])
            if not isinstance(plan, StepPlan):
                tally.errors["refused"] += 1
                return
            given.append((plan.epoch, split(plan.ticket)[0]))  # counters: a lost write's
            done = await index.commit([CommitItem(rid, len(tokens), len(tokens) // block * block,
                                                  True)])
            given.append((plan.epoch, split(done.ticket)[0]))  # comes back, not its nonce
            await index.confirm(done.ticket)
        tally.done(index.pool_id, started)
    except Exception as exc:  # noqa: BLE001 (counted by kind; the run goes on)
        if not (is_transient(exc) or isinstance(exc, CacheIndexError)):
            raise
        tally.errors[type(exc).__name__] += 1
        await asyncio.sleep(0.02)


async def caller(index: PrefixIndex, pool_number: int, n: int, root: bytes, until: float,
                 tally: Tally) -> None:
    block = index.config.cache.hash_block_tokens
    i = 0
    while time.monotonic() < until:
        await cycle(index, f"c{n}-{i}", prompt(pool_number, n * 1_000_000 + i, block), root,
                    tally)
        i += 1


async def pools_on(redis: RedisClient, count: int, config: Config,
                   acks: ReplicaAcks | None) -> list[PrefixIndex]:
    placement = ShardPlacement(redis, acks)
    indexes = []
    for p in range(count):
        pool = f"bench-{p}"
        tag = await placement.resolve(pool, create=True)
        index = PrefixIndex(redis, pool, config, acks=acks, tag=tag)
        await index.drop()
        await index.create()
        indexes.append(index)
    return indexes


async def load(indexes: Sequence[PrefixIndex], clients: int, duration: float,
               root: bytes, kill: Any = None) -> tuple[Tally, float]:
    """All pools' callers for `duration` s (`kill()` half-way); returns the tally and the time."""
    tally = Tally()
    start = time.monotonic()
    until = start + duration
    tasks = [asyncio.create_task(caller(index, p, n, root, until, tally))
             for p, index in enumerate(indexes) for n in range(clients)]
    if kill is not None:
        await asyncio.sleep(duration / 2)
        tally.killed_at = time.monotonic()
        await asyncio.to_thread(kill)
    await asyncio.gather(*tasks)
    return tally, time.monotonic() - start


async def until_back(indexes: Sequence[PrefixIndex], shard: dict[str, int], victim: int,
                     root: bytes, tally: Tally, timeout_s: float = 60) -> None:
    """After a run that ended before the killed shard served again: one caller per pool of that
    shard until each has completed a cycle (so its unavailability is measured, not cut)."""
    async with asyncio.timeout(timeout_s):
        for p, index in enumerate(indexes):
            i = 0
            while shard[index.pool_id] == victim and index.pool_id not in tally.first_ok_after:
                block = index.config.cache.hash_block_tokens
                await cycle(index, f"back-{i}", prompt(p, 20_000_000 + i, block), root, tally)
                i += 1


async def wait_cost_us(acked: PrefixIndex, bare: PrefixIndex, root: bytes,
                       samples: int) -> dict[str, float]:
    """One caller's p50 of a plan and of a commit, acknowledged and not, on the same pool,
    alternating (so a load that comes and goes weighs on both alike)."""
    block = acked.config.cache.hash_block_tokens
    times: dict[str, list[float]] = {"plan": [], "commit": [], "bare_plan": [], "bare_commit": []}
    for i in range(2 * samples):
        index, name = (acked, "") if i % 2 == 0 else (bare, "bare_")
        tokens = prompt(0, 10_000_000 + i, block)
        request = StepRequest(f"t{i}", len(tokens), len(tokens), chain_hashes(tokens, root, block))
        t0 = time.perf_counter()
        await index.plan_step([request])
        t1 = time.perf_counter()
        await index.commit([CommitItem(f"t{i}", len(tokens), 0, True)])
        t2 = time.perf_counter()
        await index.release([f"t{i}"])
        times[name + "plan"].append(t1 - t0)
        times[name + "commit"].append(t2 - t1)
    p50 = {name: sorted(values)[len(values) // 2] * 1e6 for name, values in times.items()}
    return {"wait_p50_us": p50["plan"] - p50["bare_plan"],
            "wait_commit_p50_us": p50["commit"] - p50["bare_commit"],
            "plan_p50_us": p50["plan"], "commit_p50_us": p50["commit"]}


def cpu_s(node: Any) -> float:
    with node.client() as client:
        info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def run_single(args: argparse.Namespace, config: Config, root: bytes) -> dict[str, Any]:
    with RedisServer(tcp=True) as server:
        redis = connect(RedisTarget(server.url, max_connections=args.pools * args.clients + 4))
        try:
            indexes = await pools_on(redis, args.pools, config, None)
            before = cpu_s(server)
            tally, seconds = await load(indexes, args.clients, args.duration, root)
            cpu = cpu_s(server) - before
        finally:
            await close(redis)
    return {"rps": tally.cycles / seconds, "cpu_us_per_request": cpu / max(tally.cycles, 1) * 1e6,
            "errors": dict(tally.errors)}


async def run_cluster(args: argparse.Namespace, config: Config, root: bytes) -> dict[str, Any]:
    shape = ClusterShape.parse(args.shape)
    with LocalRedisCluster(shape) as cluster:
        redis = connect(RedisTarget.cluster(cluster.startup_nodes,
                                            max_connections=args.pools * args.clients + 4))
        try:
            acks = ReplicaAcks(1, args.ack_timeout_ms)
            indexes = await pools_on(redis, args.pools, config, acks)
            shard = {i.pool_id: cluster.master_of_slot(key_slot(i.keys[0].encode())).port
                     for i in indexes}
            progress("timing the acknowledgement")
            first = indexes[0]
            tag = await ShardPlacement(redis).resolve(first.pool_id, create=False)
            bare = PrefixIndex(redis, first.pool_id, config, tag=tag)
            bare.epoch = first.epoch
            timings = await wait_cost_us(first, bare, root, args.samples)
            masters = {port: cluster.node(port) for port in set(shard.values())}
            before = {port: cpu_s(node) for port, node in masters.items()}
            victim = shard[indexes[0].pool_id]
            kill = (lambda: os.kill(cluster.node(victim).pid, signal.SIGKILL)) \
                if args.failover else None
            progress(f"cluster {args.shape}: {args.pools} pools x {args.clients} callers"
                     f"{', a master killed half-way' if kill else ''}")
            tally, seconds = await load(indexes, args.clients, args.duration, root, kill)
            rps = tally.cycles / seconds
            if kill is not None:
                await until_back(indexes, shard, victim, root, tally)
            cpu = {port: cpu_s(node) - before[port] for port, node in masters.items()
                   if port != victim or kill is None}
        finally:
            await close(redis)
    per_shard = Counter()
    for pool, cycles in tally.per_pool.items():
        per_shard[shard[pool]] += cycles
    shard_cpu = {str(port): cpu[port] / max(per_shard[port], 1) * 1e6 for port in cpu}
    pools_per_shard = Counter(shard.values())
    capacity = min(1e6 / shard_cpu[str(port)] / pools_per_shard[port] for port in cpu)
    unavailable = None
    if tally.killed_at is not None:
        back = [tally.first_ok_after[p] for p, port in shard.items() if port == victim]
        unavailable = max(back) - tally.killed_at
    return {
        "rps": rps, "shards": shape.masters,
        **timings,
        "shard_cpu_us_per_request": shard_cpu,
        "pools_per_shard": sorted(pools_per_shard.values()),
        "one_core_per_shard_rps": capacity * args.pools,
        "failover_unavailable_s": unavailable,
        "lost_acknowledged_writes": tally.reused(),
        "errors": dict(tally.errors),
    }


def progress(line: str) -> None:
    print(f"bench cluster: {line}", file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.pools < 1 or args.clients < 1 or args.duration <= 0 or args.samples < 1:
        raise ConfigError("bench.cluster", "--pools, --clients, --samples >= 1, --duration > 0")
    try:
        ClusterShape.parse(args.shape)
    except ValueError as exc:
        raise ConfigError("--shape", str(exc)) from None
    config = bench_config()
    root = namespace_root("bench-cluster")
    progress(f"one redis-server: {args.pools} pools x {args.clients} callers")
    single = await run_single(args, config, root)
    cluster = await run_cluster(args, config, root)
    return {
        "single_rps": single["rps"], "cluster_rps": cluster.pop("rps"),
        "shards": cluster.pop("shards"), "pools": args.pools, "clients_per_pool": args.clients,
        "single_cpu_us_per_request": single["cpu_us_per_request"],
        "single_one_core_rps": 1e6 / single["cpu_us_per_request"], **cluster,
        "single_errors": single["errors"],
        "note": "every shard, replica and caller shares this machine's cores: compare the "
                "CPU per request, not the throughputs; one_core_per_shard_rps is what the "
                "shards' CPU per request allows with one core each",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pools", type=int, default=6)
    parser.add_argument("--clients", type=int, default=2, help="concurrent callers per pool")
    parser.add_argument("--duration", type=float, default=5.0, metavar="SECONDS",
                        help="of each throughput run (default 5)")
    parser.add_argument("--shape", default="3x2", metavar="MASTERSxREPLICAS")
    parser.add_argument("--samples", type=int, default=_TIMING_SAMPLES,
                        help="sequential plans and commits timed for wait_p50_us")
    parser.add_argument("--ack-timeout-ms", type=int, default=100)
    parser.add_argument("--no-failover", dest="failover", action="store_false",
                        help="do not kill a master during the cluster run")
