"""Which storage instance holds a pool now: what `reconcile_pool` stamps in `meta.holder`.

The holder must change whenever the pool's storage may have lost writes that nobody saw (the
write count covers every write somebody saw, `index.identity`). On one server that is the run id,
new at every start: a restart from an older RDB or AOF, a restore, a restart empty.

On a Redis Cluster the pool lives on the master of its slot, so the holder is *that* master's,
never the answer of whichever node a client picks: the run id of the slot's master, with its
node id (`CLUSTER MYID`) in front to say which node it is. The run id decides, because it changes
in both ways a shard can lose writes: a failover promotes a replica (another process: another run
id and another node id) that may have missed the master's last writes, and a master restarted in
place from an older AOF or RDB keeps its node id (it is in `nodes.conf`) but not its run id. The
node id alone would miss the second. A holder read from a node that is no longer the slot's
master (a failover under way) is refused: the slot map is read again first, and a slot still
moving is a transient `ClusterError`, which the caller retries.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ClusterError

from index.redis_link import BoundedCluster, RedisClient

_TRIES = 3  # slot-map reads before a slot still moving is an error


async def storage_holder(redis: RedisClient, key: str) -> str:
    """The storage instance answering for `key` (any key of the pool) now."""
    if isinstance(redis, BoundedCluster):
        return await _slot_master(redis, key)
    return await _run_id(redis)


async def _run_id(redis: Redis) -> str:
    return str((await redis.info("server"))["run_id"])


async def _slot_master(cluster: BoundedCluster, key: str) -> str:
    await cluster.initialize()
    for _ in range(_TRIES):
        node = cluster.get_node_from_key(key, replica=False)
        info = await cluster.execute_command("INFO", "server", "replication", target_nodes=node)
        if info.get("role") == "master":
            myid = await cluster.execute_command("CLUSTER MYID", target_nodes=node)
            return f"{_text(myid)}/{info['run_id']}"
        await cluster.refresh_topology()
    raise ClusterError(f"the master of {key!r}'s slot is still changing")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
