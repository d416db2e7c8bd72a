"""The index's flows against a real redis-server: the seed's example and the basic promises."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachetier.config import CacheSpec, Config, ModelSpec
from index.hashing import chain_hashes, namespace_root
from index.records import StepRequest
from index.snapshot import read_pool, sanity_check
from index.store import PrefixIndex
from tests.index_harness import (ROOT, Driver, commit_item, make, new_request, only, serve,
                                 small_config)

SEED = Config(ModelSpec(), CacheSpec(hash_block_tokens=512, page_tokens=6144, num_pages=64))


async def check(d: Driver, config: Config) -> None:
    state = await read_pool(d.index.redis, d.index.keys)
    sanity_check(state, config.cache.num_pages, config.cache.blocks_per_page)


async def test_seed_example_hits_at_2560_inside_a_6144_page(redis):
    d = await make(redis, SEED)
    doc = [7 + i % 997 for i in range(6144)]
    await serve(d, "turn1", doc[:2600], chunk=2600)       # durable checkpoint at 2,560
    await serve(d, "turn2", doc, chunk=6144)              # the page fills to 6,144 tokens
    probe = doc[:2800] + [1] * 1200                        # first 2,800 tokens match
    plan = only(await d.plan([new_request("probe", probe, 4000, 512)], {"probe": probe}))
    assert plan.hit_tokens == 2560 and plan.start == 2560
    cow = [c for c in plan.copies if c.dst not in plan.state_pages]
    assert len(cow) == 1 and cow[0].offset == 0
    assert cow[0].nbytes == 2560 * SEED.model.mla_token_bytes
    assert cow[0].dst == plan.mla_pages[0][0]
    restore = [c for c in plan.copies if c.dst in plan.state_pages]
    assert [c.dst for c in restore] == plan.state_pages
    assert all(c.nbytes == SEED.model.kda_rank_layer_bytes for c in restore)
    await check(d, SEED)


async def test_request_shorter_than_a_page_hits(redis):
    config = small_config()
    d = await make(redis, config)
    prompt = list(range(100, 110))                        # 10 tokens < one 16-token page
    await serve(d, "a", prompt, chunk=10)
    again = prompt + [5, 6, 7]
    plan = only(await d.plan([new_request("b", again, 16, 4)], {"b": again}))
    assert plan.hit_tokens == 8                            # the last 4-token block boundary
    await check(d, config)


async def test_chunked_prefill_exports_each_boundary_before_finishing(redis):
    config = small_config(num_pages=64)
    d = await make(redis, config)
    doc = list(range(1000, 1064))
    plan = await d.plan([new_request("long", doc, 6, 4)], {"long": doc})
    await d.confirm(plan.ticket)
    stop = 0
    for chunk_end in (6, 13, 22, 40):
        r = d.plans["long"]
        c = await d.commit([commit_item(r, chunk_end, False, True, 4)])
        await d.confirm(c.ticket)
        stop = chunk_end
        boundary = stop // 4 * 4
        probe = doc[:boundary + 1]
        hit = only(await d.plan([new_request(f"p{stop}", probe, 1, 4)], {f"p{stop}": probe}))
        assert hit.hit_tokens == boundary, (stop, hit.hit_tokens)
        await d.release([f"p{stop}"])
        nxt = await d.plan([StepRequest("long", {6: 7, 13: 9, 22: 18, 40: 10}[stop])], {})
        await d.confirm(nxt.ticket)
    await check(d, config)


async def test_namespaces_never_share_an_entry(redis):
    config = small_config()
    d = await make(redis, config)
    prompt = list(range(40))
    await serve(d, "a", prompt, chunk=40)
    other = namespace_root("test-model", tenant_salt="tenant-b")
    req = StepRequest("b", 40, 40, chain_hashes(prompt, other, 4))
    assert only(await d.plan([req], {"b": prompt})).hit_tokens == 0
    longer = prompt + [1]
    same = only(await d.plan([new_request("c", longer, 41, 4)], {"c": longer}))
    assert same.hit_tokens == 40


async def test_full_attention_pool_hits_without_checkpoints(redis):
    config = small_config(kda_groups=0)
    d = await make(redis, config)
    prompt = list(range(50))
    await serve(d, "a", prompt, chunk=50)
    plan = only(await d.plan([new_request("b", prompt[:30], 30, 4)], {"b": prompt[:30]}))
    assert plan.hit_tokens == 28 and plan.state_pages == [] and plan.checkpoint_pages == []


async def test_two_mla_groups_copy_on_write_in_each_group(redis):
    config = small_config(mla_groups=2)
    d = await make(redis, config)
    prompt = list(range(200, 230))
    await serve(d, "a", prompt[:22], chunk=22)             # checkpoint at 20, inside page 2
    plan = only(await d.plan([new_request("b", prompt, 30, 4)], {"b": prompt}))
    assert plan.hit_tokens == 20
    cow = [c for c in plan.copies if c.dst not in plan.state_pages]
    assert sorted(c.dst for c in cow) == sorted([plan.mla_pages[0][1], plan.mla_pages[1][1]])
    await check(d, config)


async def test_sha256_pool_hits_and_refuses_short_hashes(redis):
    base = small_config()
    config = Config(base.model, CacheSpec(**{**base.cache.__dict__, "hash_algo": "sha256"}))
    index = PrefixIndex(redis, "sha", config)
    await index.create()
    root = namespace_root("test-model", algo="sha256")
    prompt = list(range(300, 330))
    first = StepRequest("a", 30, 30, chain_hashes(prompt, root, 4, "sha256"))
    step = await index.plan_step([first])
    await index.confirm(step.ticket)
    await index.confirm((await index.commit([commit_item(only(step), 30, True)])).ticket)
    probe = prompt + [1]
    again = StepRequest("b", 31, 31, chain_hashes(probe, root, 4, "sha256"))
    assert only(await index.plan_step([again])).hit_tokens == 28
    with pytest.raises(ValueError, match="hash bytes"):
        await index.plan_step([StepRequest("c", 31, 31, chain_hashes(probe, ROOT, 4))])


async def test_commit_drops_restore_pins_even_without_confirming_the_plan(redis):
    config = small_config()
    d = await make(redis, config)
    prompt = list(range(500, 530))
    await serve(d, "a", prompt, chunk=30)
    longer = prompt + [9] * 6
    step = await d.plan([new_request("b", longer, 36, 4)], {"b": longer})
    restore_src = only(step).copies[0].src
    state = await read_pool(redis, d.index.keys)
    ck_lead = next(lead for lead, rec in state.pages.items() if "pages" in rec and restore_src in rec["pages"])
    assert state.pages[ck_lead]["ref"] == 1
    await d.index.commit([commit_item(only(step), 36)])
    after = await read_pool(redis, d.index.keys)
    assert after.pages[ck_lead]["ref"] == 0 and ck_lead in after.lru
    sanity_check(after, config.cache.num_pages, config.cache.blocks_per_page)


async def test_release_leaves_no_ticket_behind(redis):
    """A failed step is released without confirming: its ticket must not stay in Redis forever."""
    d = await make(redis, small_config())
    step = await d.plan([new_request("a", list(range(20)), 20, 4), new_request("b", list(range(50, 70)), 20, 4)],
                        {"a": list(range(20)), "b": list(range(50, 70))})
    await d.release(["a"])
    assert list((await read_pool(redis, d.index.keys)).tix) == [step.ticket]
    await d.release(["b"])
    assert (await read_pool(redis, d.index.keys)).tix == {}


async def test_the_library_reloads_after_a_function_flush(redis, redis_operator):
    """Redis restarted empty or flushed its functions: the next call loads the library
    ("Function not found") and runs."""
    d = await make(redis, small_config())
    await serve(d, "a", list(range(20)), chunk=20)
    await redis_operator.function_flush()
    probe = list(range(21))
    assert only(await d.plan([new_request("b", probe, 1, 4)], {"b": probe})).hit_tokens == 20
    d.index.stage_bytes = 0  # a step with staged hashes: reloaded, sent again with them
    await redis_operator.function_flush()
    assert only(await d.plan([new_request("c", probe, 1, 4)], {"c": probe})).hit_tokens == 20
    assert not await redis_operator.keys("*:stage:*")


async def test_branch_point_step_stops_at_the_mla_match_and_its_checkpoint_serves_the_next(redis):
    """A hit limited by checkpoints (MLA matches further) is split at the MLA match end; the
    durable checkpoint committed there lets the next request sharing that prefix hit at full depth.
    Without the split, the same next request hits nothing."""
    config = small_config()
    d = await make(redis, config)
    trunk = [50 + i for i in range(30)]
    await serve(d, "a", trunk + [1] * 10, chunk=64)            # checkpoint at 40 only
    b = trunk + [2] * 10
    step = await d.plan([replace(new_request("b", b, 64, 4), stop_at_match=True)], {"b": b})
    plan = only(step)
    assert (plan.hit_tokens, plan.match_tokens, plan.stop, plan.checkpoint_tokens) == (0, 28, 28, 28)
    await d.confirm(step.ticket)
    await d.confirm((await d.commit([commit_item(plan, 28, durable=True)])).ticket)
    step = await d.plan([StepRequest("b", 64, stop_at_match=True)], {})
    rest = only(step)
    assert (rest.start, rest.stop, rest.match_tokens) == (28, 40, 28)
    await d.confirm(step.ticket)
    await d.confirm((await d.commit([commit_item(rest, 40, durable=True)])).ticket)
    await d.release(["b"])
    c = trunk + [3] * 10
    assert only(await d.plan([new_request("c", c, 64, 4)], {"c": c})).hit_tokens == 28
    await check(d, config)


async def test_without_the_branch_split_the_shared_prefix_is_not_restorable(redis):
    config = small_config()
    d = await make(redis, config)
    trunk = [50 + i for i in range(30)]
    await serve(d, "a", trunk + [1] * 10, chunk=64)
    await serve(d, "b", trunk + [2] * 10, chunk=64)
    c = trunk + [3] * 10
    plan = only(await d.plan([new_request("c", c, 64, 4)], {"c": c}))
    assert (plan.hit_tokens, plan.match_tokens) == (0, 28)
    await check(d, config)


async def test_page_end_stops_cut_every_step_at_the_next_page_end(redis):
    config = small_config()                                     # 16-token pages
    d = await make(redis, config)
    tokens = list(range(200, 250))
    step = replace(new_request("a", tokens, 40, 4), stop_at_page_end=True)
    stops = []
    while True:
        planned = await d.plan([step], {"a": tokens})
        r = only(planned)
        stops.append(r.stop)
        await d.confirm(planned.ticket)
        await d.confirm((await d.commit([commit_item(r, r.stop, durable=True)])).ticket)
        if r.stop == len(tokens):
            break
        step = StepRequest("a", 40, stop_at_page_end=True)
    assert stops == [16, 32, 48, 50]
    await d.release(["a"])
    again = tokens[:40] + [9] * 5
    assert only(await d.plan([new_request("b", again, 8, 4)], {"b": again})).hit_tokens == 32
    await check(d, config)


async def test_a_checkpoint_anchored_on_another_requests_pending_endpoint_waits_for_it(redis):
    """Two requests of one step compute the same prefix: the second one's checkpoint anchors on
    the first one's pending endpoint. Confirming the second alone must not make it matchable
    (invariant 2: the endpoint's bytes are not confirmed), and releasing the first unconfirmed
    must take the checkpoint with it."""
    config = small_config()
    d = await make(redis, config)
    a, b = list(range(60, 80)) + [1] * 4, list(range(60, 80)) + [2]  # b's checkpoint: at 20
    step = await d.plan([new_request("a", a, 24, 4), new_request("b", b, 24, 4)], {"a": a, "b": b})
    await d.confirm(step.ticket)
    plans = {r.rid: r for r in step.requests}
    await d.commit([commit_item(plans["a"], 24, durable=True)])
    second = await d.commit([commit_item(plans["b"], 21, durable=True)])
    assert second.requests[0].checkpoint == "registered"      # anchored on a's pending page
    await d.confirm(second.ticket)
    probe = list(range(60, 80)) + [3] * 4
    hit = only(await d.plan([new_request("p", probe, 4, 4)], {"p": probe})).hit_tokens
    assert hit == 0, "a checkpoint on an unconfirmed endpoint was matched"
    await d.release(["p", "a"])                                  # a never confirmed its commit
    state = await read_pool(redis, d.index.keys)
    assert not state.ck, "the checkpoint outlived the endpoint it was anchored on"
    await d.release(["b"])
    await check(d, config)


@pytest.mark.parametrize("turn_end_kind,kept", [("turn", True), (None, False)])
async def test_a_hit_exactly_at_the_turn_end_keeps_the_intermediate_it_restores(redis,
                                                                                turn_end_kind, kept):
    """b's prompt branches off a's while a is in flight, and b's turn end (8) is a's intermediate
    checkpoint: b hits there and its one pass (8 -> 11) writes no checkpoint, so the restored one
    *is* b's turn end. a's next commit in the same step recycles its intermediate; with b's
    `turn_end_kind` the plan has promoted it first, so b's next turn resumes at 8. Without it (a
    policy keeping no turn end there) it is recycled as before."""
    config = small_config()
    d = await make(redis, config)
    a = list(range(100, 140))
    step = await d.plan([new_request("a", a, 8, 4)], {"a": a})
    await d.confirm(step.ticket)
    await d.confirm((await d.commit([commit_item(only(step), 8)])).ticket)  # intermediate at 8
    b = a[:10] + [7]
    step = await d.plan([StepRequest("a", 8),
                         replace(new_request("b", b, 8, 4), turn_end_kind=turn_end_kind)],
                        {"b": b})
    plans = {r.rid: r for r in step.requests}
    assert (plans["b"].hit_tokens, plans["b"].stop, plans["b"].checkpoint_tokens) == (8, 11, 0)
    await d.confirm(step.ticket)
    commit = await d.commit([commit_item(plans["a"], 16), commit_item(plans["b"], 11)])
    await d.confirm(commit.ticket)
    await d.release(["b"])
    state = await read_pool(redis, d.index.keys)
    hashes = chain_hashes(b, ROOT, 4)                  # two blocks: the second one ends at 8
    at_8 = hashes[len(hashes) // 2:]
    assert (at_8 in state.ck) is kept
    if kept:
        assert state.pages[state.ck[at_8]]["cls"] == "turn"
    nxt = b + [8] * 9
    plan = only(await d.plan([new_request("b2", nxt, 32, 4)], {"b2": nxt}))
    assert plan.hit_tokens == (8 if kept else 0)
    await d.release(["a", "b2"])
    await check(d, config)
