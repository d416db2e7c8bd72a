"""Which shard of a Redis Cluster holds each pool: pools spread evenly, one slot per pool.

Every key of a pool carries one hash tag, so the pool lives in one slot. Tagged by its id, a pool
lands where CRC16 of the id says (12 pools came out 6/3/3 on three masters). `ShardPlacement`
instead gives a new pool the tag `<pool>/<k>` with the smallest `k` whose slot a least-loaded
master serves (no pool id holds `/`, so no tag is another pool's). The choice is recorded in a
directory hash (`place_pool.lua`, acknowledged by a replica like every write a caller acts on:
a pool whose placement a failover forgot would be looked for elsewhere, as a new pool), and the
first service to record it wins, so every replica of the service finds a pool's keys in the same
place. A tag never changes: a pool stays where it was placed (resharding moves its slot whole).
On one server there is nothing to spread: the tag is the pool id and no directory is kept.
"""

from __future__ import annotations

from collections import Counter
from importlib import resources

from redis.crc import key_slot

from index.execution import LoadedScript, ReplicaAcks, run_script
from index.redis_link import BoundedCluster, RedisClient

DIRECTORY = "ct:{ct-placement}:pools"
_SCRIPT = LoadedScript((resources.files("index") / "lua" / "place_pool.lua").read_text())
_MAX_TRIES = 1 << 16  # 16,384 slots: a master's share is found long before


def tag_slot(tag: str) -> int:
    return key_slot(f"ct:{{{tag}}}:meta".encode())


class ShardPlacement:
    """The hash tag of each pool's keys on `redis` (cached: a tag never changes)."""

    def __init__(self, redis: RedisClient, acks: ReplicaAcks | None = None) -> None:
        self._redis = redis
        self._acks = acks
        self._tags: dict[str, str] = {}

    def cached(self, pool: str) -> str:
        """The tag `resolve` found; the pool id itself on one server."""
        return self._tags.get(pool, pool)

    async def resolve(self, pool: str, create: bool) -> str | None:
        """The pool's tag; with `create`, one is chosen for a pool never placed, otherwise
        None says the pool does not exist."""
        if not isinstance(self._redis, BoundedCluster):
            return pool
        if pool not in self._tags:
            tag = await self._redis.hget(DIRECTORY, pool)
            if tag is None:
                if not create:
                    return None
                tag = await run_script(self._redis, _SCRIPT, [DIRECTORY],
                                       [pool, await self._choose(pool)], self._acks)
            self._tags[pool] = tag.decode()
        return self._tags[pool]

    async def _choose(self, pool: str) -> str:
        """`<pool>/<k>` on a master serving the fewest placed pools (ties: by node name)."""
        cluster = self._redis
        assert isinstance(cluster, BoundedCluster)
        await cluster.initialize()
        placed = await cluster.hgetall(DIRECTORY)
        masters = sorted(node.name for node in cluster.get_primaries())
        load = Counter({name: 0 for name in masters})
        load.update(self._master(tag.decode()) for tag in placed.values())
        target = min(masters, key=lambda name: (load[name], name))
        for k in range(_MAX_TRIES):
            if self._master(tag := f"{pool}/{k}") == target:
                return tag
        raise RuntimeError(f"no tag of pool {pool!r} lands on {target}")

    def _master(self, tag: str) -> str:
        assert isinstance(self._redis, BoundedCluster)
        return self._redis.nodes_manager.get_node_from_slot(tag_slot(tag)).name
