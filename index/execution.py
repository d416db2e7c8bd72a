"""How one script call reaches Redis: a library function by name (FCALL), the library loaded
when the server has none, or a lone script by SHA and its source on NOSCRIPT; acknowledged by a
replica when the caller will act on what it wrote.

**A missing library.** Functions are kept in RDB and AOF and replicated, unlike the script cache,
but a server restarted empty or flushed answers "Function not found". redis-py's FUNCTION LOAD
goes to every primary on a cluster, and fails while any shard is down; here the library is loaded
on the master of the function's own slot (FUNCTION LOAD REPLACE, then the call, on one
connection), whatever the other shards are doing. **NOSCRIPT** (a lone script, `run_script`): the
script cache is not replicated; the call is sent again as EVAL of the source, routed the same
way.

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

**Staged bytes.** Lua interns every byte of every argument before a script runs (~1.2 ns a
byte on the machines measured: 38 us of server time for 32 KB, which a SET of the same bytes
stores in 0.4 us). A call given `Staged` bytes sends them in the same pipeline, just before it,
as a key of the pool's slot the script reads ranges of, and UNLINKs the key right after it; the
key expires on its own should the connection break between the two. Staged bytes are written
like any other: replicas and the AOF receive them (and their UNLINK).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from redis.asyncio import Redis
from redis.asyncio.cluster import PipelineCommand
from redis.exceptions import (AskError, ClusterDownError, ClusterError, MovedError, NoScriptError,
                              RedisError, ResponseError)
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
class LoadedLibrary:
    """A Redis Functions library's source (its first line names it) and its functions: script
    name -> function name; `read_only` ones are sent as FCALL_RO."""

    source: str
    functions: dict[str, str]
    read_only: frozenset[str]


@dataclass(frozen=True)
class Staged:
    """`value` under `key` (a key of the pool's slot, unique to the call) while the call runs."""

    key: str
    value: bytes
    ttl_ms: int = 60_000

    def before(self) -> tuple[Any, ...]:
        return ("SET", self.key, self.value, "PX", self.ttl_ms)

    def after(self) -> tuple[Any, ...]:
        return ("UNLINK", self.key)


def function_missing(reply: Any) -> bool:
    """The server has no such function: its library is not loaded there."""
    return isinstance(reply, ResponseError) and "Function not found" in str(reply)


@dataclass(frozen=True)
class ReplicaAcks:
    """Writes wait for `replicas` replicas, at most `timeout_ms` (WAIT's arguments)."""

    replicas: int = 1
    timeout_ms: int = 100

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.timeout_ms < 1:
            raise ValueError("replica acks need replicas >= 1 and timeout_ms >= 1")


async def call_function(redis: RedisClient, library: LoadedLibrary, name: str,
                        keys: Sequence[str], args: Sequence[Any],
                        acks: ReplicaAcks | None = None, staged: Staged | None = None) -> Any:
    """The reply of the library's function `name`; with `acks`, once that many replicas hold
    what it wrote; with `staged`, its bytes under their key, the function's key after `keys`,
    while it runs. A server without the library gets it first (above)."""
    op = "FCALL_RO" if name in library.read_only else "FCALL"
    if staged is not None:
        keys = [*keys, staged.key]
    call = (op, library.functions[name], len(keys), *keys, *args)
    if acks is None and staged is None:  # one command, no pipeline (the common call)
        try:
            return await redis.execute_command(*call)
        except ResponseError as exc:
            if not function_missing(exc):
                raise
    load = ("FUNCTION", "LOAD", "REPLACE", library.source)
    before, after = ([], []) if staged is None else ([staged.before()], [staged.after()])
    sent, at = [*before, call, *after], len(before)  # at: the call's place in `sent`
    if acks is None:
        if staged is not None:
            replies = await _on_slot(redis, keys[0], sent)
            if not function_missing(replies[at]):
                return _reply_at(replies, at)
        return _reply_at(await _on_slot(redis, keys[0], [load, *sent]), at + 1)
    wait = ("WAIT", acks.replicas, acks.timeout_ms)
    replies = await _on_slot(redis, keys[0], [*sent, wait])
    if function_missing(replies[at]):
        replies, at = await _on_slot(redis, keys[0], [load, *sent, wait]), at + 1
    return _acknowledged(_reply_at(replies, at), replies[-1], acks)


def _reply_at(replies: list[Any], at: int) -> Any:
    """The call's reply (`replies[at]`), or the first failure up to it (loading the library,
    staging its bytes). What follows the call (the staged key's UNLINK, which expires anyway)
    cannot undo what it did, so the caller gets its reply whatever became of that."""
    for reply in replies[:at + 1]:
        if isinstance(reply, Exception):
            raise reply
    return replies[at]


async def _on_slot(redis: RedisClient, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The commands in one pipeline, on the master of `key`'s slot on a cluster."""
    if isinstance(redis, BoundedCluster):
        return await _on_slot_master(redis, key, commands)
    return await on_server(redis, commands)


def _acknowledged(reply: Any, acked: Any, acks: ReplicaAcks) -> Any:
    if isinstance(reply, Exception):
        raise reply
    if isinstance(acked, Exception):
        raise acked
    if int(acked) < acks.replicas:
        raise WriteNotAcknowledged(f"{int(acked)} of {acks.replicas} replicas confirmed the "
                                   f"write within {acks.timeout_ms} ms")
    return reply


async def run_script(redis: RedisClient, script: LoadedScript, keys: Sequence[str],
                     args: Sequence[Any], acks: ReplicaAcks | None = None) -> Any:
    """The script's reply; with `acks`, once that many replicas hold what it wrote."""
    if acks is None:
        try:
            return await redis.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(script.source, len(keys), *keys, *args)
    wait = ("WAIT", acks.replicas, acks.timeout_ms)
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    reply, acked = await _on_slot(redis, keys[0], [command, wait])
    if isinstance(reply, NoScriptError):
        command = ("EVAL", script.source, len(keys), *keys, *args)
        reply, acked = await _on_slot(redis, keys[0], [command, wait])
    return _acknowledged(reply, acked, acks)


async def on_server(redis: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The commands in one write on one connection of the pool, and their replies in order (an
    error reply in its place). Not redis-py's pipeline object, which cost ~35 us more for a
    step's three commands; nor its retries: a connection lost mid-way raises, since the writes
    may have run (the caller decides, as on a cluster). redis-py closes a connection that
    failed or was cancelled mid-reply, so none goes back to the pool with a reply pending."""
    pool = redis.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_packed_command(connection.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    finally:
        await pool.release(connection)


async def _on_slot_master(cluster: BoundedCluster, key: str,
                          commands: list[tuple[Any, ...]]) -> list[Any]:
    """The pipeline on one connection to the master of `key`'s slot, following MOVED (nothing
    ran there); a node that failed mid-call refreshes the slot map and raises (the call may
    have run: the caller decides)."""
    async with cluster.bounded():
        await cluster.initialize()
        for _ in range(_REDIRECTS):
            node = cluster.get_node_from_key(key, replica=False)
            sent = [PipelineCommand(n, *command) for n, command in enumerate(commands)]
            try:
                with torn_down_is_lost():
                    await node.execute_pipeline(sent)
            except (RedisConnectionError, RedisTimeoutError):
                await _refresh(cluster)
                raise
            replies = [c.result for c in sent]
            moved = next((r for r in replies if isinstance(r, MovedError)), None)
            if moved is not None:
                await cluster.nodes_manager.move_slot(moved)
                continue
            if any(isinstance(reply, (RedisConnectionError, RedisTimeoutError, ClusterDownError,
                                      AskError)) for reply in replies):
                await _refresh(cluster)
            return replies
    raise ClusterError(f"slot of {key!r} still moving after {_REDIRECTS} redirects")


async def _refresh(cluster: BoundedCluster) -> None:
    """Best effort: a refresh failing now (no node answering) is retried by the next call."""
    try:
        await cluster.refresh_topology()
    except RedisError:
        pass
