"""How one script call reaches Redis: by SHA, its source on NOSCRIPT, and acknowledged by a replica
when the caller will act on what it wrote.

**NOSCRIPT.** The script cache is not replicated: a promoted replica, a restarted server or a
SCRIPT FLUSH answers NOSCRIPT. redis-py's `AsyncScript` then sends SCRIPT LOAD, which a cluster
client sends to every primary, and which fails while any shard is down. Here the call is sent
again as EVAL of the source, routed by the script's keys to the master of its own slot: that
caches the script there and runs it, whatever the other shards are doing.

**Acknowledged writes.** Replication is asynchronous: a master that fails over to a replica
which had not received a write loses it, and a caller that acted on it (copied into the pages
a plan handed out, confirmed the ticket a plan issued) is then out of step with the index:
ticket numbers are issued twice, pages thought pending are free. With `ReplicaAcks`, a write
script is followed on the same connection, in one pipeline, by `WAIT replicas timeout_ms`
(WAIT is refused inside scripts, and counts the replicas that received everything this
connection wrote). Fewer acknowledgements than asked raise `WriteNotAcknowledged` (retryable):
the write may survive or not, and the caller must not act on it. On a cluster the pipeline
goes to the slot's master directly; a MOVED reply (the script did not run) refreshes the slot
map and sends it again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from redis.asyncio import Redis
from redis.asyncio.cluster import PipelineCommand
from redis.exceptions import (AskError, ClusterDownError, ClusterError, MovedError, NoScriptError,
                              RedisError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from index.redis_link import BoundedCluster, RedisClient, WriteNotAcknowledged, torn_down_is_lost

_REDIRECTS = 3  # MOVED replies followed before giving up (a failover moves a slot once)


@dataclass(frozen=True)
class LoadedScript:
    """A script's source and the SHA Redis caches it under."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True)
class ReplicaAcks:
    """Writes wait for `replicas` replicas, at most `timeout_ms` (WAIT's arguments)."""

    replicas: int = 1
    timeout_ms: int = 100

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.timeout_ms < 1:
            raise ValueError("replica acks need replicas >= 1 and timeout_ms >= 1")


async def run_script(redis: RedisClient, script: LoadedScript, keys: Sequence[str],
                     args: Sequence[Any], acks: ReplicaAcks | None = None) -> Any:
    """The script's reply; with `acks`, once that many replicas hold what it wrote."""
    if acks is None:
        try:
            return await redis.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(script.source, len(keys), *keys, *args)
    reply = await _acked(redis, script.sha, script, keys, args, acks)
    if isinstance(reply, NoScriptError):
        reply = await _acked(redis, script.source, script, keys, args, acks)
    if isinstance(reply, Exception):
        raise reply
    return reply


async def _acked(redis: RedisClient, body: str, script: LoadedScript, keys: Sequence[str],
                 args: Sequence[Any], acks: ReplicaAcks) -> Any:
    """EVALSHA (`body` is the SHA) or EVAL (the source) then WAIT, in one pipeline; returns the
    reply, or the NoScriptError to send the source instead."""
    command = ("EVALSHA" if body == script.sha else "EVAL", body, len(keys), *keys, *args)
    wait = ("WAIT", acks.replicas, acks.timeout_ms)
    if isinstance(redis, BoundedCluster):
        reply, acked = await _on_slot_master(redis, keys[0], command, wait)
    else:
        reply, acked = await _on_server(redis, command, wait)
    if isinstance(reply, Exception):
        return reply
    if isinstance(acked, Exception):
        raise acked
    if int(acked) < acks.replicas:
        raise WriteNotAcknowledged(f"{int(acked)} of {acks.replicas} replicas confirmed the "
                                   f"write within {acks.timeout_ms} ms")
    return reply


async def _on_server(redis: Redis, command: tuple[Any, ...],
                     wait: tuple[Any, ...]) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.execute_command(*command)
        pipe.execute_command(*wait)
        return list(await pipe.execute(raise_on_error=False))


async def _on_slot_master(cluster: BoundedCluster, key: str, command: tuple[Any, ...],
                          wait: tuple[Any, ...]) -> list[Any]:
    """The pipeline on one connection to the master of `key`'s slot, following MOVED (the
    script did not run there); a node that failed mid-call refreshes the slot map and raises
    (the script may have run: the caller decides)."""
    async with cluster.bounded():
        await cluster.initialize()
        for _ in range(_REDIRECTS):
            node = cluster.get_node_from_key(key, replica=False)
            commands = [PipelineCommand(0, *command), PipelineCommand(1, *wait)]
            try:
                with torn_down_is_lost():
                    await node.execute_pipeline(commands)
            except (RedisConnectionError, RedisTimeoutError):
                await _refresh(cluster)
                raise
            reply, acked = (c.result for c in commands)
            if isinstance(reply, MovedError):
                await cluster.nodes_manager.move_slot(reply)
                continue
            if isinstance(reply, (RedisConnectionError, RedisTimeoutError, ClusterDownError,
                                  AskError)):
                await _refresh(cluster)
            return [reply, acked]
    raise ClusterError(f"slot of {key!r} still moving after {_REDIRECTS} redirects")


async def _refresh(cluster: BoundedCluster) -> None:
    """Best effort: a refresh failing now (no node answering) is retried by the next call."""
    try:
        await cluster.refresh_topology()
    except RedisError:
        pass
