"""A local Redis Cluster of throwaway redis-servers on loopback, for `cachetier up --redis-cluster`,
the tests and the benchmarks.

`LocalRedisCluster(ClusterShape(masters, replicas))` starts `masters x (1 + replicas)` cluster-mode
redis-servers (`ClusterNode`, each a `RedisServer` with its own directory, stopped with its
parent), joins them with `redis-cli --cluster create --cluster-replicas R --cluster-yes`, and
returns once every slot is served and every master has its replicas online. The settings are
the ones the index needs: `min-replicas-to-write 1` (a master left without a replica refuses
writes rather than accept what a failover would lose), `repl-diskless-sync-delay 0` (a new
replica resyncs at once, not after 5 s), and a short `cluster-node-timeout` (a dead master is
replaced within a few seconds). Two replicas per shard keep a shard writable after a failover:
the promoted master still has one.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self

import redis

from cachetier.run.redis_auth import RedisAcl
from cachetier.run.servers import LOOPBACK, RedisServer, find_binary, free_port

if TYPE_CHECKING:
    from cachetier.run.tls import TlsFiles

_READY_TIMEOUT_S = 30.0
_SHAPE = re.compile(r"^(\d+)(?:x(\d+))?$")


@dataclass(frozen=True)
class ClusterShape:
    """`masters` shards, each with `replicas` replicas; `parse("3x2")`, `parse("3")` (1 replica)."""

    masters: int = 3
    replicas: int = 2

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        if self.replicas < 0:
            raise ValueError("replicas must be >= 0")

    @classmethod
    def parse(cls, text: str) -> ClusterShape:
        match = _SHAPE.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not MASTERS[xREPLICAS], e.g. 3x2")
        return cls(int(match[1]), 1 if match[2] is None else int(match[2]))

    @property
    def nodes(self) -> int:
        return self.masters * (1 + self.replicas)


@dataclass(kw_only=True)
class ClusterNode(RedisServer):
    """A cluster-mode redis-server on a loopback TCP port (flags after the throwaway ones win)."""

    tcp: bool = True
    node_timeout_ms: int = 1000
    min_replicas: int = 1  # a master with fewer replicas online refuses writes

    def _command(self, workdir: Path) -> list[str]:
        # the bus port is given: the default, port + 10000, is out of range for high free ports
        return [*super()._command(workdir), "--cluster-enabled", "yes",
                "--cluster-port", str(free_port()),
                "--cluster-config-file", str(workdir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--min-replicas-to-write", str(self.min_replicas),
                "--repl-diskless-sync-delay", "0",
                *(["--tls-cluster", "yes", "--tls-replication", "yes"] if self.tls else [])]

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"


@dataclass
class LocalRedisCluster:
    """`with LocalRedisCluster(shape) as cluster:` a ready cluster inside the block, stopped after
    it (also when it fails to form). `make_node` builds each server (a subclass may log it)."""

    shape: ClusterShape = field(default_factory=ClusterShape)
    node_timeout_ms: int = 1000
    make_node: Callable[[int], ClusterNode] | None = None  # node i (None: a plain ClusterNode)
    maxmemory: int = 1 << 30  # per node (`RedisServer.maxmemory`): each may hold every pool
    acl: RedisAcl | None = None  # every node's users (`run.redis_auth`); replicas log in
    tls: TlsFiles | None = None  # every link TLS: clients, the cluster bus, replication
    nodes: list[ClusterNode] = field(default_factory=list, init=False)

    @property
    def startup_nodes(self) -> str:
        """`host:port,...` of every node, what `serve --redis-cluster` takes."""
        return ",".join(node.address for node in self.nodes)

    def start(self) -> Self:
        try:
            for i in range(self.shape.nodes):
                node = self.make_node(i) if self.make_node else ClusterNode()
                node.node_timeout_ms = self.node_timeout_ms
                node.min_replicas = min(1, self.shape.replicas)
                node.maxmemory = self.maxmemory
                node.acl, node.tls = self.acl, self.tls
                self.nodes.append(node)
                node.start()
            self._create()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        self.nodes.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _create(self) -> None:
        command = [find_binary("redis-cli"), "--cluster", "create",
                   *(node.address for node in self.nodes),
                   "--cluster-replicas", str(self.shape.replicas), "--cluster-yes"]
        env = None
        if self.tls is not None:
            command += ["--tls", "--cacert", str(self.tls.ca)]
        if self.acl is not None:  # the password from the environment, not the command line
            command += ["--user", "operator"]
            env = {**os.environ, "REDISCLI_AUTH": self.acl.operator}
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False,
                              env=env)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed:\n{done.stdout}{done.stderr}")

    def node(self, port: int) -> ClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def slot_map(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, master port) of every range, as the first live node sees it."""
        with self.live_nodes()[0].client() as client:
            return [(first, last, int(master[1])) for first, last, master, *_ in
                    client.execute_command("CLUSTER", "SLOTS")]

    def master_of_slot(self, slot: int,
                       slots: list[tuple[int, int, int]] | None = None) -> ClusterNode:
        """The node serving `slot` now (in `slots`, a `slot_map()` read before)."""
        for first, last, port in self.slot_map() if slots is None else slots:
            if first <= slot <= last:
                return self.node(port)
        raise RuntimeError(f"slot {slot} is not served")

    def roles(self) -> dict[int, int | None]:
        """Port -> the port of its master (None for a master), as live nodes see it now."""
        roles: dict[int, int | None] = {}
        for node in self.live_nodes():
            with node.client() as client:
                info = client.info("replication")
            roles[node.port] = None if info["role"] == "master" else int(info["master_port"])
        return roles

    def live_nodes(self) -> list[ClusterNode]:
        """The nodes still running (a test may kill some)."""
        return [node for node in self.nodes if node.running]

    def wait_ready(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        """Until every live node sees the cluster ok and each of `shape.masters` masters has
        `shape.replicas` replicas online (or as many as are still alive)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster was not ready within {timeout_s:g} s")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            for node in self.live_nodes():
                with node.client() as client:
                    if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                        return False
            roles = self.roles()
        except redis.RedisError:
            return False
        masters = [port for port, master in roles.items() if master is None]
        return len(masters) == self.shape.masters and all(
            self._replicas_online(port) == sum(1 for m in roles.values() if m == port)
            for port in masters)

    def _replicas_online(self, port: int) -> int:
        with self.node(port).client() as client:
            info = client.info("replication")
        return sum(1 for key, value in info.items()
                   if key.startswith("slave") and isinstance(value, dict)
                   and value.get("state") == "online")
