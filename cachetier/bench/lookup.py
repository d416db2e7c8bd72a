"""`cachetier bench lookup`: latency of one `plan_step` next to a bare Redis round trip.

Every request of a step is the next turn of a conversation whose first turn (all but the last
`STEP_TOKENS` tokens) was served with the engine's real flow: plan, confirm, commit with a durable
turn-end checkpoint, confirm, release. The measured step looks the whole prompt up, must hit at that
boundary, and computes the last `STEP_TOKENS` tokens. Its client-side latency (hashes precomputed;
the confirm and release that undo it run outside the timed region) is reported next to a bare
EVALSHA of `return 1` timed just before it on the same connection, so the ratio says how much a
lookup costs beyond the round trip that no design can avoid.

Two floors come from the same run. A no-op function (FCALL, as the step is called) sent the
step's very KEYS and ARGV (timed just before, in its own window of command stats) costs what Redis
and the client spend on the arguments before any Lua runs; `noop_ratio_p50` is the lowest
`ratio_p50` a Lua design could reach. The server's own time in the step's function (`INFO
commandstats`: the bare round trip goes as EVALSHA_RO, so FCALL's microseconds are the step's
alone) per request says how close the step is to that floor, apart from the client's share. The
no-op's library is deleted afterwards; cachetier's own stays loaded, as on any server it used.

With `--phases`, each case then runs as many steps again through a copy of the library whose
phase markers read the server's clock (`cachetier.bench.lookup_phases`): where the step's server
time goes, per request and phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.asyncio import ConnectionPool, Redis

from cachetier.bench.lookup_phases import PhaseLibrary, measure_phases, phase_library, summarize_phases
from cachetier.bench.script_stats import STEP_COMMAND, script_stats, stats_delta
from cachetier.config import Config, ConfigError, add_config_arguments, config_from_args
from cachetier.run.servers import RedisServer
from index.execution import LoadedLibrary, Staged, call_function
from index.hashing import chain_hashes, hash_len, namespace_root
from index.lifecycle import RequestLifecycle
from index.redis_link import packing_with_hiredis
from index.records import CommitItem, StepPlan, StepRefusal, StepRequest
from index.store import PrefixIndex

STEP_TOKENS = 512
TOKENS = (4096, 131072, 1048576)
BATCHES = (1, 64)
QUICK_TOKENS = (4096, 16384)
QUICK_BATCHES = (1, 4)
BARE_SCRIPT = "return 1"
NOOP_LIBRARY = "cachetier_bench_noop"
NOOP_SOURCE = (f"#!lua name={NOOP_LIBRARY}\n"
               f"redis.register_function('{NOOP_LIBRARY}', function(keys, args) return 1 end)")
NOOP = LoadedLibrary(NOOP_SOURCE, {NOOP_LIBRARY: NOOP_LIBRARY}, frozenset())
HASH_REPEATS = 5
SETUP_BATCH = 8


@dataclass(frozen=True)
class Case:
    tokens: int
    batch: int
    reps: int
    warmup: int


def default_reps(tokens: int, batch: int, quick: bool) -> int:
    """200 steps give a p99 from the two slowest; the biggest steps (tens of ms) get fewer so the
    default run stays within a few minutes on a small machine."""
    if quick:
        return 20
    return 200 if tokens * batch <= 2**24 else 60


def build_cases(args: argparse.Namespace, sizes: tuple[Sequence[int], Sequence[int]] = (TOKENS, BATCHES),
                quick_sizes: tuple[Sequence[int], Sequence[int]] = (QUICK_TOKENS, QUICK_BATCHES),
                reps_rule: Callable[[int, int, bool], int] = default_reps) -> list[Case]:
    """Every (tokens, batch) pair of the flags, else of the default or quick sizes."""
    tokens = args.tokens or (quick_sizes if args.quick else sizes)[0]
    batches = args.batches or (quick_sizes if args.quick else sizes)[1]
    cases = []
    for n in tokens:
        for b in batches:
            reps = reps_rule(n, b, args.quick) if args.repeats is None else args.repeats
            cases.append(Case(n, b, reps, warmup=max(2, reps // 10)))
    return cases


def check_cases(config: Config, cases: Sequence[Case]) -> None:
    """Refuse sizes before any work. The cached boundary (prompt minus STEP_TOKENS) must be a
    hash-block boundary, or no hit at it is possible and the benchmark would measure a miss."""
    block = config.cache.hash_block_tokens
    for case in cases:
        if case.reps < 1:
            raise ConfigError("--repeats", f"{case.reps} must be at least 1")
        if case.tokens <= STEP_TOKENS or (case.tokens - STEP_TOKENS) % block:
            raise ConfigError("--tokens", f"{case.tokens} must exceed {STEP_TOKENS} by a positive "
                              f"multiple of the {block}-token hash block")
        if not 1 <= case.batch <= config.cache.max_batch:
            raise ConfigError("--batches", f"{case.batch} is not in [1, cache.max_batch = "
                              f"{config.cache.max_batch}]")


def case_config(config: Config, case: Case) -> Config:
    """A pool just big enough that neither the first turns nor the measured step ever evict.

    Per conversation, at the busiest moment: the MLA pages of the whole prompt plus one
    copy-on-write page in every MLA group, and three KDA page sets (the kept turn-end checkpoint,
    and the private state and new checkpoint of the turn being served)."""
    model, cache = config.model, config.cache
    mla_pages = model.mla_groups * (-(-case.tokens // cache.page_tokens) + 1)
    per_conversation = mla_pages + 3 * model.kda_groups
    cache = dataclasses.replace(cache, num_pages=case.batch * per_conversation)
    return dataclasses.replace(config, cache=cache)


class SendCounter:
    """Counts request writes on a pool's connections. Each write is one round trip (the client
    then waits for the reply); counting them on the client is exact, whereas the server's
    `total_commands_processed` and command stats also count the commands scripts run inside."""

    def __init__(self) -> None:
        self.sends = 0

    def install(self, pool: ConnectionPool) -> None:
        counter, base = self, pool.connection_class

        class CountingConnection(base):  # type: ignore[misc, valid-type]
            async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                counter.sends += 1
                await super().send_packed_command(command, check_health)

        pool.connection_class = CountingConnection


def conversation_tokens(seed: int, tokens: int) -> np.ndarray:
    """Random uint32 ids, one seed per conversation, so no two conversations share a prefix."""
    return np.random.default_rng(seed).integers(0, 2**32, tokens, dtype=np.uint32)


def hash_ms(tokens: np.ndarray, root: bytes, config: Config) -> float:
    """Median wall time of chaining one prompt's hashes: the client's share of a lookup."""
    times = []
    for _ in range(HASH_REPEATS):
        start = time.perf_counter()
        chain_hashes(tokens, root, config.cache.hash_block_tokens, config.cache.hash_algo)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefix_hashes(blob: bytes, tokens: int, config: Config) -> bytes:
    """A prefix's chained hashes are the head of the whole prompt's: no rehashing needed."""
    blocks = tokens // config.cache.hash_block_tokens
    return blob[:blocks * hash_len(config.cache.hash_algo)]


def expect_plan(result: StepPlan | StepRefusal, hit: int, what: str) -> StepPlan:
    """Fail loudly unless every request hit exactly at `hit` without evicting anything: otherwise
    the figures would describe some other lookup than the one this benchmark claims."""
    if not isinstance(result, StepPlan):
        raise RuntimeError(f"{what}: the pool refused the step: {result.reason}")
    misses = [(r.rid, r.hit_tokens) for r in result.requests if r.hit_tokens != hit]
    if misses:
        raise RuntimeError(f"{what}: expected every request to hit at {hit} tokens, got {misses[:4]}")
    if result.evicted:
        raise RuntimeError(f"{what}: the step evicted {result.evicted} pages; the pool is too small")
    return result


def confirming(index: PrefixIndex) -> RequestLifecycle:
    """The engine's flow on a pool without agents: a plan has no copies to wait for, so it is
    confirmed as soon as it is made (as the service would once its agents acked)."""
    return RequestLifecycle(index, settle=lambda plan: index.confirm(plan.ticket))


async def serve_first_turns(index: PrefixIndex, blobs: Sequence[bytes], tokens: int) -> None:
    """The first turn of every conversation, as an engine serves it: one prefill chunk, confirm,
    commit with a durable turn-end checkpoint at its last token, confirm, release.

    A few conversations per step: committing thousands of endpoints is one long script, and Redis
    answers BUSY to everyone else (and the client times out) past a few seconds."""
    for first in range(0, len(blobs), SETUP_BATCH):
        rids = [f"c{n}.turn1" for n in range(first, min(first + SETUP_BATCH, len(blobs)))]
        requests = [StepRequest(rid, tokens, tokens, prefix_hashes(blobs[n], tokens, index.config))
                    for n, rid in enumerate(rids, first)]
        async with confirming(index) as steps:
            expect_plan(await steps.plan(requests), 0, "first turn")
            commit = await steps.finish([CommitItem(rid, tokens, tokens, durable=True)
                                         for rid in rids])
            unregistered = [r.rid for r in commit.requests if r.checkpoint != "registered"]
            if unregistered:
                raise RuntimeError(f"first turn: no checkpoint registered for {unregistered[:4]}")


@dataclass
class Samples:
    """One case's timed steps: latencies per step, round-trip and script counts summed."""

    plan_ns: list[int] = dataclasses.field(default_factory=list)
    rtt_ns: list[int] = dataclasses.field(default_factory=list)
    script_us: list[int] = dataclasses.field(default_factory=list)
    server_us: list[int] = dataclasses.field(default_factory=list)
    noop_ns: list[int] = dataclasses.field(default_factory=list)
    noop_server_us: list[int] = dataclasses.field(default_factory=list)
    sends: int = 0
    scripts: int = 0


async def timed(call: Awaitable[Any]) -> tuple[Any, int]:
    start = time.perf_counter_ns()
    result = await call
    return result, time.perf_counter_ns() - start


@dataclass(frozen=True)
class Probes:
    """The calls timed around the step: the bare round trip (EVALSHA_RO of `BARE_SCRIPT`, no
    arguments) and the no-op floor (FCALL of `NOOP_LIBRARY` with the step's own KEYS and
    ARGV, its hashes staged as the step stages them)."""

    bare_sha: str
    keys: list[str]
    args: list[Any]
    staged: Staged | None

    def noop(self, client: Redis) -> Awaitable[Any]:
        return call_function(client, NOOP, NOOP_LIBRARY, self.keys, self.args, staged=self.staged)


async def one_step(index: PrefixIndex, probes: Probes, counter: SendCounter,
                   requests: list[StepRequest], hit: int, samples: Samples | None) -> None:
    """The no-op floor between two command-stat snapshots, then a bare round trip immediately
    followed by the step before a third, then the step's undoing; `samples` None is a warm-up.

    Back to back, the round trip and the step meet the same server and client state (a big
    step's aftermath slows the next few round trips), and the no-op meets the round trip's (it
    follows a snapshot too); the snapshots and the undoing are not timed."""
    client = index.redis
    before = await script_stats(client)
    _, noop_ns = await timed(probes.noop(client))
    between = await script_stats(client)
    _, rtt_ns = await timed(client.evalsha_ro(probes.bare_sha, 0))
    sends_before = counter.sends
    result, plan_ns = await timed(index.plan_step(requests))
    sends = counter.sends - sends_before
    after = await script_stats(client)
    plan = expect_plan(result, hit, "next turn")
    await index.confirm(plan.ticket)
    await index.release([r.rid for r in requests])
    if samples is not None:
        calls, usec = stats_delta(between, after)
        samples.plan_ns.append(plan_ns)
        samples.rtt_ns.append(rtt_ns)
        samples.script_us.append(usec)
        samples.server_us.append(stats_delta(between, after, [STEP_COMMAND])[1])
        samples.noop_ns.append(noop_ns)
        samples.noop_server_us.append(stats_delta(before, between, [STEP_COMMAND])[1])
        samples.sends += sends
        samples.scripts += calls - 1  # the bare round trip's script


def next_turns(blobs: Sequence[bytes], case: Case) -> list[StepRequest]:
    """The measured step: every conversation's second turn, its last STEP_TOKENS to compute."""
    return [StepRequest(f"c{n}.turn2", STEP_TOKENS, case.tokens, blob) for n, blob in enumerate(blobs)]


async def run_steps(index: PrefixIndex, counter: SendCounter, blobs: Sequence[bytes],
                    case: Case) -> Samples:
    """Warm-up, then the timed steps; collection is paused meanwhile and run between steps, so a
    garbage-collection pause never lands inside a timed call."""
    hit = case.tokens - STEP_TOKENS
    requests = next_turns(blobs, case)
    probes = Probes(await index.redis.script_load(BARE_SCRIPT), *index.step_arguments(requests))
    samples = Samples()
    gc.disable()
    try:
        for rep in range(case.warmup + case.reps):
            await one_step(index, probes, counter, requests, hit,
                           samples if rep >= case.warmup else None)
            gc.collect(0)
    finally:
        gc.enable()
    return samples


def summarize(case: Case, samples: Samples, hashing_ms: float) -> dict[str, Any]:
    p50, p99 = np.percentile(samples.plan_ns, [50, 99]) / 1e3
    rtt_p50 = float(np.median(samples.rtt_ns)) / 1e3
    noop_p50 = float(np.median(samples.noop_ns)) / 1e3
    return {"tokens": case.tokens, "batch": case.batch, "p50_us": round(float(p50), 1),
            "p99_us": round(float(p99), 1), "rtt_p50_us": round(rtt_p50, 1),
            "ratio_p50": round(float(p50) / rtt_p50, 3), "hash_ms": round(hashing_ms, 3),
            "script_p50_us": round(float(np.median(samples.script_us)), 1),
            "round_trips_per_step": samples.sends / case.reps,
            "scripts_per_step": samples.scripts / case.reps,
            "server_us_per_request": round(float(np.median(samples.server_us)) / case.batch, 2),
            # the steps least disturbed by other work on a shared machine: A/B comparisons
            "server_us_per_request_p10":
                round(float(np.percentile(samples.server_us, 10)) / case.batch, 2),
            "noop_p50_us": round(noop_p50, 1), "noop_ratio_p50": round(noop_p50 / rtt_p50, 3),
            "noop_server_us_per_request":
                round(float(np.median(samples.noop_server_us)) / case.batch, 2),
            "hit_tokens": case.tokens - STEP_TOKENS, "steps": case.reps}


async def measure(client: Redis, counter: SendCounter, config: Config, case: Case,
                  phases: PhaseLibrary | None = None) -> dict[str, Any]:
    """One case in its own fresh pool, whose keys are deleted afterwards (a shared Redis is left
    as it was found); with `phases`, its steps again through that instrumented library."""
    config = case_config(config, case)
    root = namespace_root(config.model.name)
    block, algo = config.cache.hash_block_tokens, config.cache.hash_algo
    index = PrefixIndex(client, f"bench-lookup-{uuid.uuid4().hex[:12]}", config)
    try:
        await index.create()
        progress(f"{case.tokens} tokens x {case.batch}: serving first turns "
                 f"({config.cache.num_pages} pages)")
        blobs = [chain_hashes(conversation_tokens(n, case.tokens), root, block, algo)
                 for n in range(case.batch)]
        await serve_first_turns(index, blobs, case.tokens - STEP_TOKENS)
        hashing_ms = hash_ms(conversation_tokens(0, case.tokens), root, config)
        samples = await run_steps(index, counter, blobs, case)
        if phases is not None:
            traced = await measure_phases(client, phases, index, next_turns(blobs, case),
                                          case.tokens - STEP_TOKENS, case.reps, case.warmup)
    finally:
        await index.drop()
    result = summarize(case, samples, hashing_ms)
    progress(f"{case.tokens} tokens x {case.batch}: p50 {result['p50_us']} us, p99 "
             f"{result['p99_us']} us, round trip {result['rtt_p50_us']} us, "
             f"ratio {result['ratio_p50']} (no-op floor {result['noop_ratio_p50']}), server "
             f"{result['server_us_per_request']} us per request")
    if phases is not None:
        result.update(summarize_phases(traced, case.batch))
        progress(f"{case.tokens} tokens x {case.batch}: phases, us per request: "
                 + ", ".join(f"{n} {us}" for n, us in result["phases_us_per_request"].items())
                 + f"; sum {result['phases_sum_us_per_request']} of the call's "
                 f"{result['phases_call_us_per_request']}; client: "
                 + ", ".join(f"{n} {us}" for n, us in result["client_us_per_request"].items()))
    return result


def progress(line: str) -> None:
    print(f"bench lookup: {line}", file=sys.stderr, flush=True)


@asynccontextmanager
async def redis_url(given: str | None) -> AsyncIterator[str]:
    """The given server, or a private one on a unix socket for the length of the run."""
    if given:
        yield given
        return
    async with RedisServer() as server:
        yield server.url


def add_case_arguments(parser: argparse.ArgumentParser, sizes: tuple[Sequence[int], Sequence[int]],
                       repeats_help: str) -> None:
    """The options every step benchmark shares: preset, server, case sizes, repetitions."""
    add_config_arguments(parser)
    parser.set_defaults(preset="kimi-k3")
    parser.add_argument("--redis", metavar="URL",
                        help="use this server (e.g. redis://host:6379) instead of a private one")
    parser.add_argument("--tokens", type=int, nargs="+", metavar="N",
                        help=f"prompt lengths (default: {' '.join(map(str, sizes[0]))})")
    parser.add_argument("--batches", type=int, nargs="+", metavar="B",
                        help=f"requests per step (default: {' '.join(map(str, sizes[1]))})")
    parser.add_argument("--repeats", type=int, metavar="N", help=repeats_help)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own options; `--json` belongs to the CLI, which prints `run`'s result."""
    add_case_arguments(parser, (TOKENS, BATCHES), "timed steps per case (default: 200, fewer for the largest)")
    parser.add_argument("--quick", action="store_true",
                        help="small prompts and batches, few steps: a smoke run for tests")
    parser.add_argument("--phases", action="store_true",
                        help="also time each phase of the step script inside Redis (a probed "
                             "copy of the library, loaded for the run)")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    cases = build_cases(args)
    check_cases(config, cases)
    counter = SendCounter()
    async with redis_url(args.redis) as url:
        pool = packing_with_hiredis(ConnectionPool.from_url(url, decode_responses=False))
        counter.install(pool)
        client = Redis(connection_pool=pool)
        try:
            version = (await client.info("server"))["redis_version"]
            # None before Redis 7, which had no such histograms
            tracking = (await client.config_get("latency-tracking")).get("latency-tracking")
            phases = phase_library() if args.phases else None
            await client.execute_command("FUNCTION", "LOAD", "REPLACE", NOOP_SOURCE)
            if phases is not None:
                await client.execute_command("FUNCTION", "LOAD", "REPLACE", phases.source)
            try:
                results = [await measure(client, counter, config, case, phases) for case in cases]
            finally:
                await client.execute_command("FUNCTION", "DELETE", NOOP_LIBRARY)
                if phases is not None:
                    await client.execute_command("FUNCTION", "DELETE", phases.name)
        finally:
            await client.aclose(close_connection_pool=True)
    # whether the server keeps per-command latency histograms, which cost a script's commands
    # (run/servers.py SCRIPT_TUNING)
    return {"cases": results, "redis_version": version, "latency_tracking": tracking,
            "preset": args.preset}
