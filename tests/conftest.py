"""Shared fixtures: one real redis-server per test session, a clean database per test, and on it
a running service with its agent and a client holding the token.

The shared redis-server runs the production ACL (`run.redis_auth`, as `cachetier up` starts it):
`redis_url` logs in as the service's user, so every service and index under test runs with the
permissions it has in production (a step staged with a command the ACL lacked once failed only
there); `redis_operator` empties and inspects.

Never a mock of Redis: the Lua scripts are the system under test. If redis-server cannot start, the
fixture raises and every test that needs it errors loudly; nothing is skipped. Tests that start
several services or agents, or restart them, use `tests.cluster_harness` directly. The vLLM
tests share one tiny Qwen3-Next (`model_dir`), written once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from cachetier.client import CacheTierClient
from cachetier.run.redis_cluster import ClusterShape, LocalRedisCluster
from cachetier.run.servers import RedisServer
from cachetier.service.server import CacheTierService
from cachetier.vllm.tiny import write_tiny_qwen3_next
from gpu_pool.agent import Agent
from index.redis_link import packing_with_hiredis
from tests.cluster_harness import REDIS_ACL, TOKEN, as_service_user, running_agent, running_service


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The connector's tests (`test_vllm_*.py`) and any test taking the tiny vLLM model run
    vLLM: they are the `vllm` lane."""
    for item in items:
        if item.path.name.startswith("test_vllm_") or \
                "model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Next the vLLM tests serve, written once per session."""
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen"))


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The usual umask, 022, under which a file created without a mode is world-readable: a
    file found 0600 under it was made so on purpose."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(acl=REDIS_ACL) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A Redis Cluster of 3 masters with a replica each, shared by the tests that leave its
    topology as they found it (failover tests start their own), with the production ACL: log in
    with `SERVICE_LOGIN` or `OPERATOR_LOGIN`."""
    with LocalRedisCluster(ClusterShape(3, 1), acl=REDIS_ACL) as cluster:
        yield cluster


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server, logged in as the service's ACL user."""
    return as_service_user(redis_server.url)


@pytest.fixture
def operator_url(redis_server: RedisServer) -> str:
    """The shared server, logged in as the operator (every command)."""
    scheme, rest = redis_server.url.split("://", 1)
    return f"{scheme}://operator:{REDIS_ACL.operator}@{rest}"


def _client(url: str) -> Redis:
    """The blocking pool makes concurrent tests wait for a connection instead of failing over
    a cap."""
    return Redis(connection_pool=packing_with_hiredis(BlockingConnectionPool.from_url(
        url, max_connections=32, timeout=10, decode_responses=False)))


@pytest.fixture
async def redis_operator(operator_url: str) -> AsyncIterator[Redis]:
    """The operator's client on an empty database with no cached scripts, so every test proves
    its own loading; for emptying and inspecting what the service's user may not."""
    client = _client(operator_url)
    await client.flushall()
    await client.script_flush()
    await client.function_flush()
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.fixture
async def redis(redis_operator: Redis, redis_url: str) -> AsyncIterator[Redis]:
    """The service user's client on the emptied database: what the index runs as."""
    client = _client(redis_url)
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.fixture
async def service(redis: Redis, redis_url: str) -> AsyncIterator[CacheTierService]:
    """The service with the tiny preset on the clean database (`redis` is what empties it)."""
    async with running_service(redis_url) as service:
        yield service


@pytest.fixture
async def agent(service: CacheTierService) -> AsyncIterator[Agent]:
    """A CPU agent registered with `service` as rank 0 of pool "p"."""
    async with running_agent(service.url) as agent:
        yield agent


@pytest.fixture
async def tier(service: CacheTierService) -> AsyncIterator[CacheTierClient]:
    """A client of `service` holding the token."""
    async with CacheTierClient(service.url, token=TOKEN, timeout=10) as client:
        yield client
