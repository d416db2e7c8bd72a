"""The oracle: sessions served through the real service, agent and pool by `PrefillScheduler` with
the tiny hybrid model; every output computed after a hit must equal a cold recompute.

In-process service and agent (asyncio tasks) on a real redis-server, for speed; `cachetier demo`
runs the same engine across processes (tests/test_cluster.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cachetier.client import CacheTierClient
from cachetier.config import PRESETS, Config
from cachetier.engine.checkpoint_placement import BRANCH, PLACEMENTS, SEED, CheckpointPlacement
from cachetier.engine.scheduler import PrefillScheduler, RequestResult
from cachetier.engine.sessions import Session, SessionSpec, make_sessions
from gpu_pool import PagedPool
from index.records import RequestPlan
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from tests.cluster_harness import TOKEN, running_agent, running_service
from tinymodel import TinyHybrid

FAMILIES = ["tiny", "tiny-gqa"]  # KDA + MLA, Gated DeltaNet + GQA
MODELS = {name: TinyHybrid(PRESETS[name].model) for name in FAMILIES}
SMALL = SessionSpec(sessions=3, turns=2, system_prompts=2, tool_sets=1, system_tokens=(10, 40),
                    tool_tokens=(5, 20), message_tokens=(3, 15), tool_output_tokens=(5, 30),
                    reply_tokens=(3, 10), fork_fraction=0.4, think_steps=(0, 2))
_pools = itertools.count()


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """The preset of the model family the test serves."""
    return request.param


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model's matmuls only lose from a thread pool on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Served:
    results: list[RequestResult]
    scheduler: PrefillScheduler
    pool: PagedPool


@contextlib.asynccontextmanager
async def tier_for(redis_url: str, num_pages: int, family: str = "tiny"
                   ) -> AsyncIterator[tuple[CacheTierClient, str, PagedPool, Config]]:
    """A service, one agent and a client on a fresh pool of `num_pages` pages of `family`'s
    preset."""
    base = PRESETS[family]
    config = replace(base, cache=replace(base.cache, num_pages=num_pages))
    pool_id = f"e{next(_pools)}"
    async with (running_service(redis_url, config) as service,
                running_agent(service.url, pool=pool_id) as agent,
                CacheTierClient(service.url, token=TOKEN, timeout=30) as tier):
        yield tier, pool_id, PagedPool.attach(agent.handle()), config


async def serve(tier: CacheTierClient, pool_id: str, pool: PagedPool, config: Config,
                sessions: list[Session], policy: CheckpointPlacement = BRANCH,
                chunk: int = 24) -> Served:
    scheduler = PrefillScheduler(tier, pool_id, config, policy, MODELS[config.model.name], [pool],
                                 chunk_tokens=chunk, max_batch=4)
    return Served(await scheduler.run(sessions), scheduler, pool)


async def check_pool(redis, pool_id: str, config: Config) -> None:
    state = await read_pool(redis, pool_keys(pool_id))
    sanity_check(state, config.cache.num_pages, config.cache.blocks_per_page)
    assert not state.req, "a finished request was left in the index"


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(seed=4917, chunk=16, policy='branch', pages=256)
@given(seed=st.integers(0, 10_000), chunk=st.integers(5, 70),
       policy=st.sampled_from(sorted(PLACEMENTS)), pages=st.sampled_from([40, 256]))
async def test_every_output_after_a_hit_equals_a_cold_recompute(redis, redis_url, family, seed,
                                                                 chunk, policy, pages):
    """Random agentic workloads: shared system prompts, forks part-way through a turn, multi-turn
    sessions interleaved within steps, chunk sizes unrelated to the 16-token hash block, and a
    40-page pool where eviction runs all the time; for both model families."""
    sessions = make_sessions(replace(SMALL, seed=seed))
    async with tier_for(redis_url, pages, family) as (tier, pool_id, pool, config):
        served = await serve(tier, pool_id, pool, config, sessions, PLACEMENTS[policy], chunk)
    bad = [r for r in served.results if not r.verified]
    assert not bad, f"outputs differ from recompute: {bad}"
    assert len(served.results) == sum(len(s.prompts) for s in sessions)
    later = [r for r in served.results if r.turn > 0]
    if pages == 256:  # no eviction: every later turn resumes at least at its previous turn end
        assert all(r.hit_tokens > 0 for r in later if r.prompt_tokens > 2 * 16)
    await check_pool(redis, pool_id, config)


@pytest.mark.parametrize("policy", sorted(PLACEMENTS))
async def test_a_turn_that_ends_on_another_requests_intermediate_keeps_it(redis, redis_url, family,
                                                                         policy):
    """The hypothesis example seed=4917: `a` checkpoints 16 as an intermediate in step 0; `b`
    (sharing 21 tokens) arrives in step 1 and hits there, and 16 is its turn end, so its one pass
    (16 -> 25) writes no checkpoint; `a`'s turn-end commit in that step recycles its intermediate.
    The plan keeps it as `b`'s turn end, so `b`'s next turn resumes at 16."""
    a = list(range(1000, 1040))
    b = a[:21] + list(range(2000, 2004))
    sessions = [Session("a", [a], [0]), Session("b", [b, b + list(range(3000, 3011))], [0, 0])]
    async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
        served = await serve(tier, pool_id, pool, config, sessions, PLACEMENTS[policy], chunk=16)
        await check_pool(redis, pool_id, config)
    hits = {(r.session, r.turn): r.hit_tokens for r in served.results}
    assert all(r.verified for r in served.results)
    assert hits == {("a", 0): 0, ("b", 0): 16, ("b", 1): 16}


@pytest.mark.parametrize("part", ["conv", "recurrent"])
async def test_a_corrupted_checkpoint_page_is_reported_as_a_mismatch(redis, redis_url, family,
                                                                      part):
    """The check can fail: 40 bytes of one part of one layer's state in the checkpoint a later turn
    restores are scribbled (the conv rows of a few v channels, or one head's recurrent matrix)."""
    first = [0, *range(1000, 1100)]
    follow_up = first + list(range(5000, 5040))
    async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
        await serve(tier, pool_id, pool, config, [Session("a", [first], [0])])
        state = await read_pool(redis, pool_keys(pool_id))
        (lead,) = state.ck.values()
        page = state.pages[lead]["pages"][1]              # the second KDA group's page
        layout = pool.layout
        group = layout.model.value_heads_per_key_head  # GDN: the heads of one key head
        (_, _, (_, v_rows)), = [layout.conv_rows(range(group, 2 * group))]
        start = (layout.conv_range(v_rows) if part == "conv" else layout.kda_head_range(1)).offset
        assert (start + 40 <= layout.recurrent_offset) == (part == "conv")
        pool.buffer[0, page, start:start + 40] += 1
        served = await serve(tier, pool_id, pool, config, [Session("b", [follow_up], [0])])
    (result,) = served.results
    assert result.hit_tokens == len(first) // 16 * 16
    assert result.verified is False and result.max_abs_error > 0


async def test_an_untouched_pool_gives_the_same_turn_a_clean_verdict(redis, redis_url, family):
    """The control of the test above: same prompts, no scribble, no mismatch."""
    first = [0, *range(1000, 1100)]
    follow_up = first + list(range(5000, 5040))
    async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
        await serve(tier, pool_id, pool, config, [Session("a", [first], [0])])
        served = await serve(tier, pool_id, pool, config, [Session("b", [follow_up], [0])])
    (result,) = served.results
    assert result.hit_tokens == len(first) // 16 * 16 and result.verified is True


async def test_checkpoints_stay_sparse_one_per_turn_plus_branch_points(redis, redis_url, family):
    spec = SessionSpec(sessions=4, turns=3, fork_fraction=0.0, system_tokens=(40, 80),
                       tool_tokens=(20, 40), message_tokens=(10, 30), tool_output_tokens=(20, 60),
                       reply_tokens=(5, 15))
    sessions = make_sessions(spec)
    async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
        served = await serve(tier, pool_id, pool, config, sessions, BRANCH, chunk=16)
        state = await read_pool(redis, pool_keys(pool_id))
    assert all(r.verified for r in served.results)
    turns = sum(len(s.prompts) for s in sessions)
    branch_points = sum(r.hit_tokens < r.match_tokens for r in served.results)
    blocks = sum(r.prompt_tokens // 16 for r in served.results)
    # a 16-token chunk crosses a hash block every step: without recycling there would be one
    # checkpoint per block
    assert len(state.ck) <= turns + branch_points
    assert len(state.ck) * 4 < blocks


async def test_a_branch_point_checkpoint_serves_the_next_session_at_full_depth(redis, redis_url,
                                                                               family):
    """Three sessions share a 70-token prefix that no turn ends on. With `seed` the third still
    finds no checkpoint inside it; with `branch` the second one leaves one at the MLA match end
    (64 tokens) and the third hits there."""
    shared = list(range(300, 370))
    prompts = [shared + list(range(n * 100, n * 100 + 30)) for n in (10, 20, 30)]
    hits = {}
    for policy in (SEED, BRANCH):
        async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
            results = []
            for n, prompt in enumerate(prompts):
                served = await serve(tier, pool_id, pool, config, [Session(f"s{n}", [prompt], [0])],
                                     policy, chunk=32)
                results += served.results
        assert all(r.verified for r in results)
        hits[policy.name] = [r.hit_tokens for r in results]
    assert hits == {"seed": [0, 0, 0], "branch": [0, 0, 64]}


@pytest.mark.parametrize("policy,stop,expected", [
    (SEED, 48, False), (SEED, 96, True), (BRANCH, 64, True), (PLACEMENTS["ladder"], 128, True),
    (PLACEMENTS["ladder"], 112, False)])
def test_commit_items_keep_turn_ends_branch_points_and_ladder_rungs(policy, stop, expected):
    plan = RequestPlan("r", hit_tokens=16, start=stop - 16, stop=stop, mla_pages=[[]],
                       state_pages=[], checkpoint_pages=[1, 2, 3], checkpoint_tokens=stop,
                       copies=[], match_tokens=64)
    item = policy.commit_item(plan, prompt_tokens=100, block_tokens=16, page_tokens=64)
    assert (item.stop, item.checkpoint_tokens, item.durable) == (stop, stop, expected)


@pytest.mark.parametrize("policy,prompt,expected", [
    (SEED, 100, "turn"), (BRANCH, 100, "turn"), (SEED, 10, None), (PLACEMENTS["ladder"], 65, "rung"),
    (SEED, 96, "turn"), (PLACEMENTS["ladder"], 80, "rung"),
    (CheckpointPlacement("recency", deepest_rung=True, short_turn_ends=True), 48, "turn"),
    (CheckpointPlacement("recency", deepest_rung=True, short_turn_ends=True), 96, None),
    (CheckpointPlacement("recency", deepest_rung=True, short_turn_ends=True), 60, "turn"),
    (CheckpointPlacement("recency", deepest_rung=True, short_turn_ends=True), 100, None),
    (CheckpointPlacement("recency", deepest_rung=True, short_turn_ends=True), 65, "rung")])
def test_first_steps_carry_the_class_the_policy_keeps_the_turn_end_as(policy, prompt, expected):
    """What a pass computing the deepest boundary a hit can reach (the turn end, or an aligned
    prompt's resend point one block before it) would commit it as, for a hit landing there."""
    step = policy.first_step("r", 8, prompt, b"", block_tokens=16, page_tokens=64)
    assert step.turn_end_kind == expected
    if expected is not None:
        deepest_hit = (prompt - 1) // 16 * 16
        plan = RequestPlan("r", hit_tokens=0, start=deepest_hit - 1, stop=deepest_hit,
                           mla_pages=[[]], state_pages=[], checkpoint_pages=[1, 2, 3],
                           checkpoint_tokens=deepest_hit, copies=[], match_tokens=0)
        assert policy.checkpoint_kind(plan, prompt, 16, 64) == expected


@pytest.mark.parametrize("policy", sorted(PLACEMENTS))
async def test_a_resent_prompt_hits_one_block_short_and_its_next_turn_at_its_end(redis, redis_url,
                                                                                 family, policy):
    """A prompt, the same prompt again, then its next turn, for a block-aligned prompt within a
    page (48 tokens), one of two pages (128) and one that is not aligned (100): the resend hits
    at (P - 1) // 16 * 16 (the aligned prompt's resend point, one block before its turn end), the
    next turn at P // 16 * 16, and every output equals a cold recompute."""
    for length in (48, 128, 100):
        prompt = list(range(7000, 7000 + length))
        turns = [prompt, prompt, prompt + list(range(8000, 8020))]
        async with tier_for(redis_url, 256, family) as (tier, pool_id, pool, config):
            results = []
            for n, tokens in enumerate(turns):
                served = await serve(tier, pool_id, pool, config, [Session(f"s{n}", [tokens], [0])],
                                     PLACEMENTS[policy], chunk=24)
                results += served.results
            await check_pool(redis, pool_id, config)
        assert all(r.verified for r in results)
        assert [r.hit_tokens for r in results] == [0, (length - 1) // 16 * 16, length // 16 * 16]
