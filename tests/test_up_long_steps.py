"""Long prompts and big batches on the cluster `cachetier up` starts, with its production Redis ACL.

The red-team finding this guards: a step whose new hashes reach 16 KiB is staged in Redis
(`index.execution.Staged`) with a command the service's ACL user lacked, so a 128K-token prompt
of the connector's 128-token unit, or any merged step of ~1,024 new blocks, failed as `internal`
on every cluster `up` started, while the suite's large steps ran on a Redis without the ACL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.up_harness import ready_up

pytestmark = pytest.mark.slow  # `up` as processes

LONG_STEPS = """
import asyncio, json, os, sys
from cachetier.client import CacheTierClient
from cachetier.config import PRESETS
from index.hashing import chain_hashes, namespace_root
from index.records import StepPlan, StepRequest
from index.redis_link import RedisTarget, close, connect
from index.store import STAGE_BYTES, PrefixIndex

def request(rid, blocks, block, root, compute):
    tokens = [hash((rid, i)) % 50_000 for i in range(blocks * block)]
    return StepRequest(rid, compute, len(tokens), chain_hashes(tokens, root, block), False)

async def through_the_service(url, token):
    tiny = PRESETS["tiny"].cache.hash_block_tokens
    root = namespace_root("tiny")
    async with CacheTierClient(url, token=token, timeout=30) as tier:
        long = await tier.plan("pool0", [request("long", 1100, tiny, root, tiny)])
        batch = await tier.plan("pool0", [request(f"b{i}", 22, tiny, root, tiny)
                                          for i in range(48)])
        for plan, rids in ((long, ["long"]), (batch, [f"b{i}" for i in range(48)])):
            assert isinstance(plan, StepPlan), plan
            await tier.release("pool0", rids)
    return [len(long.requests), len(batch.requests)]

async def kimi_on_the_index(redis_url, password):
    config = PRESETS["kimi-k3"]
    redis = connect(RedisTarget(redis_url, username="cachetier", password=password))
    try:
        index = PrefixIndex(redis, "k3", config)
        await index.create()
        block = config.cache.hash_block_tokens
        plan = await index.plan_step([request("k", (1 << 20) // block, block,
                                              namespace_root("kimi-k3"), block)])
        assert isinstance(plan, StepPlan), plan
        await index.release(["k"])
        return len(plan.requests)
    finally:
        await close(redis)

url, token, redis_url, password = sys.argv[1:5]
print(json.dumps(asyncio.run(through_the_service(url, token))
                 + [asyncio.run(kimi_on_the_index(redis_url, password))]))
"""


def test_up_plans_a_million_token_prompt_and_a_step_of_a_thousand_new_blocks(tmp_path):
    """Through `up`'s own service user: one tiny prompt of 1,100 new hash blocks, a batch of 48
    requests of 22 blocks (1,056) in one step, and a 1M-token `kimi-k3` prompt (2,048 blocks,
    32 KiB of hashes) planned on its index directly; each is staged, none is refused."""
    run_dir = tmp_path / "run"
    with ready_up(run_dir, tmp_path / "console.txt", "--agents", "1") as proc:
        addresses = json.loads((run_dir / "cluster.json").read_text())
        credentials = run_dir / "credentials"
        done = subprocess.run(
            [sys.executable, "-c", LONG_STEPS, addresses["service"],
             (credentials / "client").read_text().strip(), addresses["redis"],
             (credentials / "redis-cachetier").read_text().strip()],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [1, 48, 1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert "Traceback" not in (run_dir / "service.log").read_text()
