"""One test per invariant of DESIGN.md, each written so that breaking the invariant fails it.

All against a real redis-server; the byte model in `Driver` checks that what a hit reads holds the
declared prefix, so a hit served from evicted, reallocated or unconfirmed pages is caught. Every
test runs for both model families (their pools differ in the sizes the copies move).
"""

from __future__ import annotations

import pytest

from eviction.policy import EvictionWeights
from index.errors import StaleEpoch, UnknownEntity
from index.hashing import chain_hashes, split_hashes
from index.records import StepPlan, StepRefusal
from index.snapshot import read_pool, sanity_check
from index.store import PrefixIndex
from tests.index_harness import (FAMILIES, ROOT, Driver, commit_item, make, new_request, only,
                                 serve, small_config)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def doc(n: int, length: int = 64) -> list[int]:
    return [n * 1000 + i for i in range(length)]


async def state_of(d: Driver):
    return await read_pool(d.index.redis, d.index.keys)


async def test_pin_before_allocate_never_evicts_what_the_step_hit(redis, family):
    """The hit (oldest, first in eviction order) survives the evictions its own allocation needs."""
    config = small_config(num_pages=16, family=family)
    d = await make(redis, config)
    await serve(d, "old", doc(1, 20), chunk=20)             # 2 MLA pages + checkpoint at 20
    await serve(d, "newer", doc(2, 20), chunk=20)           # more recent: evicted after "old"
    before = await state_of(d)
    hit_ck = before.ck[chain_hashes(doc(1, 20), ROOT, 4)[-16:]]
    longer = doc(1, 60)
    plan = await d.plan([new_request("again", longer, 40, 4)], {"again": longer})
    assert isinstance(plan, StepPlan) and plan.evicted > 0
    r = only(plan)
    assert r.hit_tokens == 20
    restore_sources = {c.src for c in r.copies if c.dst in r.state_pages}
    assert restore_sources == set(before.pages[hit_ck]["pages"])
    allocated = set(r.state_pages) | set(r.checkpoint_pages) | {p for g in r.mla_pages for p in g[1:]}
    assert not restore_sources & allocated, "a page the step hit was evicted and handed out again"
    removed = {x.block_hash for x in plan.removed}
    assert set(split_hashes(chain_hashes(doc(2, 20), ROOT, 4))) & removed, "newer entries paid for it"
    await d.confirm(plan.ticket)
    sanity_check(await state_of(d), config.cache.num_pages, config.cache.blocks_per_page)


@pytest.mark.parametrize("kda_groups", [3, 0], ids=["hybrid", "full-attention"])
async def test_pending_pages_are_not_matched_until_confirmed(redis, family, kda_groups):
    config = small_config(kda_groups=kda_groups, family=family)
    d = await make(redis, config)
    prompt = doc(3, 30)
    plan = only(await d.plan([new_request("w", prompt, 30, 4)], {"w": prompt}))
    probe = prompt + [7]
    allocated = only(await d.plan([new_request("p0", probe, 1, 4)], {"p0": probe}))
    assert allocated.hit_tokens == 0, "pages allocated in this step matched before any write"
    commit = await d.commit([commit_item(plan, 30, True, True, 4)])
    pending = only(await d.plan([new_request("p1", probe, 1, 4)], {"p1": probe}))
    assert pending.hit_tokens == 0, "registered pages matched before their writes were confirmed"
    await d.confirm(commit.ticket)
    ready = only(await d.plan([new_request("p2", probe, 1, 4)], {"p2": probe}))
    assert ready.hit_tokens == 28


async def test_checkpoint_is_reachable_in_all_groups_or_none(redis, family):
    config = small_config(kda_groups=3, family=family)
    d = await make(redis, config)
    await serve(d, "a", doc(4, 24), chunk=24)
    state = await state_of(d)
    (h, lead), = state.ck.items()
    siblings = state.pages[lead]["pages"]
    assert len(set(siblings)) == 3 and state.pages[lead]["k"] == "K"
    # Durable checkpoints outlive MLA pages under LRU; evict until the checkpoint goes.
    while h in (await state_of(d)).ck:
        assert (await d.evict(1)).evicted == 1
    after = await state_of(d)
    assert not set(siblings) & set(after.pages), "a sibling page outlived its checkpoint"
    assert set(siblings) <= set(after.free)
    probe = doc(4, 25)
    assert only(await d.plan([new_request("b", probe, 1, 4)], {"b": probe})).hit_tokens == 0


async def test_evicting_an_mla_page_frees_the_checkpoints_it_anchors(redis, family):
    """With weights that evict MLA pages first, the checkpoint loses its prefix and must go too."""
    config = small_config(kda_groups=2, family=family)
    weights = EvictionWeights.tiers(recency=1.0, mla=0.0, intermediate=2.0**41, durable=2.0**42)
    index = PrefixIndex(redis, "w", config, weights)
    await index.create()
    d = Driver(index, config)
    await serve(d, "a", doc(5, 12), chunk=12)               # one page, checkpoint at 12 inside it
    state = await state_of(d)
    (h, lead), = state.ck.items()
    result = await d.evict(1)
    assert result.evicted == 1
    assert {r.kind for r in result.removed} == {"ep", "ck"}
    after = await state_of(d)
    assert after.ck == {} and after.ep == {}
    assert not set(state.pages[lead]["pages"]) & set(after.pages)
    sanity_check(after, config.cache.num_pages, config.cache.blocks_per_page)


async def test_epoch_invalidation_voids_matches_and_pins(redis, family):
    config = small_config(family=family)
    d = await make(redis, config)
    await serve(d, "a", doc(6, 30), chunk=30)
    in_flight = only(await d.plan([new_request("b", doc(7, 30), 10, 4)], {"b": doc(7, 30)}))
    other_client = PrefixIndex(redis, "p", config)
    await other_client.create()
    new_epoch = await other_client.invalidate()
    assert new_epoch == d.index.epoch + 1
    with pytest.raises(StaleEpoch):
        await d.index.commit([commit_item(in_flight, 10)])
    with pytest.raises(UnknownEntity):                     # the pins died with the epoch
        await d.index.commit([commit_item(in_flight, 10)])
    state = await state_of(d)
    assert state.pages == {} and state.ep == {} and state.ck == {} and state.fresh == 0
    probe = doc(6, 31)
    plan = only(await d.index.plan_step([new_request("c", probe, 1, 4)]))
    assert plan.hit_tokens == 0 and plan.state_pages == [0, 1, 2]
    assert await other_client.invalidate(seen_epoch=new_epoch - 1) == new_epoch  # no double bump


async def test_refused_step_changes_nothing_and_says_why(redis, family):
    config = small_config(num_pages=12, family=family)
    d = await make(redis, config)
    await serve(d, "a", doc(8, 20), chunk=20)
    before = await state_of(d)
    big = doc(9, 64)
    refusal = await d.index.plan_step([new_request("x", big, 64, 4), new_request("y", doc(10, 64), 64, 4)])
    assert isinstance(refusal, StepRefusal)
    assert refusal.pages_needed > refusal.pages_available
    assert "needs" in refusal.reason
    assert await state_of(d) == before


async def test_pending_checkpoint_on_a_ready_prefix_is_not_matched(redis, family):
    """The prefix is cached and ready (written without checkpoints); a second request persists a
    checkpoint there: until that write is confirmed, nothing may restore from it."""
    config = small_config(family=family)
    d = await make(redis, config)
    prompt = doc(11, 30)
    first = only(await d.plan([new_request("a", prompt, 30, 4, checkpoint=False)], {"a": prompt}))
    await d.confirm((await d.commit([commit_item(first, 30, True, False, 4)])).ticket)
    second = only(await d.plan([new_request("b", prompt, 30, 4)], {"b": prompt}))
    assert second.hit_tokens == 0
    commit = await d.commit([commit_item(second, 30, True, True, 4)])
    assert commit.requests[0].checkpoint == "registered" and commit.requests[0].endpoints == 0
    probe = prompt + [1]
    assert only(await d.plan([new_request("c", probe, 1, 4)], {"c": probe})).hit_tokens == 0
    await d.confirm(commit.ticket)
    assert only(await d.plan([new_request("e", probe, 1, 4)], {"e": probe})).hit_tokens == 28
