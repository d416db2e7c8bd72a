"""The service against a real redis-server, with real or scripted agents and the real client.

In-process (asyncio tasks) for speed; `test_cli_serve_and_agent_end_to_end` runs the two commands
as processes. `ScriptedAgent` speaks the agent protocol with answers the test decides, to fail a
step at a chosen moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import pickle
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, ErrorCode, ErrorInfo, PeerClosed, RemoteError
from cachetier.event_loops import LOOPS
from cachetier.events.cache_events import AllBlocksCleared, BlockStored, EventSubscriber
from cachetier.events.liveness import LivenessWatcher
from cachetier.run.nodes import run_agent, run_service
from cachetier.run.servers import MosquittoServer, RedisServer, parent_death_hook
from cachetier.service.observer import ServiceObserver
from cachetier.service.server import ServiceSettings
from cachetier.wire.channel import exchange
from cachetier.wire.framing import HEADER, Endpoint, FramedStream, encode_frame
from cachetier.wire.protocol import (CLIENT_OPS, PROTOCOL_VERSION, CopyBatch, HealthReport, Hello,
                                     Register, Registered, Reply, error_frame, from_wire, ok_frame,
                                     parse_reply, parse_request)
from gpu_pool import PagedPool
from gpu_pool.agent import AgentSettings
from index.hashing import chain_hashes, split_hashes
from index.lifecycle import RequestLifecycle
from index.records import RequestPlan, StepPlan
from index.snapshot import read_pool
from index.store import pool_keys
from index.tickets import split
from tests.cluster_harness import (BLOCK, PAGE, SECRET, TINY, TOKEN, agent_token, assert_no_pins,
                                   eventually, running_agent, running_service)
from tests.index_harness import ROOT, commit_item, new_request, only
from tests.redis_harness import dump

DOC = [11 + (7 * i) % 1000 for i in range(400)]


class ScriptedAgent:
    """An agent at the protocol level that answers copy batches as the test says. Fences, and
    batches that only claim pages (a cold step's: `gpu_pool.claims`), are acknowledged as a real
    agent with nothing in flight does, by a reader of its own that hands every other frame to
    `next_copy`."""

    def __init__(self, stream: FramedStream, registered: Registered) -> None:
        self.stream = stream
        self.registered = registered
        self.fences: list[int] = []
        self._frames: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def register(cls, stream: FramedStream, pool: str = "p",
                       epoch: int | None = None) -> ScriptedAgent:
        await exchange(stream, 0, Hello(PROTOCOL_VERSION, agent_token(pool), "agent"))
        registered = await exchange(stream, 1, Register(pool, 0, 1, "scripted", epoch))
        return cls(stream, registered)

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.stream.read()
                if frame.get("op") == "fence":
                    self.fences.append(frame["epoch"])
                    await self.stream.send(ok_frame(frame["id"], frame["epoch"]))
                elif frame.get("op") == "copy" and not frame["copies"]:
                    await self.stream.send(ok_frame(frame["id"], None))
                else:
                    await self._frames.put(frame)
        except (CacheTierError, OSError):  # closed by either side
            await self._frames.put(None)

    async def next_copy(self) -> tuple[int, CopyBatch]:
        frame = await asyncio.wait_for(self._frames.get(), 10)
        assert frame is not None, "the service closed the connection"
        return frame["id"], parse_request(frame, {"copy": CopyBatch})

    async def ack(self, rid: int) -> None:
        await self.stream.send(ok_frame(rid, None))

    async def refuse(self, rid: int, message: str) -> None:
        await self.stream.send(error_frame(rid, ErrorInfo(ErrorCode.BAD_REQUEST, message, False)))

    async def closed_by_service(self) -> bool:
        """Whether the service closes the connection (within 10 s) rather than sending a frame."""
        return await asyncio.wait_for(self._frames.get(), 10) is None


async def closed(stream: FramedStream) -> bool:
    """Whether the peer closes the connection (within 10 s) rather than sending a frame."""
    try:
        await asyncio.wait_for(stream.read(), 10)
    except PeerClosed:
        return True
    return False


class Worker:
    """Plays the inference worker attached to the agent's pool: the forward pass writes each
    token's latent into the MLA pages and a state into the checkpoint pages."""

    def __init__(self, view: PagedPool) -> None:
        self.view = view
        self.written: dict[int, torch.Tensor] = {}

    def forward(self, plan: RequestPlan, tokens: list[int]) -> None:
        for group in plan.mla_pages:
            for pos in range(plan.start, plan.stop):
                self.view.mla_view(group[pos // PAGE])[:, pos % PAGE, :] = float(tokens[pos])
        for page in plan.checkpoint_pages:
            state = torch.randint(0, 256, self.view.buffer[:, page].shape, dtype=torch.uint8)
            self.view.buffer[:, page] = state
            self.written[page] = state

    def scribble_except(self, keep: set[int]) -> None:
        """Garbage in every other page, so bytes found later got there by a copy."""
        for page in range(self.view.layout.num_pages):
            if page not in keep:
                self.view.buffer[:, page] = 0xAB


async def serve_prompt(tier: CacheTierClient, rid: str, tokens: list[int],
                       worker: Worker | None = None, pool: str = "p") -> RequestPlan:
    """A whole prompt in one step the way an engine runs it, then released."""
    async with RequestLifecycle(tier.pool(pool)) as steps:
        step = only(await steps.plan([new_request(rid, tokens, len(tokens), BLOCK)]))
        if worker is not None:
            worker.forward(step, tokens)
        await steps.finish([commit_item(step, step.stop, True, True, BLOCK)])
    return step


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[str], Awaitable[FramedStream]]]:
    """Opens raw connections for the test and closes them after it."""
    streams: list[FramedStream] = []

    async def open_stream(url: str) -> FramedStream:
        streams.append(await Endpoint.parse(url).connect())
        return streams[-1]

    yield open_stream
    for stream in streams:
        await stream.close()


@pytest.fixture
def worker(agent) -> Worker:
    return Worker(PagedPool.attach(agent.handle()))


async def test_a_hit_restores_the_checkpoint_bytes_on_the_agent(tier, worker, redis):
    first = await serve_prompt(tier, "a", DOC[:100], worker)
    assert first.hit_tokens == 0 and first.checkpoint_tokens == 96
    worker.scribble_except(set(first.checkpoint_pages) | set(first.mla_pages[0]))
    probe = DOC[:100] + [1, 2, 3]
    plan = await tier.plan("p", [new_request("b", probe, len(probe), BLOCK)])
    (step,) = plan.requests
    assert step.hit_tokens == step.start == 96
    view = worker.view
    restores = [c for c in step.copies if c.dst in step.state_pages]
    assert [c.src for c in restores] == first.checkpoint_pages
    for c in restores:  # both parts of every layer's state; the page's padding is not state
        assert c.nbytes == view.layout.geometry.kda_page_bytes
        assert torch.equal(view.buffer[:, c.dst, :c.nbytes], worker.written[c.src][:, :c.nbytes])
    (cow,) = [c for c in step.copies if c.dst not in step.state_pages]
    assert cow.src == first.mla_pages[0][1] and cow.nbytes == 32 * TINY.model.mla_token_bytes
    expected = torch.tensor(DOC[64:96], dtype=torch.float32)[None, :, None]
    assert torch.equal(view.mla_view(cow.dst)[:, :32], expected.expand(2, 32, 16))
    await tier.release("p", ["b"])
    await assert_no_pins(redis)


async def test_stats_and_health_describe_the_pool(tier, agent):
    await serve_prompt(tier, "a", DOC[:100])
    stats = await tier.stats("p")
    assert (stats.pool, stats.epoch, stats.requests, stats.ranks) == ("p", agent.epoch, 0, [0])
    # 2 MLA pages and a 3-page checkpoint cached; leaf-first, the full first page is not evictable
    assert (stats.free_pages, stats.evictable_pages) == (TINY.cache.num_pages - 5, 4)
    health = await tier.health()
    assert health.redis and health.pools == {"p": [0]} and health.version == PROTOCOL_VERSION


async def test_a_pool_without_its_agent_refuses_to_plan_and_changes_nothing(service, tier, redis,
                                                                            redis_operator):
    async with running_agent(service.url) as gone:
        pass  # the pool exists; its only agent is gone
    await eventually(lambda: tier.stats("p"), lambda s: s.epoch == gone.epoch + 1)
    before = await dump(redis_operator)
    with pytest.raises(RemoteError) as err:
        await tier.plan("p", [new_request("a", DOC[:40], 40, BLOCK)])
    assert err.value.code == ErrorCode.AGENT_UNAVAILABLE and err.value.retryable
    with pytest.raises(RemoteError) as err:
        await tier.plan("nowhere", [new_request("a", DOC[:40], 40, BLOCK)])
    assert err.value.code == ErrorCode.UNKNOWN_POOL and not err.value.retryable
    assert await dump(redis_operator) == before


async def cached_then_probe(tier: CacheTierClient) -> asyncio.Task[Any]:
    """Cache a prompt (a cold step needs no copies), then start a step that must restore it."""
    await serve_prompt(tier, "a", DOC[:100])
    probe = DOC[:100] + [5]
    return asyncio.create_task(tier.plan("p", [new_request("b", probe, len(probe), BLOCK)]))


async def test_an_agent_dropping_mid_copy_fails_the_step_and_starts_an_epoch(
        service, tier, redis, connect):
    scripted = await ScriptedAgent.register(await connect(service.url))
    step = await cached_then_probe(tier)
    await scripted.next_copy()
    await scripted.stream.close()
    with pytest.raises(RemoteError) as err:
        await step
    assert err.value.code == ErrorCode.AGENT_LOST and err.value.retryable
    assert (await read_pool(redis, pool_keys("p"))).epoch == scripted.registered.epoch + 1
    await assert_no_pins(redis)
    # a restarted agent: its bytes are new, so a new epoch again
    replacement = await ScriptedAgent.register(await connect(service.url))
    assert replacement.registered.epoch == scripted.registered.epoch + 2
    cold = await tier.plan("p", [new_request("c", DOC[:100], 100, BLOCK)])
    assert cold.epoch == replacement.registered.epoch and cold.requests[0].hit_tokens == 0


async def test_a_copy_timeout_releases_the_step_and_drops_the_agent(redis, redis_url, connect):
    async with running_service(redis_url, copy_timeout_s=0.2) as service:
        async with CacheTierClient(service.url, token=TOKEN) as tier:
            scripted = await ScriptedAgent.register(await connect(service.url))
            step = await cached_then_probe(tier)
            await scripted.next_copy()             # ... and never acknowledged
            with pytest.raises(RemoteError) as err:
                await step
            assert err.value.code == ErrorCode.COPY_TIMEOUT and err.value.retryable
            assert await scripted.closed_by_service()
            assert (await tier.stats("p")).epoch == scripted.registered.epoch + 1
            await assert_no_pins(redis)


async def test_a_refused_copy_batch_releases_the_step_and_keeps_the_epoch(
        service, tier, redis, connect):
    scripted = await ScriptedAgent.register(await connect(service.url))
    step = await cached_then_probe(tier)
    rid, batch = await scripted.next_copy()
    assert batch.epoch == scripted.registered.epoch and len(batch.copies) == 4
    await scripted.refuse(rid, "page out of range")
    with pytest.raises(RemoteError) as err:
        await step
    assert err.value.code == ErrorCode.COPY_FAILED and err.value.retryable
    assert "page out of range" in str(err.value)
    await assert_no_pins(redis)
    assert (await tier.stats("p")).epoch == scripted.registered.epoch


async def test_a_liveness_report_fails_steps_in_flight_unless_it_is_about_an_old_process(
        service, tier, redis, connect):
    scripted = await ScriptedAgent.register(await connect(service.url))
    epoch = scripted.registered.epoch
    step = await cached_then_probe(tier)
    await scripted.next_copy()
    await service.agent_lost("p", 0, agent_id="an-earlier-process")
    assert not step.done() and (await tier.stats("p")).epoch == epoch
    await service.agent_lost("p", 0, agent_id="scripted")
    with pytest.raises(RemoteError) as err:
        await step
    assert err.value.code == ErrorCode.AGENT_LOST and err.value.retryable
    assert (await tier.stats("p")).epoch == epoch + 1
    assert await scripted.closed_by_service()
    await service.agent_lost("p", 0, agent_id="scripted")   # the same death, reported again
    assert (await tier.stats("p")).epoch == epoch + 1
    await assert_no_pins(redis)


class Recorder(ServiceObserver):
    def __init__(self) -> None:
        self.heard: list[tuple[str, Any]] = []

    def step_planned(self, pool: str, plan: StepPlan) -> None:
        self.heard.append(("planned", split(plan.ticket)[0]))  # the counter

    def committed(self, pool: str, result: Any) -> None:
        self.heard.append(("committed", split(result.ticket)[0]))

    def released(self, pool: str, result: Any) -> None:
        self.heard.append(("released", result.released))

    def invalidated(self, pool: str, epoch: int) -> None:
        self.heard.append(("invalidated", epoch))


async def test_the_observer_hears_every_change_of_a_pool(redis, redis_url):
    recorder = Recorder()
    async with running_service(redis_url, observer=recorder) as service:
        async with CacheTierClient(service.url, token=TOKEN) as tier:
            async with running_agent(service.url):
                await serve_prompt(tier, "a", DOC[:40])
            await eventually(lambda: tier.stats("p"), lambda s: s.epoch == 3)
    assert recorder.heard == [("invalidated", 2), ("planned", 1), ("committed", 2),
                              ("released", 1), ("invalidated", 3)]


async def test_with_a_broker_the_cluster_publishes_events_and_presence(redis, redis_url):
    lost: asyncio.Queue[tuple[str, int, str]] = asyncio.Queue()

    async def on_lost(pool: str, rank: int, agent_id: str) -> None:
        await lost.put((pool, rank, agent_id))

    async def online() -> dict[tuple[str, int], Any]:
        return watcher.online_agents()

    with MosquittoServer() as broker:
        async with EventSubscriber(broker.url, "p") as events, \
                LivenessWatcher(broker.url, on_lost, settle_s=0.1) as watcher:
            ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            settings = ServiceSettings(redis_url, SECRET, TINY)
            serve = asyncio.create_task(run_service(settings, ready.set_result, broker.url))
            agent_settings = AgentSettings((await asyncio.wait_for(ready, 10),), "p",
                                           agent_token())
            agent = asyncio.create_task(run_agent(agent_settings, broker.url))
            try:
                first = await asyncio.wait_for(events.get(), 10)   # the agent's fresh bytes
                assert first.batch.events == [AllBlocksCleared(2)] and first.missed == 0
                status = await eventually(online, lambda a: ("p", 0) in a and a["p", 0].epoch)
                assert status["p", 0].agent_id == agent_settings.agent_id
                tokens = list(range(3 * BLOCK + 1))
                async with CacheTierClient(ready.result(), token=TOKEN) as tier:
                    await serve_prompt(tier, "stored", tokens)
                hashes = split_hashes(chain_hashes(tokens, ROOT, BLOCK))
                stored = (await asyncio.wait_for(events.get(), 10)).batch.events
                assert stored == [BlockStored(hashes, None, BLOCK, "mla"),
                                  BlockStored([hashes[-1]], None, BLOCK, "kda")]
                agent.cancel()
                await asyncio.gather(agent, return_exceptions=True)
                assert await asyncio.wait_for(lost.get(), 10) == ("p", 0, agent_settings.agent_id)
                second = await asyncio.wait_for(events.get(), 10)  # its loss
                assert second.batch.events == [AllBlocksCleared(3)]
            finally:
                for task in (agent, serve):
                    task.cancel()
                await asyncio.gather(agent, serve, return_exceptions=True)


async def test_replicas_share_the_pool_through_redis(redis, redis_url):
    async with running_service(redis_url) as one, running_service(redis_url) as two:
        async with running_agent(one.url, two.url) as agent:
            worker = Worker(PagedPool.attach(agent.handle()))
            async with CacheTierClient(one.url, token=TOKEN) as a, \
                    CacheTierClient(two.url, token=TOKEN) as b:
                # `running_agent` returns once the agent registered with one of them; each
                # service's ranks are the agents registered with it
                for tier in (a, b):
                    await eventually(lambda: tier.stats("p"), lambda s: s.ranks == [0])
                await serve_prompt(a, "a", DOC[:100], worker)
                probe = DOC[:100] + [9]
                plan = await b.plan("p", [new_request("b", probe, len(probe), BLOCK)])
                assert plan.requests[0].hit_tokens == 96
                assert (await a.health()).server_id != (await b.health()).server_id


async def test_a_bad_token_is_refused_and_the_connection_closed(service, redis, connect,
                                                                redis_operator):
    before = await dump(redis_operator)
    stream = await connect(service.url)
    with pytest.raises(RemoteError) as err:
        await exchange(stream, 0, Hello(PROTOCOL_VERSION, "wrong"))
    assert err.value.code == ErrorCode.UNAUTHORIZED and not err.value.retryable
    assert await closed(stream)
    with pytest.raises(RemoteError, match="bad credential"):
        async with CacheTierClient(service.url, token="wrong"):
            pass
    assert await dump(redis_operator) == before


@pytest.mark.parametrize("first, code", [
    (Hello(PROTOCOL_VERSION + 1, TOKEN), ErrorCode.VERSION),
    (Register("p", 0, 1, "x"), ErrorCode.HANDSHAKE),
])
async def test_the_handshake_comes_first(service, connect, first, code):
    stream = await connect(service.url)
    with pytest.raises(RemoteError) as err:
        await exchange(stream, 0, first)
    assert err.value.code == code
    assert await closed(stream)


@pytest.mark.parametrize("register, code", [
    (Register("p", 1, 1, "x"), ErrorCode.BAD_REQUEST),           # rank outside tp_degree
    (Register("p", 0, 2, "x"), ErrorCode.BAD_REQUEST),           # another tp_degree
    (Register("bad pool id!", 0, 1, "x"), ErrorCode.BAD_REQUEST),
])
async def test_a_registration_that_does_not_fit_is_refused(service, redis_operator, connect,
                                                           register, code):
    stream = await connect(service.url)
    await exchange(stream, 0, Hello(PROTOCOL_VERSION, agent_token(register.pool, register.rank),
                                    "agent"))
    with pytest.raises(RemoteError) as err:
        await exchange(stream, 1, register)
    assert err.value.code == code and not err.value.retryable
    assert await redis_operator.keys("*") == []


async def read_reply(proc: subprocess.Popen[str], pattern: str) -> re.Match[str]:
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
    match = re.search(pattern, line)
    assert match, f"unexpected output {line!r}"
    return match


async def wait_for_file(path: Path, proc: subprocess.Popen[str]) -> None:
    for _ in range(600):
        if path.exists():
            return
        assert proc.poll() is None, f"the agent exited with {proc.returncode}"
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} did not appear")


def cli(*args: str, **env: str) -> subprocess.Popen[str]:
    """`cachetier ARGS` as a child that gets SIGTERM if this process dies (no orphans)."""
    return subprocess.Popen([sys.executable, "-m", "cachetier.cli", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, **env},
                            preexec_fn=parent_death_hook())


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    """Signal `proc` and reap it, killing it if it does not exit in time."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("loop", LOOPS)
async def test_cli_serve_and_agent_end_to_end(tmp_path, loop):
    """On each event loop `--loop` offers: serving, copies, and a clean stop on SIGTERM."""
    handle_file = tmp_path / "pool.handle"
    with RedisServer() as redis_server:
        (tmp_path / "secret").write_text(SECRET + "\n")  # compose's way: a secret file
        serve = cli("serve", "--redis", redis_server.url, "--listen", "tcp://127.0.0.1:0",
                    "--preset", "tiny", "--secret-file", str(tmp_path / "secret"), "--loop", loop)
        agent = None
        try:
            url = (await read_reply(serve, r"listening on (\S+)"))[1]
            agent = cli("agent", "--service", url, "--pool", "p", "--handle-file", str(handle_file),
                        "--loop", loop, CACHETIER_TOKEN=agent_token())
            await wait_for_file(handle_file, agent)
            handle = pickle.loads(handle_file.read_bytes())
            worker = Worker(PagedPool.attach(handle))
            async with CacheTierClient(url, token=TOKEN) as tier:
                first = await serve_prompt(tier, "a", DOC[:100], worker)
                probe = DOC[:100] + [4]
                plan = await tier.plan("p", [new_request("b", probe, len(probe), BLOCK)])
                restore = plan.requests[0].copies[0]
                assert restore.src == first.checkpoint_pages[0]
                assert restore.nbytes == worker.view.layout.geometry.kda_page_bytes
                assert torch.equal(worker.view.buffer[:, restore.dst, :restore.nbytes],
                                   worker.written[restore.src][:, :restore.nbytes])
            assert stop(agent) == 0 and stop(serve) == 0
        finally:
            for proc in (agent, serve):
                if proc is not None:
                    stop(proc, signal.SIGKILL)
    assert not handle_file.exists()
    assert not os.path.exists(handle.data.path) and not os.path.exists(handle.tags.path)


# Bad input: thousands of random and mutated frames against a live service. Frames that happen to
# decode into a valid request are pointed at a pool that does not exist, so every frame sent to the
# warm pool is bad input, which must leave Redis byte for byte as it was.

WARM = "warm-pool-0"
GHOST = "zz-no-such-pool"
HASHES = new_request("x", DOC[:48], 48, BLOCK).hashes
VALID_BODIES = [
    {"op": "plan", "pool": WARM, "requests": [
        {"rid": "r-new", "compute_tokens": 48, "prompt_tokens": 48, "hashes": HASHES}]},
    {"op": "plan", "pool": WARM, "requests": [{"rid": "r-mid", "compute_tokens": 4}]},
    {"op": "commit", "pool": WARM, "items": [{"rid": "r-mid", "stop": 8, "checkpoint_tokens": 0}]},
    {"op": "confirm", "pool": WARM, "ticket": 1},
    {"op": "release", "pool": WARM, "rids": ["r-mid"]},
    {"op": "stats", "pool": WARM},
    {"op": "health"},
]
SEMANTICALLY_BAD = [  # well-typed, refused by the index before any write
    {"op": "plan", "pool": WARM, "requests": [{"rid": "r-new", "compute_tokens": 0,
                                              "prompt_tokens": 48, "hashes": HASHES}]},
    {"op": "plan", "pool": WARM, "requests": [{"rid": "r-new", "compute_tokens": 48,
                                              "prompt_tokens": 64, "hashes": HASHES}]},
    {"op": "plan", "pool": WARM, "requests": [{"rid": "r-unknown", "compute_tokens": 4}]},
    {"op": "plan", "pool": WARM, "requests": [{"rid": "", "compute_tokens": 4}]},
    {"op": "plan", "pool": WARM, "requests": [
        {"rid": "r-new", "compute_tokens": 48, "prompt_tokens": 48, "hashes": HASHES}] * 2},
    {"op": "commit", "pool": WARM, "items": [{"rid": "r-mid", "stop": 99}]},
    {"op": "commit", "pool": WARM, "items": [{"rid": "r-nobody", "stop": 8}]},
    {"op": "confirm", "pool": WARM, "ticket": 10**9},
    {"op": "plan", "pool": "bad pool id!", "requests": []},
]

wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


def container_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else []
    for key, child in items:
        if isinstance(child, (dict, list)):
            found += container_paths(child, (*prefix, key))
    return found


def decodes(frame: dict) -> bool:
    try:
        parse_request(frame, CLIENT_OPS)
    except (ValueError, LookupError):
        return False
    return True


@st.composite
def mutated_frame(draw: st.DrawFn) -> dict:
    frame = copy.deepcopy(draw(st.sampled_from(VALID_BODIES)))
    frame["id"] = draw(st.integers(0, 2**31))
    container = frame
    for key in draw(st.sampled_from(container_paths(frame))):
        container = container[key]
    keys = list(container.keys() if isinstance(container, dict) else range(len(container)))
    how = draw(st.sampled_from(["replace", "drop", "add", "op"]))
    if how == "op":
        frame["op"] = draw(st.sampled_from(["hello", "register", "copy", "", "PLAN"]) | st.text())
    elif how == "add" and isinstance(container, dict):
        container[draw(st.text(max_size=6))] = draw(wire_values)
    elif keys and how == "drop":
        del container[draw(st.sampled_from(keys))]
    elif keys:
        container[draw(st.sampled_from(keys))] = draw(wire_values)
    if decodes(frame) and "pool" in frame:
        frame["pool"] = GHOST  # a valid request after all: it must not touch the warm pool
    return frame


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    body = draw(mutated_frame() | wire_values
                | st.sampled_from(SEMANTICALLY_BAD).map(lambda b: {**b, "id": 7}))
    return encode_frame(body)


@st.composite
def stream_breaker(draw: st.DrawFn) -> bytes:
    """Bytes after which the stream is out of step, or a ghost-pool frame with bytes flipped."""
    kind = draw(st.sampled_from(["garbage", "length", "flipped"]))
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=64))
    if kind == "length":
        return HEADER.pack(draw(st.integers(0, 2**32 - 1))) + draw(st.binary(max_size=32))
    body = {**draw(st.sampled_from(VALID_BODIES)), "id": 3}
    data = bytearray(encode_frame({**body, "pool": GHOST} if "pool" in body else body))
    for _ in range(draw(st.integers(1, 3))):
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(data)


async def send_and_drain(url: str, payload: bytes) -> list[Reply]:
    """Send `payload` after a valid hello, close our side, read every reply until the service
    closes the connection."""
    stream = await Endpoint.parse(url).connect()
    try:
        await exchange(stream, 0, Hello(PROTOCOL_VERSION, TOKEN))
        stream.writer.write(payload)
        stream.writer.write_eof()
        replies = []
        with contextlib.suppress(PeerClosed):
            async with asyncio.timeout(5):
                while True:
                    replies.append(parse_reply(await stream.read()))
        return replies
    finally:
        await stream.close()


@pytest.fixture
async def warm_pool(service, redis, tier) -> AsyncIterator[None]:
    """A pool with cached content and a request mid-prefill, and its agent."""
    async with running_agent(service.url, pool=WARM):
        await serve_prompt(tier, "r-done", DOC[:100], pool=WARM)
        plan = await tier.plan(WARM, [new_request("r-mid", DOC[200:248], 8, BLOCK)])
        assert isinstance(plan, StepPlan)
        yield


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(framed(), min_size=1, max_size=16),
       tail=st.none() | stream_breaker())
async def test_bad_frames_get_errors_and_change_nothing(service, tier, redis, warm_pool,
                                                        redis_operator,
                                                        frames, tail):
    before = await dump(redis_operator)
    replies = await send_and_drain(service.url, b"".join(frames) + (tail or b""))
    assert len(replies) >= len(frames)  # every well-framed frame is answered, then the tail
    for reply in replies:
        if reply.ok:
            assert from_wire(HealthReport, reply.result, "health")  # the one harmless valid op
        else:
            assert reply.error is not None and reply.error.code in set(ErrorCode)
    assert (await tier.health()).redis  # another client is still served
    assert await dump(redis_operator) == before
