"""Real vLLM engines against a real cachetier cluster, for the connector's tests.

Each engine is its own process (`cachetier.vllm.engine_run.EngineProcess`), as engines are in
production: one started after another sees only what the tier holds, never the other's memory.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from cachetier.run.cluster import POOL, Cluster
from cachetier.vllm.engine_run import EngineProcess
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys

def run_engine(model: Path, workdir: Path, name: str, steps: list[list[dict[str, Any]]], *,
               info: Path | None, max_tokens: int = 8,
               engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine process over `steps`, in order: every request's result, by id (`EngineFailed`,
    with the engine's log, if it did not start or failed a step)."""
    results: dict[str, Any] = {}
    with EngineProcess(model, workdir / f"{name}.log", info=info,
                       engine_args=engine_args) as engine:
        for step in steps:
            results.update(engine.step(step, max_tokens)["requests"])
    return results


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(count)]


def request(rid: str, prompt: list[int]) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt}


async def assert_no_pins(cluster: Cluster) -> None:
    """The pool holds no request, ticket or pin (every engine released what it took), and its
    invariants hold."""
    client = aioredis.from_url(cluster.redis.url)
    try:
        state = await read_pool(client, pool_keys(POOL))
    finally:
        await client.aclose()
    cache = cluster.settings.config.cache
    sanity_check(state, cache.num_pages, cache.blocks_per_page)
    assert state.req == {} and state.tix == {}
    assert all(rec.get("ref", 0) == 0 for rec in state.pages.values())


def check_no_pins(cluster: Cluster) -> None:
    asyncio.run(assert_no_pins(cluster))
