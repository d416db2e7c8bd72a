"""`cachetier chaos --kills N`: faults against the local cluster under a verifying load.

The cluster (`run.cluster`, agents forked from a warm zygote so that a restart costs
milliseconds, the service's copy timeout short so that a frozen agent is given up quickly) serves
the load of `run.chaos_load` (every hit's bytes checked on every rank) while the campaign injects
N faults, the kinds in turn:

- `agent_sigkill`: an agent SIGKILLed while a plan is in flight (its copy batch sent or about to
  be), then restarted;
- `agent_sigstop`: an agent SIGSTOPped past the copy timeout (the service gives it up and starts
  a new epoch), then SIGCONTed: it wakes holding orders of a voided epoch and registers again;
- `redis_restart`: redis-server killed (SIGKILL and SIGTERM in turn) and started again on its
  append-only file (`everysec`: a SIGKILL may lose the last second, which the storage identity
  must catch);
- `broker_restart`: mosquitto stopped (SIGTERM and SIGKILL in turn) and started again;
- `liveness_storm`: forged agent statuses published on the agents' topics (offline for real
  ranks under made-up agent ids, made-up ranks online and offline, junk);
- `lease_expiry`: a scheduler plans a request and stalls past its lease (the campaign's service
  runs with a short one, `lease_s`) while the load goes on; the reaper releases the request,
  the load's steps take its pages, and the stalled pass then writes late: it must be refused
  (`gpu_pool.claims`) wherever its pages were handed on, and no hit may read its bytes.

After each fault the campaign waits until every rank is registered again and a step has been
served (`restart_s`: the time from the fault, or from SIGCONT, to that step), and every
`model_every` faults it runs the tiny hybrid model's sessions (`PrefillScheduler`, as the demo)
and compares every output with a cold recompute. At the end the load stops and the pool is read
whole: pins or pages left by requests that were all released are leaks.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiomqtt
import torch

from cachetier.client import CacheTierClient
from cachetier.credentials import MqttLogin, Role
from cachetier.engine.checkpoint_placement import PLACEMENTS
from cachetier.engine.scheduler import EngineError, PrefillScheduler
from cachetier.engine.sessions import SessionSpec, make_sessions
from cachetier.errors import CacheTierError
from cachetier.events.liveness import AgentStatus, agent_topic
from cachetier.events.mqtt import BrokerAddress
from cachetier.run.chaos_load import (LoadShape, Tally, Workers, client_loop, late_write,
                                      make_docs)
from cachetier.run.cluster import POOL, Cluster
from cachetier.run.progress import ProgressBar
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from tinymodel import TinyHybrid

KINDS = ("agent_sigkill", "agent_sigstop", "redis_restart", "broker_restart", "liveness_storm",
         "lease_expiry")
_SERVING_TIMEOUT_S = 30.0
_IN_FLIGHT_WAIT_S = 2.0
_POLL_S = 0.01


@dataclass(frozen=True)
class ChaosOptions:
    kills: int
    clients: int = 4
    model_every: int = 10  # faults between two runs of the tiny model against its recompute
    storm_messages: int = 100
    copy_timeout_s: float = 1.0  # the service's, so a frozen agent is given up quickly
    lease_s: float = 2.0  # the service's request lease, so a stalled scheduler is reaped soon
    seed: int = 0
    json: bool = False


@dataclass
class ChaosReport:
    """The keys up to `restart_p50_s` are the issue's contract; the rest say how it went."""

    kills: int = 0
    hits_checked: int = 0
    wrong_hits: int = 0
    non_retryable_errors: int = 0
    leaked_pins: int = 0
    leaked_pages: int = 0
    restart_p50_s: float = 0.0
    wall_s: float = 0.0
    per_kind: dict[str, int] = field(default_factory=dict)
    restart_p90_s: float = 0.0
    steps: int = 0
    retryable_errors: dict[str, int] = field(default_factory=dict)
    not_serving_again: int = 0  # faults after which the pool did not serve within the bound
    model_runs: int = 0
    model_requests: int = 0
    model_hit_requests: int = 0
    model_mismatches: int = 0  # counted in wrong_hits too
    storm_published: int = 0
    storm_refused: int = 0  # storms the broker would not take (a connection refused)
    storm_epoch_bumps: int = 0  # invalidations the forged statuses caused
    late_writes_refused: int = 0  # passes that outlived their lease, refused on handed-on pages
    late_writes_landed: int = 0  # such passes whose pages nobody was handed yet (harmless)
    epochs: int = 0  # the pool's epochs, first to last
    sanity: str = "ok"  # index.snapshot.sanity_check of the pool at the end
    problems: list[str] = field(default_factory=list)


def run_chaos(cluster: Cluster, options: ChaosOptions) -> None:
    """The job `cachetier.run.cluster.up` runs; prints the report (one JSON object with
    `--json`), progress on stderr."""
    torch.set_num_threads(1)
    report = asyncio.run(Campaign(cluster, options).run())
    print(json.dumps(asdict(report)) if options.json else _table(report), flush=True)


class Campaign:
    def __init__(self, cluster: Cluster, options: ChaosOptions) -> None:
        self.cluster = cluster
        self.options = options
        self.config = cluster.settings.config
        self.ranks = cluster.settings.agents
        self.rng = random.Random(options.seed)
        self.tally = Tally()
        self.report = ChaosReport()
        self.workers = Workers([cluster.handle_file(r) for r in range(self.ranks)])
        self.restarts: list[float] = []
        self.storms = 0
        self.late_writers = 0
        self.model = TinyHybrid(self.config.model)
        cache = self.config.cache
        self.shape = LoadShape(POOL, cache.hash_block_tokens, cache.page_tokens,
                               make_docs(3, min(256, 4 * cache.page_tokens)))

    async def run(self) -> ChaosReport:
        started = time.monotonic()
        stop = asyncio.Event()
        async with self.cluster.client() as tier:
            first_epoch = (await tier.stats(POOL)).epoch
            await self.workers.reload()
            load = [asyncio.create_task(self._client(n, stop)) for n in range(self.options.clients)]
            bar = ProgressBar(self.options.kills, "chaos")
            try:
                await self._until_serving(tier, time.monotonic())
                for i in range(self.options.kills):
                    kind = KINDS[i % len(KINDS)]
                    await self._fault(tier, kind, i // len(KINDS))
                    self.report.kills += 1
                    self.report.per_kind[kind] = self.report.per_kind.get(kind, 0) + 1
                    if (i + 1) % self.options.model_every == 0 or i + 1 == self.options.kills:
                        await self._model_check(tier, i)
                    bar.advance(note=f"{kind}: {self.tally.steps} steps, "
                                     f"{self.tally.hits_checked} hits checked, "
                                     f"{self.tally.wrong_hits + self.report.model_mismatches} "
                                     "wrong")
            finally:
                stop.set()
                await asyncio.gather(*load, return_exceptions=True)
            self.report.epochs = (await tier.stats(POOL)).epoch - first_epoch + 1
        await self._leaks()
        self._summarise(time.monotonic() - started)
        return self.report

    async def _client(self, n: int, stop: asyncio.Event) -> None:
        await client_loop(self.cluster.client, self.workers, self.shape, n, stop, self.tally,
                          self.options.seed)

    # faults

    async def _fault(self, tier: CacheTierClient, kind: str, nth: int) -> None:
        if kind == "agent_sigkill":
            await self._agent_sigkill(tier)
        elif kind == "agent_sigstop":
            await self._agent_sigstop(tier)
        elif kind == "redis_restart":
            sig = signal.SIGKILL if nth % 2 == 0 else signal.SIGTERM
            since = time.monotonic()
            await asyncio.to_thread(self.cluster.redis.restart, sig)
            await self._until_serving(tier, since)
        elif kind == "broker_restart":
            sig = signal.SIGTERM if nth % 2 == 0 else signal.SIGKILL
            since = time.monotonic()
            await asyncio.to_thread(self.cluster.mqtt.restart, sig)
            await self._until_serving(tier, since)
        elif kind == "liveness_storm":
            await self._storm(tier)
        else:
            await self._late_writer(tier)

    async def _agent_sigkill(self, tier: CacheTierClient) -> None:
        rank = self.rng.randrange(self.ranks)
        await self._while_a_plan_is_in_flight()
        node = self.cluster.agents[rank]
        assert node.proc is not None
        killed = time.monotonic()
        node.proc.kill()
        await asyncio.to_thread(self.cluster.restart_agent, rank)
        self.restarts.append(await self._until_serving(tier, killed))

    async def _agent_sigstop(self, tier: CacheTierClient) -> None:
        rank = self.rng.randrange(self.ranks)
        node = self.cluster.agents[rank]
        assert node.proc is not None
        before = await self._epoch(tier)
        node.proc.send_signal(signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            # past the copy timeout, and until the service has given the agent up (a step must
            # have waited on it: the load keeps steps coming)
            deadline = frozen + 4 * self.options.copy_timeout_s + 5
            while time.monotonic() < frozen + self.options.copy_timeout_s + 0.2 or \
                    await self._epoch(tier) <= before:
                if time.monotonic() > deadline:
                    self.tally.problem(f"rank {rank} frozen: the pool's epoch never moved")
                    break
                await asyncio.sleep(0.05)
        finally:
            node.proc.send_signal(signal.SIGCONT)
        self.restarts.append(await self._until_serving(tier, time.monotonic()))

    async def _late_writer(self, tier: CacheTierClient) -> None:
        """A scheduler stalled past its lease (see the module docstring); a fault whose plan
        was refused (the pool full) or that the pool moved past (a new epoch) counts nothing."""
        since = time.monotonic()
        self.late_writers += 1
        tokens = self.rng.choice(self.shape.docs)[:3 * self.shape.block] + [self.late_writers]
        outcome = await late_write(tier, self.workers, self.shape,
                                   f"chaos-late-{self.late_writers}", tokens,
                                   self.options.lease_s + 1.5, self.tally)
        if outcome == "refused":
            self.report.late_writes_refused += 1
        elif outcome == "landed":
            self.report.late_writes_landed += 1
        await self._until_serving(tier, since)

    async def _epoch(self, tier: CacheTierClient) -> int:
        try:
            return (await tier.stats(POOL)).epoch
        except CacheTierError:
            return -1

    async def _while_a_plan_is_in_flight(self) -> None:
        deadline = time.monotonic() + _IN_FLIGHT_WAIT_S
        while self.tally.in_flight == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    async def _storm(self, tier: CacheTierClient) -> None:
        """Forged statuses, as a client of the broker could publish them: every other storm
        anonymously (a broker with logins refuses the connection: counted, not a problem), the
        others logged in with the observer's credential, a real login that the topic ACL lets
        publish nothing (the broker takes the messages and drops them)."""
        before = await self._epoch(tier)
        since = time.monotonic()
        address = BrokerAddress.parse(self.cluster.mqtt.url)
        self.storms += 1
        login = {}
        if self.storms % 2 == 0:
            observer = MqttLogin.of(self.cluster.credentials.role(Role.OBSERVER))
            login = {"username": observer.username, "password": observer.password}
        try:
            async with aiomqtt.Client(address.host, address.port,
                                      identifier=f"chaos-storm-{self.rng.getrandbits(32):x}",
                                      timeout=5, **login) as client:
                for i in range(self.options.storm_messages):
                    topic, payload = self._forged(i)
                    await client.publish(topic, payload, qos=0)
                    self.report.storm_published += 1
        except aiomqtt.MqttError:
            self.report.storm_refused += 1
        await asyncio.sleep(0.7)  # past the watcher's settle delay (0.5 s) before it acts
        await self._until_serving(tier, since)
        after = await self._epoch(tier)
        if before >= 0 and after > before:
            self.report.storm_epoch_bumps += after - before

    def _forged(self, i: int) -> tuple[str, bytes]:
        fake = f"forged{self.rng.getrandbits(40):010x}"
        real_rank = self.rng.randrange(self.ranks)
        made_up = self.ranks + self.rng.randrange(64)
        choice = i % 4
        if choice == 0:
            return agent_topic(POOL, real_rank), AgentStatus("offline", fake).encode()
        if choice == 1:
            return agent_topic(POOL, made_up), AgentStatus("online", fake, 1, "cpu", 1).encode()
        if choice == 2:
            return agent_topic(POOL, made_up), AgentStatus("offline", fake).encode()
        return agent_topic(POOL, real_rank), b"\xff{not json"

    async def _until_serving(self, tier: CacheTierClient, since: float) -> float:
        """Seconds from `since` until every rank is registered and a step served after that."""
        deadline = time.monotonic() + _SERVING_TIMEOUT_S
        registered = None
        while time.monotonic() < deadline:
            if registered is None:
                try:
                    health = await tier.health()
                except CacheTierError:
                    health = None
                if health is not None and health.pools.get(POOL) == list(range(self.ranks)) \
                        and POOL not in health.recovering:
                    registered = time.monotonic()
            elif self.tally.last_ok > registered:
                return self.tally.last_ok - since
            await asyncio.sleep(_POLL_S)
        self.report.not_serving_again += 1
        self.tally.problem(f"the pool did not serve within {_SERVING_TIMEOUT_S:g} s of a fault")
        return _SERVING_TIMEOUT_S

    # the oracle

    async def _model_check(self, tier: CacheTierClient, i: int) -> None:
        """The tiny model's sessions through the tier, every output against a cold recompute;
        a run a fault's aftermath breaks (a late invalidation) is run again, at most thrice."""
        sessions = make_sessions(SessionSpec(sessions=2, turns=3, seed=i % 3))
        for _ in range(3):
            ranks = await self.workers.reload()
            scheduler = PrefillScheduler(tier, POOL, self.config, PLACEMENTS["branch"],
                                         self.model, ranks, chunk_tokens=48)
            try:
                results = await scheduler.run(sessions)
            except (CacheTierError, EngineError) as exc:
                if isinstance(exc, CacheTierError) and not exc.retryable:
                    self.tally.failed("model", exc)
                    return
                continue
            self.report.model_runs += 1
            self.report.model_requests += len(results)
            self.report.model_hit_requests += sum(r.hit_tokens > 0 for r in results)
            wrong = [r.rid for r in results if r.verified is False]
            self.report.model_mismatches += len(wrong)
            if wrong:
                self.tally.problem(f"model outputs differ from the recompute: {wrong}")
            return
        self.tally.problem(f"the model's sessions failed three times after fault {i}")

    # the end

    async def _leaks(self) -> None:
        """Every request was released: no pin may be left, and every page is free or cached."""
        from redis.asyncio import Redis
        redis = Redis.from_url(self.cluster.redis.url, **self.cluster.redis.operator_login)
        try:
            state = await read_pool(redis, pool_keys(POOL))
        finally:
            await redis.aclose()
        self.report.leaked_pins = (sum(rec.get("ref", 0) for rec in state.pages.values())
                                   + len(state.req) + len(state.tix))
        self.report.leaked_pages = sum(len(rec["pages"]) for rec in state.pages.values()
                                       if rec.get("st") != "ready")
        try:
            sanity_check(state, self.config.cache.num_pages, self.config.cache.blocks_per_page)
        except AssertionError as exc:
            self.report.sanity = str(exc) or "failed"

    def _summarise(self, wall_s: float) -> None:
        r, t = self.report, self.tally
        r.hits_checked, r.steps, r.retryable_errors = t.hits_checked, t.steps, dict(t.retryable)
        r.wrong_hits = t.wrong_hits + r.model_mismatches
        r.non_retryable_errors = t.non_retryable
        if self.restarts:
            r.restart_p50_s = round(statistics.median(self.restarts), 3)
            ranked = sorted(self.restarts)
            r.restart_p90_s = round(ranked[math.ceil(0.9 * len(ranked)) - 1], 3)
        r.wall_s = round(wall_s, 1)
        r.problems = list(t.problems)


def _table(report: ChaosReport) -> str:
    rows = asdict(report)
    width = max(len(k) for k in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())
