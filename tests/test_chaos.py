"""Chaos: agents SIGKILLed in the middle of copy batches, redis-server and the broker restarted,
all under load from several concurrent clients (issue 4, "Chaos (required)").

The service runs in-process (so the test can see when it sends a copy batch); agents are real
processes running `cachetier agent` (`cachetier.cli.main`), so they can be SIGKILLed. Importing
torch costs seconds of CPU, so after the first agent (started as `python -m cachetier.cli agent`)
the replacements are forked from a *zygote*: a process that has imported everything once and, on
each request, forks a child that runs `cachetier.cli.main(["agent", ...])` in a process of its
own. Restarting an agent then costs milliseconds, so many kill rounds fit in seconds.

How a kill lands mid-batch: the test wraps `AgentLink.copy` (the service's side of one copy
batch to one agent). When a kill is armed, the next non-empty batch is written to the agent's
socket, then the agent is SIGKILLed before the service can have read its ack: that batch, and
every other step of the pool in flight, is caught between send and ack. The wrapper records
whether the ack had arrived (it never has, since the kill happens without yielding to the
reader), so each round is checked to have killed the agent mid-batch.

Every hit is checked byte for byte: the clients play the inference worker, attached to the live
agent's pool through its `--handle-file`, writing each token's value into the MLA pages and a
pattern derived from (token prefix, group) into the checkpoint pages; a later hit must find those
exact bytes in the pages its plan names (restored state pages, cached MLA pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, ErrorCode, RemoteError
from cachetier.private_files import write_private
from cachetier.run.chaos_load import release_for_sure
from cachetier.run.nodes import run_service
from cachetier.run.servers import MosquittoServer, parent_death_hook
from cachetier.service.fleet import AgentLink
from cachetier.service.observer import ServiceObserver
from cachetier.service.server import ServiceSettings
from cachetier.wire.protocol import CopyBatch
from gpu_pool import PagedPool
from index.records import RequestPlan, StepPlan, StepRefusal
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from index.tickets import write_stamp
from tests.cluster_harness import BLOCK, PAGE, SECRET, TINY, TOKEN, agent_token, running_service
from tests.index_harness import commit_item, new_request
from tests.redis_harness import AofRedis

POOL = "p"
CLIENTS = 6
KILL_ROUNDS = 20
REJOIN_S = 5.0  # LivenessWatcher's default rejoin window after a broker reconnection
DOCS = [[1000 * (d + 1) + (13 * i + 7 * d) % 997 for i in range(256)] for d in range(3)]

ZYGOTE = r"""
import ctypes, json, os, signal, sys
import torch, kernels, gpu_pool, gpu_pool.agent, cachetier.run.nodes, cachetier.cli
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # dead agents are reaped by the kernel
print("ready", flush=True)
for line in sys.stdin:
    argv, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlives the zygote
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        code = 1
        try:
            code = cachetier.cli.main(argv)
        finally:
            os._exit(code)
    print(pid, flush=True)
"""


# agent processes


@dataclass
class AgentProc:
    pid: int
    handle_file: Path
    proc: subprocess.Popen[str] | None = None  # set when started directly (not forked)
    view: PagedPool | None = None
    shm: list[str] = field(default_factory=list)
    dead: bool = False  # seen dead: its pid may belong to someone else now, never signal it

    def alive(self) -> bool:
        if self.dead:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.dead:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


class Agents:
    """Starts agents (`cachetier agent`), kills them, and cleans up what a SIGKILL leaves: the
    processes themselves, and the pool's shared-memory files a killed agent cannot unlink."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[AgentProc] = []
        self.zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            preexec_fn=parent_death_hook())  # noqa: PLW1509
        self._zygote_ready = False
        self._count = 0
        # by file, as `up` gives a forked agent its token: a forked agent has the zygote's
        # environment, and a command line is readable by every local user
        self.token_file = write_private(tmp / "agent-token", agent_token(POOL))

    def _next(self) -> int:
        self._count += 1
        return self._count

    def argv(self, service: str, handle_file: Path, mqtt: str | None) -> list[str]:
        args = ["agent", "--service", service, "--pool", POOL, "--token-file",
                str(self.token_file), "--handle-file", str(handle_file), "--log-level", "info"]
        return args + (["--mqtt", mqtt] if mqtt else [])

    def start_cli(self, service: str, mqtt: str | None = None) -> AgentProc:
        """`python -m cachetier.cli agent ...`: the real command line, torch import and all."""
        n = self._next()
        handle_file = self.tmp / f"agent-{n}.handle"
        with open(self.tmp / f"agent-{n}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "cachetier.cli",
                                     *self.argv(service, handle_file, mqtt)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=parent_death_hook())  # noqa: PLW1509
        agent = AgentProc(proc.pid, handle_file, proc)
        self.started.append(agent)
        return agent

    async def start(self, service: str, mqtt: str | None = None) -> AgentProc:
        """The same command, forked from the warm zygote."""
        n = self._next()
        handle_file = self.tmp / f"agent-{n}.handle"
        line = json.dumps([self.argv(service, handle_file, mqtt), str(self.tmp / f"agent-{n}.log")])
        if not self._zygote_ready:
            assert await self._read_line() == "ready"
            self._zygote_ready = True
        assert self.zygote.stdin is not None
        self.zygote.stdin.write(line + "\n")
        self.zygote.stdin.flush()
        agent = AgentProc(int(await self._read_line()), handle_file)
        self.started.append(agent)
        return agent

    async def _read_line(self) -> str:
        assert self.zygote.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.zygote.stdout.readline), 60)
        assert line, "the agent zygote exited"
        return line.strip()

    async def attach(self, agent: AgentProc) -> PagedPool:
        """The worker's view of `agent`'s pool, once it has registered and written its handle."""
        async with asyncio.timeout(20):
            while not agent.handle_file.exists():
                assert agent.alive(), f"agent {agent.pid} exited; see {self.tmp}"
                await asyncio.sleep(0.01)
        handle = pickle.loads(agent.handle_file.read_bytes())
        agent.shm = [handle.data.path, handle.tags.path, handle.fence.path]
        agent.view = PagedPool.attach(handle)
        return agent.view

    async def kill(self, agent: AgentProc) -> None:
        agent.kill()
        async with asyncio.timeout(10):
            while agent.alive():
                await asyncio.sleep(0.005)
        agent.dead = True
        self._unlink(agent)

    def _unlink(self, agent: AgentProc) -> None:
        for path in agent.shm:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def logs(self) -> str:
        """Every agent's log so far, by file: printed when a test ends, so a failure shows
        what each agent saw (pytest shows a failed test's output only)."""
        return "".join(f"--- {path.name}\n{path.read_text(errors='replace')}"
                       for path in sorted(self.tmp.glob("agent-*.log")))

    def kill_all(self) -> None:
        for agent in self.started:
            agent.kill()
        for agent in self.started:
            deadline = time.monotonic() + 10
            while agent.alive() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not agent.alive(), f"agent {agent.pid} survived SIGKILL"
            agent.dead = True
            self._unlink(agent)
        self.started.clear()

    def close(self) -> None:
        try:
            self.kill_all()
        finally:
            self._close_zygote()

    def _close_zygote(self) -> None:
        self.zygote.kill()
        self.zygote.wait(timeout=10)
        for pipe in (self.zygote.stdin, self.zygote.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def agent_factory(tmp_path_factory):
    """One zygote for the module: it imports torch once (seconds of CPU) for every agent."""
    factory = Agents(tmp_path_factory.mktemp("agents"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def agents(agent_factory):
    try:
        yield agent_factory
    finally:
        agent_factory.kill_all()
        print(agent_factory.logs())
        for path in agent_factory.tmp.glob("agent-*.log"):
            path.unlink()


# the kill hook and the epoch bookkeeping


@dataclass
class Kill:
    epoch: int            # the epoch of the agent that was killed
    frozen: bool          # stopped before the batch was sent: it died holding it, unrun
    acked_first: bool     # whether its batch had been acknowledged before the kill (never)
    outcome: str = ""     # what the service saw of that batch: ConnectionLost, or acked


class Chaos(ServiceObserver):
    """Arms kills; maps each epoch to the pool view its agent serves; sees each invalidation."""

    def __init__(self) -> None:
        self.victim: int | None = None  # the pid to kill
        self.victim_epoch = 0
        self.freeze = False
        self.fired: asyncio.Event = asyncio.Event()
        self.kills: list[Kill] = []
        self.views: dict[int, PagedPool] = {}
        self.only_view: PagedPool | None = None  # where one agent process serves every epoch
        self.dead: set[int] = set()      # epochs whose agent was killed
        self.floor = 0                   # a plan that starts now must carry this epoch or newer
        self.invalidations: list[int] = []

    def arm(self, pid: int, epoch: int, freeze: bool) -> None:
        self.fired.clear()
        self.victim, self.victim_epoch, self.freeze = pid, epoch, freeze

    def invalidated(self, pool: str, epoch: int) -> None:
        """Called once the new epoch is in Redis: a plan starting from now on must carry it."""
        self.invalidations.append(epoch)
        self.floor = max(self.floor, epoch)

    async def view(self, epoch: int) -> PagedPool:
        """The view of the agent serving `epoch` (the test attaches it right after it registers)."""
        if self.only_view is not None:
            return self.only_view
        async with asyncio.timeout(10):
            while epoch not in self.views:
                await asyncio.sleep(0.005)
        return self.views[epoch]


@pytest.fixture
def chaos(monkeypatch) -> Chaos:
    chaos = Chaos()
    original = AgentLink.copy

    async def copy(link: AgentLink, batch: CopyBatch) -> None:
        victim = chaos.victim
        if victim is None or not batch.copies:
            return await original(link, batch)
        chaos.victim = None
        if chaos.freeze:                # it will die with the batch received but not run
            os.kill(victim, signal.SIGSTOP)
        sending = asyncio.ensure_future(original(link, batch))
        await asyncio.sleep(0)          # the batch's frame is now written to the agent's socket
        kill = Kill(chaos.victim_epoch, chaos.freeze, sending.done())
        os.kill(victim, signal.SIGKILL)  # before the service can read any ack
        chaos.kills.append(kill)
        chaos.fired.set()
        try:
            await sending
        except BaseException as exc:
            kill.outcome = type(exc).__name__
            raise
        kill.outcome = "acked"

    monkeypatch.setattr(AgentLink, "copy", copy)
    return chaos


# the clients: schedulers that also play the inference worker


def state_pattern(tokens: list[int], group: int, nbytes: int) -> torch.Tensor:
    """The bytes a checkpoint of `tokens` holds in KDA group `group`: unique per prefix."""
    seed = hashlib.blake2b(repr((tokens, group)).encode(), digest_size=64).digest()
    reps = -(-nbytes // len(seed))
    return torch.frombuffer(bytearray(seed * reps), dtype=torch.uint8)[:nbytes]


def check_hit(view: PagedPool, step: RequestPlan, tokens: list[int]) -> None:
    """Every byte the plan says is restored or cached holds the prefix it claims."""
    hit = step.hit_tokens
    restores = [c for c in step.copies if c.dst in step.state_pages]
    assert [c.dst for c in restores] == step.state_pages, step
    page_bytes = view.buffer.shape[-1]
    for group, c in enumerate(restores):
        expected = state_pattern(tokens[:hit], group, page_bytes)[c.offset:c.offset + c.nbytes]
        got = view.buffer[:, c.dst, c.offset:c.offset + c.nbytes]
        assert torch.equal(got, expected.expand_as(got)), \
            f"{step.rid}: state page {c.dst} does not hold the checkpoint of its {hit} tokens"
    for group in step.mla_pages:
        for first in range(0, hit, PAGE):
            page, n = group[first // PAGE], min(PAGE, hit - first)
            expected = torch.tensor(tokens[first:first + n], dtype=torch.float32)[None, :, None]
            got = view.mla_view(page)[:, :n, :]
            assert torch.equal(got, expected.expand_as(got)), \
                f"{step.rid}: tokens {first}..{first + n} of the hit are not in MLA page {page}"


def forward(view: PagedPool, plan: StepPlan, step: RequestPlan, tokens: list[int]) -> int:
    """The forward pass of `step` of `plan`, under the pool's fence and claims as a worker
    writes: token values into the MLA pages, the state pattern into the checkpoint pages;
    returns the checkpoint boundary it wrote (commit_item's)."""
    ck = commit_item(step, step.stop, True, True, BLOCK).checkpoint_tokens
    with view.writing(plan.epoch, write_stamp(plan.ticket), step.written_pages(PAGE)):
        for group in step.mla_pages:
            for pos in range(step.start, step.stop):
                view.mla_view(group[pos // PAGE])[:, pos % PAGE, :] = float(tokens[pos])
        if ck:
            for group, page in enumerate(step.checkpoint_pages):
                view.buffer[:, page] = state_pattern(tokens[:ck], group, view.buffer.shape[-1])
    return ck


@dataclass
class Tally:
    steps: int = 0
    hits: int = 0
    copies: int = 0
    retryable: dict[str, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)       # non-retryable errors, hangs, wrong bytes
    last_ok: float = 0.0

    def failed(self, op: str, exc: BaseException) -> None:
        if isinstance(exc, CacheTierError) and exc.retryable:
            self.retryable[exc.code] = self.retryable.get(exc.code, 0) + 1
        else:
            self.bad.append(f"{op}: {type(exc).__name__}: {exc}")


async def one_request(tier: CacheTierClient, chaos: Chaos, rid: str, tokens: list[int],
                      tally: Tally) -> StepPlan | None:
    """Plan, check the hit's bytes, forward, commit, confirm, release. Any error must be
    retryable; the request is released whatever happens."""
    op = "plan"
    try:
        floor = chaos.floor
        plan = await tier.plan(POOL, [new_request(rid, tokens, len(tokens), BLOCK)])
        if isinstance(plan, StepRefusal):
            return None
        assert plan.epoch >= floor, f"{rid}: planned in epoch {plan.epoch} after a kill of " \
                                    f"epoch {floor - 1}"
        (step,) = plan.requests
        view = await chaos.view(plan.epoch)
        if step.hit_tokens:
            check_hit(view, step, tokens)
        op = "commit"
        forward(view, plan, step, tokens)
        done = await tier.commit(POOL, [commit_item(step, step.stop, True, True, BLOCK)])
        op = "confirm"
        await tier.confirm(POOL, done.ticket)
        tally.steps += 1
        tally.hits += bool(step.hit_tokens)
        tally.copies += len(step.copies)
        tally.last_ok = time.monotonic()
        return plan
    except CacheTierError as exc:
        tally.failed(op, exc)
        await asyncio.sleep(random.uniform(0.005, 0.03))
        return None
    except AssertionError as exc:
        tally.bad.append(str(exc))
        return None
    finally:
        await release_for_sure(tier, POOL, rid, tally.failed, timeout_s=15)


async def client_loop(url: str, chaos: Chaos, n: int, stop: asyncio.Event,
                      tally: Tally) -> None:
    rng = random.Random(n)
    async with CacheTierClient(url, token=TOKEN, timeout=10, connect_timeout=10) as tier:
        i = 0
        while not stop.is_set() and i < 2000:
            doc = rng.choice(DOCS)
            tokens = doc[:rng.randrange(40, len(doc))] + [n, i]
            await one_request(tier, chaos, f"c{n}-{i}", tokens, tally)
            i += 1


async def assert_no_leaks(redis: Any) -> None:
    state = await read_pool(redis, pool_keys(POOL))
    sanity_check(state, TINY.cache.num_pages, TINY.cache.blocks_per_page)
    assert state.req == {} and state.tix == {}, (state.req.keys(), state.tix)
    leads = [(lead, rec["ref"]) for lead, rec in state.pages.items() if rec.get("ref", 0)]
    assert leads == [], f"pinned after every request was released: {leads}"


async def cached_hit(tier: CacheTierClient, chaos: Chaos, tag: str) -> StepPlan:
    """A prompt served, then a probe that must restore it with copies, bytes checked."""
    tally = Tally()
    tokens = DOCS[0][:150]
    first = await one_request(tier, chaos, f"{tag}-a", tokens, tally)
    assert first is not None, tally
    plan = await one_request(tier, chaos, f"{tag}-b", tokens + [3, 4], tally)
    assert plan is not None and tally.bad == [], tally
    (step,) = plan.requests
    assert step.hit_tokens == 144 and step.copies, step
    return plan


async def wait_epoch_after(tier: CacheTierClient, epoch: int) -> int:
    """The pool's epoch once an agent serves it again in an epoch after `epoch`."""
    async with asyncio.timeout(20):
        while True:
            try:
                stats = await tier.stats(POOL)
            except RemoteError as exc:  # before the first registration the pool is unknown
                assert exc.code == ErrorCode.UNKNOWN_POOL, exc
            else:
                if stats.ranks == [0] and stats.epoch > epoch:
                    return stats.epoch
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def load(url: str, chaos: Chaos, clients: int = CLIENTS):
    stop = asyncio.Event()
    tally = Tally()
    tasks = [asyncio.create_task(client_loop(url, chaos, n, stop, tally)) for n in range(clients)]
    try:
        yield tally
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=20)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert not pending, "clients hung after the load stopped"
    for task in done:
        task.result()


async def wait_for_hits(tally: Tally, before: int, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while tally.hits <= before:
            await asyncio.sleep(0.005)


async def wait_for_steps(tally: Tally, since: float, count: int, timeout: float) -> None:
    """`count` more steps succeed after `since`, within `timeout` seconds."""
    start = tally.steps
    async with asyncio.timeout(timeout):
        while tally.steps < start + count or tally.last_ok <= since:
            await asyncio.sleep(0.01)


# the tests


async def test_agents_killed_mid_batch_fail_steps_retryably_and_leak_nothing(
        redis, redis_url, agents, chaos):
    async with running_service(redis_url, observer=chaos, copy_timeout_s=5) as service:
        agent = agents.start_cli(service.url)  # the real command line first
        async with CacheTierClient(service.url, token=TOKEN, timeout=10) as tier:
            epoch = await wait_epoch_after(tier, 0)
            chaos.views[epoch] = await agents.attach(agent)
            t0, hits = time.monotonic(), 0
            async with load(service.url, chaos) as tally:
                for round_ in range(KILL_ROUNDS):
                    # the (restarted) agent serves a hit, with copies, in this epoch; copies keep
                    # coming now that something is cached again: arm the kill
                    await wait_for_hits(tally, hits, timeout=15)
                    hits = tally.hits
                    chaos.arm(agent.pid, epoch, freeze=round_ % 2 == 0)
                    async with asyncio.timeout(15):
                        await chaos.fired.wait()
                    chaos.dead.add(epoch)
                    await agents.kill(agent)
                    agent = await agents.start(service.url)
                    view = await agents.attach(agent)
                    epoch = await wait_epoch_after(tier, epoch)
                    chaos.views[epoch] = view
                    chaos.floor = epoch
                    await wait_for_steps(tally, time.monotonic(), 3, timeout=15)
            assert tally.bad == [], tally.bad
            assert len(chaos.kills) == KILL_ROUNDS
            assert [k.acked_first for k in chaos.kills] == [False] * KILL_ROUNDS
            # a frozen agent dies holding the batch: that step always fails; a racing kill may
            # come after the agent acked (the step then succeeded before the kill)
            assert all(k.outcome == "ConnectionLost" for k in chaos.kills if k.frozen), chaos.kills
            assert all(k.outcome in ("ConnectionLost", "acked") for k in chaos.kills), chaos.kills
            assert tally.retryable.get(ErrorCode.AGENT_LOST, 0) >= KILL_ROUNDS // 2, tally
            assert tally.hits >= KILL_ROUNDS, tally
            # each kill bumped the epoch; nothing ever ran in a dead epoch after its kill
            assert len(set(chaos.views)) == KILL_ROUNDS + 1
            # the restarted agent serves: a step with copies, bytes checked
            plan = await cached_hit(tier, chaos, "final")
            assert plan.epoch == epoch and epoch not in chaos.dead
            await assert_no_leaks(redis)
            print(f"\nchaos kills: {KILL_ROUNDS} rounds, {tally.steps} steps ok, {tally.hits} "
                  f"hits, {tally.copies} copies, retryable errors {tally.retryable}, batches "
                  f"{[k.outcome for k in chaos.kills]}, {time.monotonic() - t0:.1f} s")


async def test_redis_restarted_under_load_the_service_reconnects_and_stays_consistent(
        tmp_path, agents, chaos):
    from redis.asyncio import Redis
    server = AofRedis(tmp_path / "redis-data")
    server.data_dir.mkdir()
    server.start()
    redis = Redis.from_url(server.url)
    try:
        async with running_service(server.url, observer=chaos, copy_timeout_s=5) as service:
            agent = await agents.start(service.url)
            async with CacheTierClient(service.url, token=TOKEN, timeout=10) as tier:
                epoch = await wait_epoch_after(tier, 0)
                chaos.only_view = await agents.attach(agent)
                async with load(service.url, chaos) as tally:
                    for _ in range(2):
                        await wait_for_steps(tally, 0, 10, timeout=15)
                        os.kill(server.pid, signal.SIGKILL)       # mid-load, no goodbye
                        server.stop()
                        await asyncio.sleep(0.2)                  # clients see it down
                        server.start()                            # same port, same AOF
                        await wait_for_steps(tally, time.monotonic(), 10, timeout=10)
                assert tally.bad == [], tally.bad
                assert tally.retryable.get(ErrorCode.REDIS_UNAVAILABLE, 0) > 0, tally
                # the metadata survived (AOF) and no agent was lost: the epoch never moved (on a
                # failure, the captured log says which path moved it: the service's warning
                # "agent of rank 0 lost (why)" or "storage ...: started over", and the agent's
                # log, printed at teardown, whether it reconnected and registered again)
                assert (await tier.stats(POOL)).epoch == epoch, chaos.invalidations
                await cached_hit(tier, chaos, "final")
                await redis.aclose()
                redis = Redis.from_url(server.url)
                await assert_no_leaks(redis)
    finally:
        await redis.aclose()
        server.stop()


async def test_broker_restarted_under_load_the_service_reconnects_and_stays_consistent(
        redis, redis_url, agents, chaos):
    broker = MosquittoServer()
    broker.start()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    settings = ServiceSettings(redis_url, SECRET, TINY, copy_timeout_s=5)
    serve = asyncio.create_task(run_service(settings, ready.set_result, broker.url))
    try:
        url = await asyncio.wait_for(ready, 10)
        agent = await agents.start(url, mqtt=broker.url)
        async with CacheTierClient(url, token=TOKEN, timeout=10) as tier:
            epoch = await wait_epoch_after(tier, 0)
            chaos.only_view = await agents.attach(agent)
            async with load(url, chaos) as tally:
                await wait_for_steps(tally, 0, 10, timeout=15)
                broker.stop()
                await asyncio.sleep(0.3)
                broker.start()                                   # same port
                restarted = time.monotonic()
                await wait_for_steps(tally, restarted, 20, timeout=10)
                # past the liveness watcher's rejoin window (5 s): the agent, reconnected to the
                # broker, announced itself again in time, so it was never counted as lost
                await asyncio.sleep(max(0.0, restarted + REJOIN_S + 0.5 - time.monotonic()))
                await wait_for_steps(tally, time.monotonic(), 10, timeout=10)
            assert tally.bad == [], tally.bad
            stats = await tier.stats(POOL)
            assert (stats.epoch, stats.ranks) == (epoch, [0]), stats
            await cached_hit(tier, chaos, "final")
            await assert_no_leaks(redis)
    finally:
        serve.cancel()
        await asyncio.gather(serve, return_exceptions=True)
        broker.stop()
