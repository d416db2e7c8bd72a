"""A router's probes of many pools, one round trip per shard (the service's `route`).

A probe is one read-only function on its pool's slot (`probe.lua` in the library). Sent one by
one, routing a prompt over P pools costs P round trips; here the probes of the pools that live on
one shard go together, as one pipeline on one connection to one node of that shard, and the
shards are asked concurrently: one round trip per shard (one in all on a single server). A
master without the library (restarted empty) answers "Function not found", and those probes go
once more after FUNCTION LOAD on the same connection; a replica without it (its master never
had it) sends its shard's probes to the master.

**From replicas** (`replicas=True`): each shard's probes go to one of its replicas, READONLY first
on the same connection and FCALL_RO (refused should the function ever write), which takes the
routing load off the masters. A replica lags its master, so its answer is advisory as every
probe is: nothing is served from it (a plan runs on the master and finds what is there), and
lag never counts as the storage going back in time: a reply in an epoch older than the caller's
view speaks of void pages and reports no hit, a pool the replica does not hold yet reports none
(`PrefixIndex.probe_answer`). A replica that cannot answer (down, or no longer a replica of the
slot) sends its shard's probes to the master instead. A replica with nothing replicated yet is
left out of CLUSTER SLOTS (Redis 7.0 hides replicas at offset 0), so a slot map read on a fresh
cluster names none: it is read again, at most once a second, while a shard has no replica in it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand
from redis.exceptions import (AskError, ClusterDownError, RedisError, ResponseError,
                              TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from index.errors import StorageRollback, UnknownPool, from_reply
from index.execution import call_function, function_missing, on_server
from index.identity import PoolView
from index.prefix import PrefixProbe
from index.redis_link import BoundedCluster, torn_down_is_lost
from index.scripts import library
from index.store import PrefixIndex

Send = Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]]
_LIBRARY = library()
_PROBE = _LIBRARY.functions["probe"]
_replica_turn = itertools.count()  # spreads the shards' probes over their replicas
_MAP_REREAD_S = 1.0  # how often a slot map naming no replica of a shard is read again
_map_read: weakref.WeakKeyDictionary[BoundedCluster, float] = weakref.WeakKeyDictionary()


async def probe_pools(indexes: Sequence[PrefixIndex], prompt_tokens: int, hashes: bytes,
                      replicas: bool = False) -> list[PrefixProbe]:
    """Each index's `probe(prompt_tokens, hashes)`, in order, in one round trip per shard (all
    the indexes share one client); `replicas`: read on the shards' replicas (above)."""
    if not indexes:
        return []
    views = [index.view for index in indexes]
    args = [prompt_tokens, bytes(hashes)]
    redis = indexes[0].redis
    if isinstance(redis, BoundedCluster):
        replies, on_replica = await _on_cluster(redis, indexes, args, replicas)
    else:
        replies = await _probe(partial(on_server, redis), indexes, args)
        on_replica = [False] * len(indexes)
    return [_answer(index, view, reply, replica)
            for index, view, reply, replica in zip(indexes, views, replies, on_replica)]


def _answer(index: PrefixIndex, view: PoolView, reply: Any, replica: bool) -> PrefixProbe:
    if not isinstance(reply, Exception):
        return index.probe_answer(view, reply, replica)
    typed = from_reply(str(reply)) if isinstance(reply, ResponseError) else None
    if typed is None:
        raise reply
    if replica and isinstance(typed, UnknownPool):  # not replicated there yet
        return PrefixProbe(index.pool_id, view.epoch, 0, 0)
    if isinstance(typed, (UnknownPool, StorageRollback)):
        raise index.storage_error(typed)
    raise typed


class LibraryMissing(RedisError):
    """A replica without the library: its master answers instead."""


async def _probe(send: Send, indexes: Sequence[PrefixIndex], args: list[Any],
                 readonly: bool = False) -> list[Any]:
    """One pipeline of the probes (READONLY first on a replica); a master without the library
    loads it and answers the probes that missed it."""
    prefix: list[tuple[Any, ...]] = [("READONLY",)] if readonly else []
    calls = [("FCALL_RO", _PROBE, len(i.keys), *i.keys, *args) for i in indexes]
    replies = (await send(prefix + calls))[len(prefix):]
    missing = [n for n, reply in enumerate(replies) if function_missing(reply)]
    if missing and readonly:
        raise LibraryMissing("the replica has no cachetier library")
    if missing:
        load = ("FUNCTION", "LOAD", "REPLACE", _LIBRARY.source)
        loaded, *again = await send([load, *(calls[n] for n in missing)])
        if isinstance(loaded, Exception):
            raise loaded
        for n, reply in zip(missing, again):
            replies[n] = reply
    return replies


def _node(cluster: BoundedCluster, node: ClusterNode) -> Send:
    async def send(commands: list[tuple[Any, ...]]) -> list[Any]:
        sent = [PipelineCommand(n, *command) for n, command in enumerate(commands)]
        async with cluster.bounded():
            with torn_down_is_lost():
                await node.execute_pipeline(sent)
        return [command.result for command in sent]
    return send


async def _on_cluster(cluster: BoundedCluster, indexes: Sequence[PrefixIndex], args: list[Any],
                      replicas: bool) -> tuple[list[Any], list[bool]]:
    """The indexes grouped by the master of their slot, every group in one pipeline, the groups
    concurrently; a reply that is a redirect or a failed node (a slot moving) is probed again
    alone, through the cluster client, which follows it."""
    await cluster.initialize()
    if replicas:
        await _replicas_known(cluster, indexes)
    shards: dict[str, list[int]] = {}
    for n, index in enumerate(indexes):
        shards.setdefault(cluster.get_node_from_key(index.keys[0]).name, []).append(n)
    replies: list[Any] = [None] * len(indexes)
    on_replica = [False] * len(indexes)

    async def shard(members: list[int]) -> None:
        group = [indexes[n] for n in members]
        got, replica = await _shard(cluster, group, args, replicas)
        for n, reply in zip(members, got):
            replies[n], on_replica[n] = reply, replica

    await asyncio.gather(*(shard(members) for members in shards.values()))
    for n, reply in enumerate(replies):
        if _redirected(reply):
            replies[n], on_replica[n] = await _alone(indexes[n], args)
    return replies, on_replica


async def _shard(cluster: BoundedCluster, group: list[PrefixIndex], args: list[Any],
                 replicas: bool) -> tuple[list[Any], bool]:
    key = group[0].keys[0]
    replica = _replica(cluster, key) if replicas else None
    if replica is not None:
        try:
            got = await _probe(_node(cluster, replica), group, args, readonly=True)
            if not any(_redirected(reply) for reply in got):
                return got, True
        except RedisError:
            pass  # that replica is gone or busy: the master answers
    try:
        return await _probe(_node(cluster, cluster.get_node_from_key(key)), group, args), False
    except (RedisConnectionError, RedisTimeoutError):
        await cluster.refresh_topology()  # the master failed: the next route finds its successor
        raise


async def _replicas_known(cluster: BoundedCluster, indexes: Sequence[PrefixIndex]) -> None:
    """Read the slot map again if a shard of `indexes` has no replica in it (above)."""
    slots = cluster.nodes_manager.slots_cache
    if all(len(slots.get(cluster.keyslot(i.keys[0]), [])) > 1 for i in indexes):
        return
    now = time.monotonic()
    if now - _map_read.get(cluster, 0.0) >= _MAP_REREAD_S:
        _map_read[cluster] = now
        await cluster.refresh_topology()


def _replica(cluster: BoundedCluster, key: str) -> ClusterNode | None:
    """One replica of `key`'s slot, in turn (None: the shard has none)."""
    nodes = cluster.nodes_manager.slots_cache.get(cluster.keyslot(key), [])
    if len(nodes) < 2:
        return None
    return nodes[1 + next(_replica_turn) % (len(nodes) - 1)]


def _redirected(reply: Any) -> bool:
    """MOVED, ASK, CLUSTERDOWN, TRYAGAIN: the slot was not served there."""
    return isinstance(reply, (AskError, ClusterDownError, TryAgainError))


async def _alone(index: PrefixIndex, args: list[Any]) -> tuple[Any, bool]:
    try:
        return await call_function(index.redis, _LIBRARY, "probe", index.keys, args), False
    except ResponseError as exc:
        return exc, False
