"""What a redis-server holds, so a test can prove an operation changed nothing; a redis-server
whose data outlives its process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from redis.asyncio import Redis

from cachetier.run.redis_auth import RedisAcl
from cachetier.run.servers import RedisServer


async def dump(redis: Redis) -> dict[bytes, bytes]:
    """Every key's serialized value: byte-for-byte equality means nothing changed."""
    return {k: await redis.dump(k) for k in sorted(await redis.keys("*"))}


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
