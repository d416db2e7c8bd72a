"""Shared fixtures: one real redis-server per test session, a clean database per test.

Never a mock of Redis: the Lua scripts are the system under test. If redis-server cannot start, the
fixture raises and every test that needs it errors loudly; nothing is skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from cachetier.run.servers import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client on an empty database with no cached scripts, so every test proves its own loading.

    The blocking pool makes concurrent tests wait for a connection instead of failing over a cap.
    """
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=32, timeout=10,
                                           decode_responses=False)
    client = Redis(connection_pool=pool)
    await client.flushall()
    await client.script_flush()
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)
