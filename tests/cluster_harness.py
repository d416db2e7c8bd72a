"""Test helpers for the running cluster: the tiny preset, the cluster secret and the scheduler
credential derived from it (`TOKEN`: what test clients hold), a service and an agent
run as asyncio tasks in the test's own loop, and polling for a state that arrives asynchronously.

These are context managers rather than fixtures because tests start several services or agents,
restart them mid-test, or give them overrides; the plain fixtures in conftest.py are built on them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from cachetier import credentials
from cachetier.config import PRESETS, Config
from cachetier.credentials import Principal, Role, issue
from cachetier.run.redis_auth import RedisAcl
from cachetier.service.observer import ServiceObserver
from cachetier.service.server import CacheTierService, ServiceSettings
from gpu_pool.agent import Agent, AgentSettings
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys

SECRET = "test-secret"
# the users of every Redis the tests share, as `cachetier up` configures its own (`run.redis_auth`)
REDIS_ACL = RedisAcl(service="test-service-pw", replica="test-replica-pw",
                     operator="test-operator-pw")
TOKEN = issue(SECRET, Principal(Role.CLIENT))
TINY = PRESETS["tiny"]
BLOCK = TINY.cache.hash_block_tokens
PAGE = TINY.cache.page_tokens
T = TypeVar("T")


@contextlib.asynccontextmanager
async def running_service(redis_url: str, config: Config = TINY,
                          observer: ServiceObserver | None = None,
                          **overrides: Any) -> AsyncIterator[CacheTierService]:
    settings = ServiceSettings(redis_url=redis_url, secret=SECRET, config=config, **overrides)
    async with CacheTierService(settings, observer) as service:
        yield service


@contextlib.asynccontextmanager
async def running_agent(*urls: str, pool: str = "p", **overrides: Any) -> AsyncIterator[Agent]:
    token = agent_token(pool, overrides.get("rank", 0))
    agent = Agent(AgentSettings(urls, pool, token, reconnect_max_s=0.2, **overrides))
    task = asyncio.create_task(agent.run())
    try:
        registered = asyncio.create_task(agent.registered.wait())
        await asyncio.wait({task, registered}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        registered.cancel()
        if task.done():
            task.result()  # the run ended: raise why
        assert agent.registered.is_set(), "the agent did not register within 10 s"
        yield agent
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


SERVICE_LOGIN = {"username": "cachetier", "password": REDIS_ACL.service}
OPERATOR_LOGIN = {"username": "operator", "password": REDIS_ACL.operator}


def as_service_user(url: str) -> str:
    """`url` (redis://HOST:PORT or unix:///PATH) logged in as the service's ACL user, the way
    `cachetier up`'s service logs in: what the service and the index run as in the tests."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://cachetier:{REDIS_ACL.service}@{rest}"


def agent_token(pool: str = "p", rank: int = 0) -> str:
    """The credential of the agent of `pool`'s `rank`."""
    return issue(SECRET, credentials.agent(pool, rank))


async def eventually(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool]) -> T:
    """The first result of `probe` that is `done`, polled for up to 5 s."""
    async with asyncio.timeout(5):
        while not done(value := await probe()):
            await asyncio.sleep(0.01)
    return value


async def assert_no_pins(redis: Any, pool: str = "p", tag: str | None = None) -> None:
    """The tiny pool holds no request, no ticket and no pin, and its invariants hold (`tag`:
    where its placement put it on a cluster)."""
    state = await read_pool(redis, pool_keys(pool, tag))
    sanity_check(state, TINY.cache.num_pages, TINY.cache.blocks_per_page)
    assert state.req == {} and state.tix == {}
    assert all(rec.get("ref", 0) == 0 for rec in state.pages.values())
