"""The client: typed results, multiplexing, timeouts, reconnection and cancellation safety.

`DelayingProxy` sits between the client and the service and holds the service's bytes back, so a
request can be cancelled or time out while its reply is on the way (redis-py's
`test_cwe_404.py` idea): the next call must get its own reply, never the abandoned one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest

from cachetier.client import CacheTierClient
from cachetier.errors import ConnectionLost, RemoteError, RequestTimeout
from cachetier.wire.framing import Endpoint
from cachetier.wire.protocol import HealthReport, PoolStats
from index.records import StepRefusal
from tests.cluster_harness import BLOCK, TOKEN, running_service
from tests.index_harness import new_request


class DelayingProxy:
    """A TCP proxy whose service-to-client direction waits `delay` seconds per chunk."""

    def __init__(self, target: str, delay: float) -> None:
        self.target = Endpoint.parse(target)
        self.delay = delay
        self.connections = 0
        self.url = ""
        self._pipes: set[asyncio.Task[None]] = set()
        self._sessions: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server, bound = await Endpoint.parse("tcp://127.0.0.1:0").listen(self._accept)
        self.url = bound.url

    async def drop_all(self) -> None:
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self.drop_all()
        await asyncio.gather(*self._sessions, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = asyncio.current_task()
        assert session is not None
        self._sessions.add(session)
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self.target.host, self.target.port)
        pipes = [asyncio.create_task(self._pipe(reader, up_writer, delayed=False)),
                 asyncio.create_task(self._pipe(up_reader, writer, delayed=True))]
        self._pipes.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
                self._pipes.discard(pipe)
            for side in (writer, up_writer):
                side.close()
                await side.wait_closed()
            self._sessions.discard(session)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    delayed: bool) -> None:
        while chunk := await reader.read(65536):
            if delayed:
                await asyncio.sleep(self.delay)
            writer.write(chunk)
            await writer.drain()


@pytest.fixture
async def proxy(service) -> AsyncIterator[DelayingProxy]:
    proxy = DelayingProxy(service.url, delay=0.05)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@pytest.fixture
async def slow_tier(proxy, agent) -> AsyncIterator[CacheTierClient]:
    async with CacheTierClient(proxy.url, token=TOKEN, timeout=5) as client:
        yield client


async def test_a_cancelled_request_never_hands_its_reply_to_the_next(slow_tier, proxy):
    rng = random.Random(4)
    for round_ in range(12):
        abandoned = asyncio.create_task(slow_tier.stats("p") if round_ % 2 else slow_tier.health())
        await asyncio.sleep(rng.uniform(0, 0.06))           # before, during or after the reply
        abandoned.cancel()
        if round_ % 2:
            assert isinstance(await slow_tier.health(), HealthReport)
        else:
            assert isinstance(await slow_tier.stats("p"), PoolStats)
    assert proxy.connections == 1   # nothing was half-read, so nothing had to be thrown away


async def test_a_timeout_is_retryable_and_the_connection_stays_usable(service, proxy):
    async with CacheTierClient(proxy.url, token=TOKEN, timeout=0.05) as tier:
        proxy.delay = 0.1
        with pytest.raises(RequestTimeout) as err:
            await tier.health()
        assert err.value.retryable
        proxy.delay = 0
        await asyncio.sleep(0.1)            # the late reply arrives with no one waiting for it
        report = await tier.health()
        assert isinstance(report, HealthReport) and proxy.connections == 1


async def test_concurrent_requests_share_one_connection(slow_tier, proxy):
    started = time.monotonic()
    calls = [slow_tier.stats("p") if i % 2 else slow_tier.health() for i in range(32)]
    results = await asyncio.gather(*calls)
    assert [type(r) for r in results] == [HealthReport, PoolStats] * 16
    assert proxy.connections == 1
    assert time.monotonic() - started < 32 * proxy.delay / 2   # in flight together, not in turn


async def test_a_dropped_connection_fails_what_is_in_flight_and_the_next_call_reconnects(
        slow_tier, proxy):
    proxy.delay = 0.5
    in_flight = asyncio.create_task(slow_tier.health())
    await asyncio.sleep(0.05)
    await proxy.drop_all()
    with pytest.raises(ConnectionLost) as err:
        await in_flight
    assert err.value.retryable
    proxy.delay = 0
    assert isinstance(await slow_tier.health(), HealthReport) and proxy.connections == 2


async def test_the_client_reconnects_to_a_restarted_service(redis, redis_url):
    async with running_service(redis_url) as first:
        url = first.url
        tier = CacheTierClient(url, token=TOKEN)
        before = await tier.health()
    async with running_service(redis_url, listen=url):
        after = await tier.health()
        assert after.server_id != before.server_id
        await tier.close()


async def test_a_unix_socket_serves_like_tcp(redis, redis_url, tmp_path):
    async with running_service(redis_url, listen=f"unix://{tmp_path}/ct.sock") as service:
        async with CacheTierClient(service.url, token=TOKEN) as tier:
            assert (await tier.health()).redis
    assert not (tmp_path / "ct.sock").exists()


async def test_no_service_is_a_retryable_connection_error(tmp_path):
    tier = CacheTierClient(f"unix://{tmp_path}/nobody.sock", token=TOKEN, connect_timeout=0.2)
    with pytest.raises(ConnectionLost) as err:
        await tier.health()
    assert err.value.retryable


async def test_a_step_the_pool_cannot_hold_is_refused_not_failed(tier, agent):
    huge = list(range(300 * 64))                       # more pages than the tiny pool has
    refusal = await tier.plan("p", [new_request("huge", huge, len(huge), BLOCK)])
    assert isinstance(refusal, StepRefusal) and refusal.pages_needed > refusal.pages_available


async def test_service_errors_arrive_typed(tier, agent):
    with pytest.raises(RemoteError) as err:
        await tier.confirm("p", 12345)
    assert (err.value.code, err.value.retryable) == ("unknown", True)
    with pytest.raises(RemoteError) as err:
        await tier.plan("p", [new_request("a", [1] * 40, 0, BLOCK)])
    assert (err.value.code, err.value.retryable) == ("bad_request", False)
