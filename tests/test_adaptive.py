"""The adaptive policy: what the index learned for it (checkpoint classes, gains, the GreedyDual
clock, demotion of superseded turn ends, reweighing, the deepest-rung stop) in exact small cases
on a real redis-server, and the runner itself through the real index on a small synthetic trace.

Small geometry (`small_config`): 4-token hash blocks, 16-token pages, 3 KDA groups, 1 MLA group.
"""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.config import load_config
from cachetier.engine.checkpoint_placement import SEED, CheckpointPlacement
from cachetier.replay.adaptive import RECENCY, VALUE, AdaptiveRunner, Switching
from cachetier.replay.replayer import PromptHashes, ReplayContext, unlimited
from cachetier.replay.runners import replay_budget
from cachetier.replay.traces import AgenticSpec, synth_agentic
from eviction.policy import CLASSES, lru, value
from index.records import CommitItem, RequestPlan, StepRequest
from index.reference import entry_of
from index.snapshot import read_pool, sanity_check
from tests.index_harness import Driver, make, new_request, only, small_config

CONFIG = small_config(num_pages=64)
BLOCK, PAGE = 4, 16


async def serve(d: Driver, rid: str, tokens: list[int], policy: CheckpointPlacement,
                chunk: int = 64) -> list[RequestPlan]:
    """A whole prefill with `policy`'s steps and commit items, then release; returns its plans."""
    step = policy.first_step(rid, chunk, len(tokens), new_request(rid, tokens, 1, BLOCK).hashes,
                             BLOCK, PAGE)
    plans = []
    while True:
        plan = only(await d.plan([step], {rid: tokens}))
        plans.append(plan)
        await d.confirm((await d.commit([policy.commit_item(plan, len(tokens), BLOCK, PAGE)])).ticket)
        if plan.stop == len(tokens):
            break
        step = policy.next_step(rid, chunk, len(tokens), PAGE)
    await d.release([rid])
    return plans


async def state_of(d: Driver):
    state = await read_pool(d.index.redis, d.index.keys)
    sanity_check(state, CONFIG.cache.num_pages, CONFIG.cache.blocks_per_page)
    return state


def checkpoints(state) -> dict[int, tuple[str, int, int]]:
    """Boundary tokens -> (class, gain, kept) of every registered checkpoint."""
    return {rec["depth"]: (rec["cls"], rec["gain"], rec["dur"])
            for rec in (state.pages[lead] for lead in state.ck.values())}


def one_hot(cls: str, n: int) -> list[int]:
    return [n if c == cls else 0 for c in CLASSES]


async def test_release_stamps_the_pages_it_hands_to_the_cache(redis):
    d = await make(redis, CONFIG)
    await serve(d, "a", list(range(100, 110)), SEED)
    state = await state_of(d)
    (page,) = [rec for rec in state.pages.values() if rec["k"] == "M"]
    assert state.tick == 1 and page["lu"] == 1 and page["lc"] == 0


async def test_classes_and_gains_of_a_value_mode_prefill(redis):
    """42 tokens from nothing: passes stop at the page ends 16 and 32 and at the end. The rung at
    16 is not the deepest (`spec`) and does not advance the request's last kept checkpoint, so
    the rung at 32 gains all 32 tokens and the turn end 8 more."""
    d = await make(redis, CONFIG)
    plans = await serve(d, "a", list(range(200, 242)), VALUE.policy)
    assert [p.stop for p in plans] == [16, 32, 42]
    state = await state_of(d)
    assert checkpoints(state) == {16: ("spec", 16, 1), 32: ("rung", 32, 1), 40: ("turn", 8, 1)}
    anchors = {rec["depth"]: (rec["cn"], rec["cg"]) for rec in state.pages.values() if rec["k"] == "M"}
    assert anchors == {16: (one_hot("spec", 1), one_hot("spec", 16)),
                       32: (one_hot("rung", 1), one_hot("rung", 32)),
                       48: (one_hot("turn", 1), one_hot("turn", 8))}


async def test_turn_end_is_superseded_when_continued_and_promoted_on_repeat(redis):
    d = await make(redis, CONFIG)
    a = list(range(300, 342))                                      # turn end at 40, hit at 40
    await serve(d, "a", a, SEED)
    assert checkpoints(await state_of(d)) == {40: ("turn", 40, 1)}
    longer = a + list(range(500, 519))                             # resumes at 40, goes to 61
    assert (await serve(d, "b", longer, SEED))[0].hit_tokens == 40
    assert checkpoints(await state_of(d)) == {40: ("superseded", 40, 1), 60: ("turn", 20, 1)}
    state = await state_of(d)
    anchor = state.pages[next(rec["anchor"] for rec in state.pages.values() if rec.get("depth") == 40
                              and rec["k"] == "K")]
    assert anchor["cn"] == one_hot("superseded", 1) and anchor["cg"] == one_hot("superseded", 40)
    assert (await serve(d, "c", a, SEED))[0].hit_tokens == 40     # an exact repeat
    assert checkpoints(await state_of(d))[40] == ("turn", 40, 1)
    await serve(d, "d", longer, SEED)                              # superseded again, then a
    await serve(d, "e", a[:40], SEED)                              # kept duplicate promotes it
    assert checkpoints(await state_of(d))[40] == ("turn", 40, 1)


async def test_a_resend_point_is_kept_and_superseded_with_its_turn_end(redis):
    """A block-aligned prompt (40 tokens) keeps its resend point 36 beside its turn end 40, whose
    gain is then the one block past it. Its next turn resumes at 40 and goes on: both are
    superseded. A resend of the prompt hits at 36 and promotes both back."""
    d = await make(redis, CONFIG)
    a = list(range(300, 340))
    assert [p.stop for p in await serve(d, "a", a, SEED)] == [36, 40]
    assert checkpoints(await state_of(d)) == {36: ("turn", 36, 1), 40: ("turn", 4, 1)}
    longer = a + list(range(500, 519))                             # resumes at 40, goes to 59
    assert (await serve(d, "b", longer, SEED))[0].hit_tokens == 40
    assert checkpoints(await state_of(d)) == {36: ("superseded", 36, 1),
                                              40: ("superseded", 4, 1), 56: ("turn", 16, 1)}
    assert (await serve(d, "c", a, SEED))[0].hit_tokens == 36     # an exact resend
    assert checkpoints(await state_of(d)) == {36: ("turn", 36, 1), 40: ("turn", 4, 1),
                                              56: ("turn", 16, 1)}


async def test_a_prompt_resuming_at_its_own_resend_point_keeps_it_a_turn(redis):
    """x (38 tokens) keeps its turn end 36. y (x's first 36 tokens and one block more: 40) resumes
    there, and 36 is y's own resend point: it stays a turn although y registers 40 past it."""
    d = await make(redis, CONFIG)
    x = list(range(300, 338))
    await serve(d, "x", x, SEED)
    y = x[:36] + [1, 2, 3, 4]
    assert [(p.hit_tokens, p.stop) for p in await serve(d, "y", y, SEED)] == [(36, 40)]
    assert checkpoints(await state_of(d)) == {36: ("turn", 36, 1), 40: ("turn", 4, 1)}


async def test_a_resend_landing_on_an_intermediate_at_its_resend_point_keeps_it(redis):
    """a (60 tokens) is in flight with an intermediate checkpoint at 36 when b (a's first 40
    tokens, block-aligned) arrives: b hits at 36, its resend point, so the plan promotes the
    intermediate to b's turn-end class before a's next commit would recycle it."""
    d = await make(redis, CONFIG)
    a = list(range(100, 160))
    step = only(await d.plan([new_request("a", a, 36, BLOCK)], {"a": a}))
    await d.confirm((await d.commit([CommitItem("a", 36, 36, kind="intermediate")])).ticket)
    b = a[:40]
    plan = await d.plan([StepRequest("a", 8), SEED.first_step("b", 8, len(b), new_request(
        "b", b, 1, BLOCK).hashes, BLOCK, PAGE)], {"b": b})
    plans = {r.rid: r for r in plan.requests}
    assert (plans["b"].hit_tokens, plans["b"].stop, step.stop) == (36, 40, 36)
    await d.confirm((await d.commit([CommitItem("a", 44, 44, kind="intermediate"),
                                     CommitItem("b", 40, 40, kind="turn")])).ticket)
    await d.release(["a", "b"])
    assert checkpoints(await state_of(d))[36] == ("turn", 36, 1)


async def test_eviction_raises_the_greedy_dual_clock(redis):
    """Value weights: the score is the clock stamp plus value per page freed. Evicting the spec
    rung (0.02 x 16 tokens over 3 pages) raises the clock to that; then the leaf page anchoring
    the turn end (8 tokens over 1 + 3 pages) goes with it, and the clock reaches 2."""
    d = await make(redis, CONFIG)
    await d.index.reweigh(value())
    await serve(d, "a", list(range(200, 242)), VALUE.policy)
    assert [r.kind for r in (await d.evict(1)).removed] == ["ck"]
    state = await state_of(d)
    assert state.clock == (0.0 + 0.02 * 16) / 3
    assert sorted(checkpoints(state)) == [32, 40]
    assert sorted(r.kind for r in (await d.evict(1)).removed) == ["ck", "ep", "ep"]
    state = await state_of(d)
    assert state.clock == 8 / 4 and sorted(checkpoints(state)) == [32]
    await serve(d, "b", list(range(600, 610)), SEED)               # new stamps take the clock
    state = await state_of(d)
    assert sorted(rec["lc"] for rec in state.pages.values() if rec["k"] == "M") == [0, 0, 2.0]


@pytest.mark.parametrize("batch", [1, 3, 1000])
async def test_reweigh_rescores_every_member_in_bounded_batches(redis, batch):
    d = await make(redis, CONFIG)
    for n, policy in enumerate((SEED, VALUE.policy, RECENCY.policy)):
        await serve(d, f"r{n}", list(range(1000 * n, 1000 * n + 50)), policy, chunk=20)
    before = await state_of(d)
    assert before.lru == {lead: lru().score(entry_of(before.pages[lead]), 3) for lead in before.lru}
    calls = await d.index.reweigh(value(), batch)
    after = await state_of(d)
    assert calls == -(-after.fresh // batch) and after.pages == before.pages
    assert after.lru == {lead: value().score(entry_of(after.pages[lead]), 3) for lead in after.lru}
    meta = await redis.hgetall(d.index.keys[0])
    assert {k: float(meta[k.encode()]) for k in value().as_pool_fields()} == value().as_pool_fields()


async def test_stop_at_last_page_end_ends_the_step_at_the_deepest_rung(redis):
    d = await make(redis, CONFIG)
    tokens = list(range(50))                                       # page ends 16, 32, 48
    step = StepRequest("a", 50, 50, new_request("a", tokens, 1, BLOCK).hashes,
                       stop_at_last_page_end=True)
    plan = only(await d.plan([step], {"a": tokens}))
    assert (plan.stop, plan.checkpoint_tokens) == (48, 48)
    await d.commit([CommitItem("a", 48, 48, kind="rung")])
    again = only(await d.plan([StepRequest("a", 50, stop_at_last_page_end=True)], {}))
    assert (again.start, again.stop) == (48, 50)                   # past it: no effect


@pytest.mark.parametrize("prompt,at,stop,expected", [
    (40, 16, 16, ("spec", "intermediate")),       # a page end above the deepest one (32)
    (40, 32, 32, ("rung", "rung")),               # the deepest page end
    (40, 40, 40, ("turn", None)),                 # a long prompt's turn end: not with recency
    (14, 12, 14, ("turn", "turn")),               # a prompt within one page keeps its turn end
    (34, 32, 34, ("rung", "rung")),               # the turn end is the deepest page end
    (48, 48, 48, ("turn", None)),                 # a prompt ending on a page end: a turn end
    (40, 24, 24, ("intermediate", "intermediate")),
])
def test_mode_policies_class_their_checkpoints(prompt, at, stop, expected):
    plan = RequestPlan("r", hit_tokens=0, start=0, stop=stop, mla_pages=[[]], state_pages=[],
                       checkpoint_pages=[1, 2, 3], checkpoint_tokens=at, copies=[])
    kinds = tuple(mode.policy.checkpoint_kind(plan, prompt, BLOCK, PAGE) for mode in (VALUE, RECENCY))
    assert kinds == expected
    item = RECENCY.policy.commit_item(plan, prompt, BLOCK, PAGE)
    assert item.checkpoint_tokens == (0 if expected[1] is None else at)


def test_commit_item_kind_and_durable_agree():
    assert CommitItem("r", 8, 8, True).checkpoint_class == "turn"
    assert CommitItem("r", 8, 8).checkpoint_class == "intermediate"
    assert CommitItem("r", 8, 8, kind="spec").durable is True
    with pytest.raises(ValueError, match="durable"):
        CommitItem("r", 8, 8, True, "intermediate")


# -- the runner through the real index --------------------------------------------------------

TRACE = synth_agentic(AgenticSpec(sessions=24, seed=3, max_context=60_000, long_fraction=0.3))
KIMI = load_config("kimi-k3")


async def test_adaptive_beats_every_baseline_at_a_tight_budget(redis):
    """40 GB of kimi-k3 (245 page ids) for 24 agentic sessions (443 requests up to 60k tokens)."""
    policies = ("seed", "branch", "ladder", "coupled", "adaptive")
    prompts = PromptHashes(KIMI.model.name, KIMI.cache.hash_algo)
    result = await replay_budget(redis, TRACE, KIMI, 40 * 10**9, policies, 8192, prompts)
    ratios = {name: r.hit_ratio for name, r in result.policies.items()}
    assert ratios["adaptive"] >= max(ratios[p] for p in policies[:-1]), ratios


async def test_the_live_pool_follows_the_shadow_that_served_more(redis):
    """At 20 GB the recency shadow wins windows of this trace: each decision switches the live
    pool's admission and its weights (rescored in Redis) to the best shadow's mode."""
    pages = 20 * 10**9 // KIMI.geometry.page_id_bytes
    sized = dataclasses.replace(KIMI, cache=dataclasses.replace(KIMI.cache, num_pages=pages))
    ctx = ReplayContext(redis, sized, 8192, PromptHashes(KIMI.model.name, KIMI.cache.hash_algo))
    runner = AdaptiveRunner.for_replay(ctx, Switching(window=50, every=50, margin=0.0))
    await runner.setup(redis)
    assert runner.mode is VALUE and len(runner.shadows) == 2
    for request in sorted(TRACE, key=lambda r: r.timestamp):
        await runner.serve(request)
        if runner.seen % 50 == 0:
            hits = [sum(h[i] for _, h in runner.recent) for i in range(2)]
            assert hits[runner.current] == max(hits)
    assert "recency" in [mode for _, mode in runner.switches]
    assert runner.live.policy is runner.mode.policy
    assert runner.live.index.weights == runner.mode.weights
    meta = await redis.hgetall(runner.live.index.keys[0])
    fields = runner.mode.weights.as_pool_fields()
    assert {k: float(meta[k.encode()]) for k in fields} == fields
    state = await read_pool(redis, runner.live.index.keys)
    assert state.lru == {lead: runner.mode.weights.score(entry_of(state.pages[lead]), 3)
                         for lead in state.lru}


async def test_no_shadow_at_unlimited_capacity(redis):
    ctx = ReplayContext(redis, KIMI, 8192, PromptHashes(KIMI.model.name, KIMI.cache.hash_algo))
    runner = AdaptiveRunner.for_replay(dataclasses.replace(ctx, config=unlimited(KIMI)))
    assert runner.shadows == [] and runner.mode is VALUE
