"""`probe` (read-only, for routing) and `pin_prefix` (a hit pinned for another pool to copy)
against a real redis-server: they find what `plan_step` would hit, and change only what they say."""

from __future__ import annotations

import pytest

from index.errors import BadRequest, StaleEpoch
from index.hashing import chain_hashes
from index.snapshot import read_pool, sanity_check
from tests.index_harness import ROOT, commit_item, make, new_request, only, serve, small_config
from tests.redis_harness import dump

CONFIG = small_config()
BLOCK, PAGE = CONFIG.cache.hash_block_tokens, CONFIG.cache.page_tokens
DOC = [3 + (5 * i) % 101 for i in range(64)]


def hashes(tokens: list[int]) -> bytes:
    return chain_hashes(tokens, ROOT, BLOCK)


async def cached(redis):
    """DOC[:22] served with a durable checkpoint at 20, then DOC[:30] registered without one:
    MLA matches 28 tokens, a usable hit stops at 20."""
    d = await make(redis, CONFIG)
    await serve(d, "turn1", DOC[:22], chunk=22)
    step = await d.plan([new_request("mla", DOC[:30], 30, BLOCK, checkpoint=False)],
                        {"mla": DOC[:30]})
    await d.confirm(step.ticket)
    await d.confirm((await d.commit([commit_item(only(step), 30, with_checkpoint=False)])).ticket)
    await d.release(["mla"])
    return d


async def check(d) -> None:
    sanity_check(await read_pool(d.index.redis, d.index.keys), CONFIG.cache.num_pages,
                 CONFIG.cache.blocks_per_page)


@pytest.mark.parametrize("prompt, mla, hit", [
    (DOC[:40], 28, 20), (DOC[:21], 20, 20), (DOC[:20], 16, 0), (DOC[:3], 0, 0),
    ([9] + DOC[1:40], 0, 0),
], ids=["deeper-mla", "at-checkpoint", "no-checkpoint-below", "no-block", "other-prefix"])
async def test_probe_reports_what_a_plan_would_hit_and_writes_nothing(redis, prompt, mla, hit,
                                                                      redis_operator):
    d = await cached(redis)
    before = await dump(redis_operator)
    probe = await d.index.probe(len(prompt), hashes(prompt))
    assert (probe.mla_tokens, probe.hit_tokens) == (mla, hit)
    assert probe.pool == "p" and probe.epoch == d.index.epoch
    assert await dump(redis_operator) == before
    plan = only(await d.plan([new_request("check", prompt, len(prompt), BLOCK)], {"check": prompt}))
    assert plan.hit_tokens == hit


async def test_pin_prefix_pins_the_hit_until_released(redis):
    d = await cached(redis)
    pinned = await d.index.pin_prefix("reader", 40, hashes(DOC[:40]))
    assert pinned.hit_tokens == 20 and len(pinned.checkpoint_pages) == CONFIG.model.kda_groups
    assert len(pinned.mla_pages) == 1 and len(pinned.mla_pages[0]) == 2   # 16 + 4 tokens
    assert pinned.last_slot_tokens(PAGE) == 4
    plan = only(await d.plan([new_request("same", DOC[:40], 40, BLOCK)], {"same": DOC[:40]}))
    assert plan.mla_pages[0][0] == pinned.mla_pages[0][0]                  # the same page table
    assert plan.copies[0].src == pinned.checkpoint_pages[0]               # the same checkpoint
    await d.release(["same"])
    await check(d)                                                         # refcounts = holders
    await d.index.evict(100)
    assert (await d.index.probe(40, hashes(DOC[:40]))).hit_tokens == 20   # pinned: not evicted
    assert (await d.index.release(["reader"])).released == 1
    await check(d)
    await d.index.evict(100)
    assert (await d.index.probe(40, hashes(DOC[:40]))).hit_tokens == 0


async def test_pin_prefix_without_a_hit_pins_nothing_and_bad_calls_change_nothing(redis,
                                                                                  redis_operator):
    d = await cached(redis)
    before = await dump(redis_operator)
    empty = await d.index.pin_prefix("reader", 3, hashes(DOC[:3]))
    assert empty.hit_tokens == 0 and empty.mla_pages == [] and empty.checkpoint_pages == []
    assert await dump(redis_operator) == before
    await d.index.pin_prefix("reader", 40, hashes(DOC[:40]))
    pinned = await dump(redis_operator)
    with pytest.raises(BadRequest, match="already exists"):
        await d.index.pin_prefix("reader", 40, hashes(DOC[:40]))
    with pytest.raises(BadRequest, match="one 16-byte hash"):
        await d.index.pin_prefix("other", 40, hashes(DOC[:36]))
    assert await dump(redis_operator) == pinned
    await d.index.invalidate()
    d.index.epoch -= 1
    with pytest.raises(StaleEpoch):
        await d.index.pin_prefix("other", 40, hashes(DOC[:40]))
