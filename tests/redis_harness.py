"""What a redis-server holds, so a test can prove an operation changed nothing."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis


async def dump(redis: Redis) -> dict[bytes, bytes]:
    """Every key's serialized value: byte-for-byte equality means nothing changed."""
    return {k: await redis.dump(k) for k in sorted(await redis.keys("*"))}


def all_keys(url: str) -> set[bytes]:
    """Every key of the server at `url`, from synchronous code (a CLI run in the test's thread)."""
    async def scan() -> set[bytes]:
        async with Redis.from_url(url) as client:
            return {key async for key in client.scan_iter()}
    return asyncio.run(scan())
