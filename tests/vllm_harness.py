"""Real vLLM engines against a real cachetier cluster, for the connector's tests.

Each engine is its own process (`cachetier.vllm.engine_run.EngineProcess`), as engines are in
production: one started after another sees only what the tier holds, never the other's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from cachetier.run.cluster import POOL, Cluster
from cachetier.run.vllm_cluster import vllm_cluster_settings
from cachetier.vllm.engine_run import EngineProcess
from cachetier.vllm.info import connector_info, write_info
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


@contextlib.contextmanager
def vllm_cluster(model_dir: Path, run_dir: Path, pool_pages: int) -> Iterator[Cluster]:
    """`cachetier up --vllm-model`'s cluster for `model_dir`, with its info file written to
    `<run_dir>/info.json` (the path engines are given)."""
    settings = vllm_cluster_settings(model_dir, run_dir=run_dir, port=0, pool_pages=pool_pages)
    with Cluster(settings) as running:
        write_info(running.run_dir / "info.json",
                   connector_info(service=running.service_url, token=settings.token, pool=POOL,
                                  handle_file=running.handle_file(0), model_dir=model_dir,
                                  config=settings.config))
        yield running


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
