"""The ACL of the redis-servers the project starts (`cachetier up`, its Redis Cluster).

The default user is off: a client that does not log in can run nothing (every connection starts
unauthenticated, and `default` has no password to log in with). It keeps its permissions though:
Redis replays its append-only file as the default user, and a `nocommands` default made every
script's MULTI/EXEC block fail to load (NOPERM) after a restart, the index silently emptied.
Three users:

- `cachetier`, the service: its pools' keys (`ct:*`) only, and only the commands it sends (the
  scripts by SHA or source, WAIT, the reads of `index.placement`, `index.store` and the storage
  identity, a cluster client's topology reads; SET on staging keys only, a selector, for a big
  step's hashes) and those its Lua scripts call (a script runs with its caller's permissions; a test
  reads every `redis.call` of index/lua against this list). No FLUSHALL, CONFIG, KEYS, DEBUG,
  SCRIPT FLUSH...;
- `replica`: what a replica needs of its master (PSYNC, REPLCONF, PING), the cluster nodes'
  `masteruser`;
- `operator`: everything, for `up` itself (joining the cluster nodes, readiness checks) and for
  a person inspecting a run.

Passwords are derived from the cluster secret (`ClusterCredentials.redis_password`) and stored
hashed (`#<sha256>`) in an ACL file readable by its owner only; the replicas' `masterauth` is in
a configuration file of the same mode. None is ever on a command line.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from cachetier.private_files import write_private

KEYS = "ct:*"
# sent by the service (index.execution, placement, store, routing, holder, service.recovery,
# health) and by redis-py's cluster client as it learns the topology
SERVICE_COMMANDS = ("fcall", "fcall_ro", "function|load", "evalsha", "eval", "evalsha_ro",
                    "eval_ro", "wait", "hget", "hgetall", "ping", "unlink",
                    "info", "command", "cluster|slots", "cluster|shards", "cluster|nodes",
                    "cluster|myid", "asking", "readonly")
# called by index/lua/*.lua
SCRIPT_COMMANDS = ("exists", "getrange", "hdel", "hexists", "hget", "hgetall", "hincrby", "hlen",
                   "hmget", "hset", "hsetnx", "llen", "lpop", "lrange", "rpush", "strlen", "unlink",
                   "zadd", "zrange", "zrangebyscore", "zrem", "zscore")
# a big step's hashes staged with an expiry (`index.execution.Staged`), on staging keys alone
STAGE_KEYS = "ct:*:stage:*"
STAGE_COMMANDS = ("set",)
REPLICA_COMMANDS = ("psync", "replconf", "ping")


@dataclass(frozen=True)
class RedisAcl:
    """The passwords of the three users."""

    service: str = field(repr=False)
    replica: str = field(repr=False)
    operator: str = field(repr=False)

    def acl_lines(self) -> list[str]:
        def user(name: str, password: str, rules: str) -> str:
            digest = hashlib.sha256(password.encode()).hexdigest()
            return f"user {name} on #{digest} {rules}"

        allowed = " ".join(f"+{command}" for command in (*SERVICE_COMMANDS, *SCRIPT_COMMANDS))
        staging = " ".join(f"+{command}" for command in STAGE_COMMANDS)
        replica = " ".join(f"+{command}" for command in REPLICA_COMMANDS)
        return ["user default off resetpass ~* &* +@all",  # off; the AOF loader's permissions
                user("cachetier", self.service,
                     f"~{KEYS} resetchannels -@all {allowed} (~{STAGE_KEYS} {staging})"),
                user("replica", self.replica, f"resetkeys resetchannels -@all {replica}"),
                user("operator", self.operator, "~* &* +@all")]

    def write(self, directory: Path) -> Path:
        """The ACL file and the configuration file that loads it (and gives replicas their
        login); returns the configuration file, redis-server's first argument."""
        acl = write_private(directory / "users.acl", "\n".join(self.acl_lines()) + "\n")
        return write_private(directory / "auth.conf", f"aclfile {acl}\nmasteruser replica\n"
                                                      f"masterauth {self.replica}\n")
