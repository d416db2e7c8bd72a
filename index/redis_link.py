"""One Redis client for the index, whether the metadata lives on one server or a Redis Cluster.

`connect(RedisTarget)` builds `redis.asyncio.Redis` over a `BlockingConnectionPool` for one server,
or a `BoundedCluster` for a cluster: redis-py's `RedisCluster` has no blocking pool (past
`max_connections` on a node it raises instead of waiting), so a semaphore bounds the calls in
flight and each node gets a few connections more than that bound, for topology refreshes.
`close` knows the two `aclose` signatures. Every key of a pool shares one hash tag, so each
script runs whole on the master of its pool's slot, whichever shard that is.

Both pack commands with hiredis's C packer (`hiredis_packing`), as redis-py's synchronous client
does when hiredis is installed and its asyncio client (8.1) does not: its Python packer took
10 us of a plan's client time for the 14 keys and 4 arguments of one FCALL, hiredis 1.4 us.

`is_transient` names the failures of the storage rather than of the call: a node down or
failing over, a slot moving, a master refusing writes while it has no replica, a write no
replica acknowledged in time, a server busy running a script. The same call may succeed once
the cluster has settled, so the service answers them retryable. `is_full` names a write refused
at `maxmemory` (the servers the project starts run with `noeviction`: Redis never drops index
keys on its own, it refuses the write). A script is refused at its first write only, before it
has written anything (Redis lets a script that has written go on past `maxmemory`), so a
refused script changed nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer
from redis.exceptions import (AskError, ClusterDownError, ClusterError, OutOfMemoryError,
                              RedisClusterException, ReadOnlyError, RedisError, ResponseError,
                              SlotNotCoveredError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RedisClient: TypeAlias = "Redis | BoundedCluster"

_SPARE_CONNECTIONS = 8  # per node, beyond the bound: topology refreshes run beside the calls
# a master without replicas, a demoted master, a server busy with a long script (another
# caller's, or a slow one: it answers every other client BUSY until the script ends)
_REFUSED_WRITES = ("NOREPLICAS", "READONLY", "BUSY")


class WriteNotAcknowledged(RedisError):
    """A write ran on the master but no replica confirmed it in time: a failover now could lose
    it, so the caller must not act on it (`index.execution`)."""


@dataclass(frozen=True)
class RedisTarget:
    """Where the index lives: `url` (redis://HOST:PORT or unix:///PATH) or `cluster_nodes`
    (some of the cluster's nodes; the rest are discovered). `max_connections` bounds the calls
    in flight; a call waits up to `wait_s` for one to finish. `username`/`password`: the ACL
    user the service logs in as on every node (None: the default user). `tls_ca`: a cluster's
    nodes speak TLS, verified against this CA (a single server's URL says so itself:
    `rediss://HOST:PORT?ssl_ca_certs=PATH`)."""

    url: str = ""
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    max_connections: int = 64
    wait_s: float = 10.0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.cluster_nodes):
            raise ValueError("give a Redis URL or cluster nodes, not both and not neither")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")

    @classmethod
    def cluster(cls, nodes: str, **kwargs: Any) -> RedisTarget:
        """From `host:port,host:port,...`."""
        return cls(cluster_nodes=parse_nodes(nodes), **kwargs)

    @property
    def is_cluster(self) -> bool:
        return bool(self.cluster_nodes)


def parse_nodes(spec: str) -> tuple[tuple[str, int], ...]:
    """`host:port,host:port` (a bare `:port` means loopback) as (host, port) pairs."""
    nodes = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {item!r} is not host:port")
        nodes.append((host or "127.0.0.1", int(port)))
    if not nodes:
        raise ValueError("no cluster node given (host:port,host:port,...)")
    return tuple(nodes)


@contextlib.contextmanager
def torn_down_is_lost() -> Iterator[None]:
    """redis-py (8.1) races a node's connection torn down by a failover: a send finds its writer
    gone (`'NoneType' object has no attribute 'writelines'`, seen in `bench cluster` and in a
    failover under load, on a pipeline sent to a node directly). The node went away, which a
    ConnectionError says, so callers retry it as they retry any lost connection."""
    try:
        yield
    except AttributeError as exc:
        if "'NoneType' object" not in str(exc):
            raise
        raise RedisConnectionError(f"connection torn down mid-call: {exc}") from exc


class _HiredisPacking:
    """A connection's command packing by hiredis (`HiredisRespSerializer`: the same bytes, and
    the same `DataError` for a value Redis cannot take)."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args)


def hiredis_packing(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """`connection_class` (plain, TLS or Unix socket) packing its commands with hiredis."""
    if issubclass(connection_class, _HiredisPacking):
        return connection_class
    return type(f"Hiredis{connection_class.__name__}", (_HiredisPacking, connection_class), {})


def packing_with_hiredis(pool: ConnectionPool) -> ConnectionPool:
    """`pool`, whose connections (none opened yet) pack commands with hiredis."""
    pool.connection_class = hiredis_packing(pool.connection_class)
    return pool


class BoundedCluster(RedisCluster):
    """`RedisCluster` whose calls in flight are bounded: a call past the bound waits for one to
    finish (up to `wait_s`), as a `BlockingConnectionPool` makes it wait for a connection.

    It sends a command again only when no node ran it (the cluster answered CLUSTERDOWN, or no
    node serves the slot yet). redis-py's cluster client also sends it again, up to 10 times,
    after a connection lost or timed out mid-call, when the node may have run it: a write script
    would run twice (a confirm then finds its ticket gone and answers it unknown; a plan finds
    its requests already planned). Such a call raises instead, transient, as on one server
    (`execution.on_server`); the caller knows whether it is safe to send again."""

    ERRORS_ALLOW_RETRY = (ClusterDownError, SlotNotCoveredError)

    def __init__(self, nodes: tuple[tuple[str, int], ...], bound: int, wait_s: float,
                 **options: Any) -> None:
        super().__init__(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                         max_connections=bound + _SPARE_CONNECTIONS, decode_responses=False,
                         **options)
        self._calls = asyncio.Semaphore(bound)
        self._wait_s = wait_s
        self._refreshing = asyncio.Lock()
        # Nodes found later take the class from the manager's options, the known ones have theirs.
        options = self.nodes_manager.connection_kwargs
        options["connection_class"] = hiredis_packing(options["connection_class"])
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = options["connection_class"]

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """One of the bounded calls in flight, for the whole of a command or a pipeline."""
        try:
            async with asyncio.timeout(self._wait_s):
                await self._calls.acquire()
        except TimeoutError:
            raise RedisConnectionError(f"no Redis call slot free within {self._wait_s:g} s") \
                from None
        try:
            yield
        finally:
            self._calls.release()

    async def _determine_slot(self, command: str, *args: Any) -> int:
        """FCALL's keys are read as EVALSHA's (name, count, keys): redis-py asks a node for them
        (COMMAND GETKEYS), a round trip more per call, and none at all while that node is down."""
        if command.upper() in ("FCALL", "FCALL_RO"):
            command = "EVALSHA"
        return await super()._determine_slot(command, *args)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.bounded():
            with torn_down_is_lost():
                return await super().execute_command(*args, **kwargs)

    async def refresh_topology(self) -> None:
        """Read the slot map again (after a node failed or a slot moved under a pipeline that
        went to a node directly); concurrent callers share one refresh."""
        if self._refreshing.locked():
            async with self._refreshing:
                return
        async with self._refreshing:
            await self.initialize()
            await self.nodes_manager.initialize()


def connect(target: RedisTarget) -> RedisClient:
    """The client for `target`; connections open on first use."""
    login = {"username": target.username, "password": target.password}
    if target.is_cluster:
        tls = {"ssl": True, "ssl_ca_certs": target.tls_ca} if target.tls_ca else {}
        return BoundedCluster(target.cluster_nodes, target.max_connections, target.wait_s,
                              **login, **tls)
    pool = BlockingConnectionPool.from_url(target.url, max_connections=target.max_connections,
                                           timeout=target.wait_s, **login)
    return Redis(connection_pool=packing_with_hiredis(pool))


async def close(client: RedisClient) -> None:
    """Close the client and every connection it opened, whichever kind it is."""
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is the storage being unavailable or settling (see the module docstring)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ClusterDownError, ClusterError,
                        RedisClusterException, TryAgainError, AskError, ReadOnlyError,
                        WriteNotAcknowledged)):
        return True
    return isinstance(exc, ResponseError) and any(code in str(exc) for code in _REFUSED_WRITES)


def is_full(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command at its `maxmemory` (see the module docstring)."""
    return isinstance(exc, OutOfMemoryError)
