"""The replay runners by name (`RUNNERS`) and the driver that replays a trace on each of them.

The registry lives here, above both `replayer` (the pool runner that every fixed runner is) and
`adaptive` (built on the pool runner), so the replayer never imports the adaptive runner that
imports it. The adaptive runner is imported when it is asked for, so a tree without `adaptive.py`
still replays the others and says why adaptive is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from redis.asyncio import BlockingConnectionPool, Redis

from cachetier.config import Config
from cachetier.engine.checkpoint_placement import BRANCH, LADDER, SEED
from cachetier.replay.replayer import (BudgetResult, PolicyCounters, PolicyResult, PolicyRunner,
                                       PromptHashes, ReplayContext, ReplayError, ServedRequest,
                                       budget_pages, coupled, full_attention, unlimited)
from cachetier.replay.traces import TraceRequest
from cachetier.run.progress import ProgressBar
from cachetier.run.servers import RedisServer
from index.redis_link import packing_with_hiredis


def _adaptive(ctx: ReplayContext) -> PolicyRunner:
    try:
        from cachetier.replay.adaptive import AdaptiveRunner
    except ModuleNotFoundError as exc:
        if exc.name != "cachetier.replay.adaptive":
            raise
        raise ReplayError("replay runner adaptive is not available: cachetier/replay/adaptive.py "
                          "is missing (run the others with --policies)") from None
    return AdaptiveRunner.for_replay(ctx)


# A full-attention pool plans no checkpoint, so its CheckpointPlacement only ends steps at chunks.
RUNNERS: dict[str, Callable[[ReplayContext], PolicyRunner]] = {
    # the upper bound, unlimited at every budget by definition
    "oracle": lambda ctx: ctx.pool("oracle", unlimited(full_attention(ctx.config)), SEED),
    "seed": lambda ctx: ctx.pool("seed", ctx.config, SEED),
    "branch": lambda ctx: ctx.pool("branch", ctx.config, BRANCH),
    "ladder": lambda ctx: ctx.pool("ladder", ctx.config, LADDER),
    "coupled": lambda ctx: ctx.pool("coupled", coupled(ctx.config), SEED),
    "full-6144": lambda ctx: ctx.pool("full-6144", coupled(full_attention(ctx.config)), SEED),
    "adaptive": _adaptive,
}
RUNNER_NAMES = tuple(RUNNERS)


# -- the driver ------------------------------------------------------------------------------------

def check_runners(names: Sequence[str]) -> None:
    """Refuse unknown or repeated runner names from callers that bypass the CLI (which parses
    `--policies` with `cli.registry_names`): a repeated runner would replay on the same pool."""
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown replay runner {unknown[0]!r}; expected one of "
                         f"{', '.join(RUNNER_NAMES)}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"replay runners must be distinct, at least one; got "
                         f"{', '.join(names) or 'none'}")


async def replay_budget(redis: Redis, requests: Sequence[TraceRequest], config: Config,
                        budget_bytes: int | None, policies: Sequence[str], chunk_tokens: int,
                        prompts: PromptHashes | None = None, pool_prefix: str = "replay",
                        progress: ProgressBar | None = None) -> BudgetResult:
    """Every replay runner replays the requests on its own pool, all concurrently: Redis runs
    one runner's script while Python prepares another's call."""
    check_runners(policies)
    pages = budget_pages(budget_bytes, config)
    sized = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_pages=pages))
    prompts = prompts or PromptHashes(config.model.name, config.cache.hash_algo)
    ctx = ReplayContext(redis, sized, chunk_tokens, prompts, pool_prefix)
    runners = [RUNNERS[name](ctx) for name in policies]
    for runner in runners:
        await runner.setup(redis)
    ordered = sorted(requests, key=lambda r: r.timestamp)
    started = time.monotonic()
    results = await asyncio.gather(*(_drive(r, ordered, progress) for r in runners))
    limited = None if budget_bytes is None else pages
    return BudgetResult(budget_bytes, {
        runner.name: PolicyResult(runner.name, served, counters,
                                  None if runner.name == "oracle" else limited, wall_s)
        for runner, (served, counters, wall_s) in zip(runners, results)},
        time.monotonic() - started)


async def _drive(runner: PolicyRunner, requests: Sequence[TraceRequest],
                 progress: ProgressBar | None) -> tuple[list[ServedRequest], PolicyCounters, float]:
    started = time.monotonic()
    served = []
    for request in requests:
        served.append(await runner.serve(request))
        if progress is not None:
            progress.advance()
    return served, await runner.counters(), time.monotonic() - started


async def replay_trace(requests: Sequence[TraceRequest], config: Config,
                       budgets: Sequence[int | None], policies: Sequence[str],
                       chunk_tokens: int, show_progress: bool = True) -> list[BudgetResult]:
    """Each budget on fresh pools of a project-started redis-server, one after the other."""
    check_runners(policies)
    prompts = PromptHashes(config.model.name, config.cache.hash_algo)
    out = []
    async with RedisServer() as server:
        pool = packing_with_hiredis(
            BlockingConnectionPool.from_url(server.url, max_connections=64, timeout=30))
        redis = Redis(connection_pool=pool)
        try:
            for n, budget in enumerate(budgets):
                label = "unlimited" if budget is None else f"{budget / 1e9:g} GB"
                bar = ProgressBar(len(requests) * len(policies), f"replay {label}",
                                  enabled=show_progress)
                out.append(await replay_budget(redis, requests, config, budget, policies,
                                               chunk_tokens, prompts, f"replay{n}", bar))
                await redis.flushall()  # the next budget starts cold
        finally:
            await redis.aclose(close_connection_pool=True)
    return out
