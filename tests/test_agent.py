"""The agent: its pool, its copy batches, its registrations and reconnections.

`ScriptedService` is the service end of the agent protocol driven by the test, to send batches
directly and to drop the agent at will; the other tests use the real service.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
from collections.abc import AsyncIterator

import pytest
import torch

from cachetier.cli import main
from cachetier.client import CacheTierClient
from cachetier.config import CacheSpec, Config
from cachetier.errors import ErrorCode, RemoteError
from cachetier.wire.channel import Channel
from cachetier.wire.framing import Endpoint, FramedStream
from cachetier.wire.protocol import (PROTOCOL_VERSION, AgentIdentity, CopyBatch, Fence, Hello,
                                     Register, Registered, Welcome, ok_frame, op_table,
                                     parse_request)
from gpu_pool import PagedPool
from gpu_pool.agent import Agent, AgentSettings
from gpu_pool.observer import AgentObserver
from tests.cluster_harness import (TINY, TOKEN, agent_token, eventually, running_agent,
                                   running_service)

PAGE_BYTES = TINY.geometry.page_bytes


class ScriptedService:
    """Accepts agents, registers them at `epoch` with the tiny geometry, and hands the test a
    `Channel` to each, to send copy batches on."""

    def __init__(self, epoch: int = 5) -> None:
        self.epoch = epoch
        self.registrations: list[Register] = []
        self.agents: asyncio.Queue[Channel] = asyncio.Queue()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server, bound = await Endpoint.parse("tcp://127.0.0.1:0").listen(self._accept)
        self.url = bound.url

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()

    async def next_agent(self) -> Channel:
        return await asyncio.wait_for(self.agents.get(), 10)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FramedStream(reader, writer)
        parse_request(await stream.read(), op_table(Hello))
        await stream.send(ok_frame(0, Welcome(PROTOCOL_VERSION, "scripted")))
        self.registrations.append(parse_request(await stream.read(), op_table(Register)))
        await stream.send(ok_frame(1, Registered(self.epoch, TINY.model, TINY.cache)))
        channel = Channel(stream, "scripted agent")
        await self.agents.put(channel)
        await channel.wait_closed()


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedService]:
    scripted = ScriptedService()
    await scripted.start()
    try:
        yield scripted
    finally:
        await scripted.close()


@pytest.fixture
async def agent_of(scripted) -> AsyncIterator[Agent]:
    async with running_agent(scripted.url) as agent:
        yield agent


def fill(view: PagedPool, page: int, seed: int) -> torch.Tensor:
    data = torch.randint(0, 256, view.buffer[:, page].shape, dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    view.buffer[:, page] = data
    return data


async def test_a_copy_batch_moves_bytes_in_every_layer_slot(scripted, agent_of):
    channel = await scripted.next_agent()
    view = PagedPool.attach(agent_of.handle())
    whole, part = fill(view, 1, seed=1), fill(view, 3, seed=3)
    await channel.request(CopyBatch(6, [(1, 2, 0, PAGE_BYTES), (3, 4, 128, 256)]))
    assert torch.equal(view.buffer[:, 2], whole)
    assert torch.equal(view.buffer[:, 4, 128:384], part[:, 128:384])
    assert not view.buffer[:, 4, :128].any() and not view.buffer[:, 4, 384:].any()
    assert agent_of.epoch == 6


async def test_a_bad_batch_is_refused_and_the_agent_keeps_serving(scripted, agent_of):
    channel = await scripted.next_agent()
    with pytest.raises(RemoteError) as err:
        await channel.request(CopyBatch(5, [(1, TINY.cache.num_pages, 0, 64)]))
    assert err.value.code == ErrorCode.BAD_REQUEST and "dst_page" in str(err.value)
    await channel.request(CopyBatch(5, [(1, 2, 0, 64)]))


async def test_a_fence_refuses_the_batches_of_older_epochs_and_leaves_their_pages_alone(
        scripted, agent_of):
    channel = await scripted.next_agent()
    view = PagedPool.attach(agent_of.handle())
    fill(view, 1, seed=1)
    assert await channel.request(Fence(7)) == 7
    assert view.fence.epoch() == 7  # the in-place writers' fence moved with it
    with pytest.raises(RemoteError) as err:
        await channel.request(CopyBatch(6, [(1, 2, 0, PAGE_BYTES)]))
    assert err.value.code == ErrorCode.STALE_EPOCH and err.value.retryable
    assert not view.buffer[:, 2].any()
    assert await channel.request(Fence(6)) == 7  # never lowered
    await channel.request(CopyBatch(8, [(1, 2, 0, PAGE_BYTES)]))  # a newer epoch fences first
    assert view.fence.epoch() == 8 and view.buffer[:, 2].any()


async def test_the_agent_reconnects_as_the_same_process_with_its_bytes(scripted, agent_of):
    first = await scripted.next_agent()
    handle = agent_of.handle()
    await first.close()                                  # the service drops the agent
    await scripted.next_agent()
    fresh, again = scripted.registrations
    assert fresh.epoch is None and again.epoch == scripted.epoch   # not new bytes the 2nd time
    assert again.agent_id == fresh.agent_id and agent_of.handle() == handle


async def test_the_observer_hears_each_registration(scripted):
    heard = []

    class Recorder(AgentObserver):
        def registered(self, identity: AgentIdentity, url: str, epoch: int) -> None:
            heard.append((identity.pool, identity.rank, url, epoch))

    agent = Agent(AgentSettings((scripted.url,), "p", agent_token()), Recorder())
    run = asyncio.create_task(agent.run())
    try:
        await (await scripted.next_agent()).close()
        await scripted.next_agent()
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    assert heard == [("p", 0, scripted.url, scripted.epoch)] * 2


async def test_the_pool_is_shared_through_a_private_handle_file_removed_at_exit(service, tmp_path,
                                                                               usual_umask):
    """Whoever reads the handle maps the pool and can overwrite its pages: only the agent's
    user reads it (0600)."""
    handle_file = tmp_path / "pool.handle"
    async with running_agent(service.url, handle_file=handle_file) as agent:
        assert stat.S_IMODE(handle_file.stat().st_mode) == 0o600
        handle = pickle.loads(handle_file.read_bytes())
        assert handle == agent.handle()
        assert (handle.model, handle.cache) == (TINY.model, TINY.cache)
        worker = PagedPool.attach(handle)
        worker.buffer[:, 7] = 42
        assert bool((agent.pool.buffer[:, 7] == 42).all())
    assert not handle_file.exists()
    assert not os.path.exists(handle.data.path) and not os.path.exists(handle.tags.path)


async def test_a_restarted_service_gets_the_agent_back_in_the_same_epoch(redis, redis_url):
    async with running_service(redis_url) as first:
        url = first.url
        async with running_agent(url) as agent:
            epoch = agent.epoch
            await first.close()
            async with running_service(redis_url, listen=url):
                async with CacheTierClient(url, token=TOKEN) as tier:
                    await eventually(tier.health, lambda h: h.pools == {"p": [0]})
                    assert (await tier.stats("p")).epoch == epoch == agent.epoch


async def test_a_restarted_agent_starts_a_new_epoch(service):
    async with running_agent(service.url) as first:
        pass
    async with running_agent(service.url) as second:
        assert second.epoch == first.epoch + 2              # its loss, then its fresh bytes


OTHER_GEOMETRY = Config(TINY.model, CacheSpec(**{**TINY.cache.__dict__, "num_pages": 128}))


@pytest.mark.parametrize("overrides, code", [
    ({"token": "wrong"}, ErrorCode.UNAUTHORIZED),
    ({"tp_degree": 2}, ErrorCode.BAD_REQUEST),
], ids=["token", "tp_degree"])
async def test_a_refusal_retrying_cannot_fix_ends_the_run(service, overrides, code):
    settings = AgentSettings((service.url,), "p", **{"token": agent_token(), **overrides})
    with pytest.raises(RemoteError) as err:
        await asyncio.wait_for(Agent(settings).run(), 10)
    assert err.value.code == code


async def test_a_pool_of_another_geometry_is_refused(service, redis_url):
    async with running_agent(service.url):
        pass                                                 # pool "p" exists, tiny geometry
    async with running_service(redis_url, config=OTHER_GEOMETRY) as other:
        settings = AgentSettings((other.url,), "p", agent_token())
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(Agent(settings).run(), 10)
        assert err.value.code == ErrorCode.CONFLICT


@pytest.mark.parametrize("threads", [1, 3])
async def test_an_agent_runs_torch_on_the_threads_it_is_given(service, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(2)                                 # neither setting under test
    try:
        overrides = {} if threads == 1 else {"torch_threads": threads}   # 1 is the default
        async with running_agent(service.url, **overrides):
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_a_torch_thread_count_below_one_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("CACHETIER_TOKEN", TOKEN)
    assert main(["agent", "--service", "tcp://127.0.0.1:1", "--pool", "p",
                 "--torch-threads", "0"]) == 2
    assert "cachetier: --torch-threads:" in capsys.readouterr().err
