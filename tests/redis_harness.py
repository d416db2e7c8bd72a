"""What a redis-server holds, so a test can prove an operation changed nothing; a redis-server
whose data outlives its process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from cachetier.run.redis_auth import RedisAcl
from cachetier.run.servers import RedisServer


async def dump(redis: Redis) -> dict[bytes, tuple[bytes, Any]]:
    """Every key's type and whole content: equality means nothing changed. Not DUMP's bytes: a
    hash kept as a hash table (a pool's meta, whose packed `core` is past the listpack's value
    size) serializes in the table's iteration order, which any read of it may change, since a
    lookup takes a step of an incremental rehash."""
    readers: dict[bytes, Callable[[bytes], Awaitable[Any]]] = {
        b"string": redis.get, b"hash": redis.hgetall, b"set": redis.smembers,
        b"list": lambda key: redis.lrange(key, 0, -1),
        b"zset": lambda key: redis.zrange(key, 0, -1, withscores=True)}
    out = {}
    for key in sorted(await redis.keys("*")):
        kind = await redis.type(key)
        out[key] = (kind, await readers[kind](key))
    return out


def all_keys(url: str) -> set[bytes]:
    """Every key of the server at `url`, from synchronous code (a CLI run in the test's thread)."""
    async def scan() -> set[bytes]:
        async with Redis.from_url(url) as client:
            return {key async for key in client.scan_iter()}
    return asyncio.run(scan())


class AofRedis(RedisServer):
    """A TCP redis-server with every write fsynced to an append-only file in `data_dir`, which
    outlives the process: restarting it (same port, same directory) keeps the metadata, as the
    docker-compose deployment does."""

    def __init__(self, data_dir: Path, acl: RedisAcl | None = None) -> None:
        super().__init__(tcp=True, acl=acl)
        self.data_dir = data_dir

    def _command(self, workdir: Path) -> list[str]:
        command = super()._command(workdir)
        command[command.index("--appendonly") + 1] = "yes"
        command[command.index("--dir") + 1] = str(self.data_dir)
        return [*command, "--appendfsync", "always"]
