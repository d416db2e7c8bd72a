"""The LRU policy's order on a real pool: intermediate checkpoints go first, then MLA pages, and
durable (turn-boundary) checkpoints with the pages anchoring them outlive both, even when older."""

from __future__ import annotations

import pytest

from eviction.policy import EvictionWeights, lru, policy_weights
from index.snapshot import read_pool
from tests.index_harness import commit_item, new_request, only, small_config
from tests.test_index_flows import make, serve


async def test_lru_tiers_intermediate_then_mla_then_durable(redis):
    config = small_config(num_pages=64)
    d = await make(redis, config)
    await serve(d, "durable", [1000 + i for i in range(20)], chunk=20)    # oldest, turn end
    tokens = [2000 + i for i in range(40)]
    step = await d.plan([new_request("mid", tokens, 20, 4)], {"mid": tokens})
    await d.confirm(step.ticket)
    plan = only(step)
    await d.confirm((await d.commit([commit_item(plan, 20, False, True, 4)])).ticket)
    await d.release(["mid"])                                              # newest, intermediate
    state = await read_pool(d.index.redis, d.index.keys)
    kinds = {lead: state.pages[lead] for lead in state.lru}
    order = sorted(kinds, key=lambda lead: (state.lru[lead], str(lead)))
    classes = [("durable" if rec["dur"] else "intermediate") if rec["k"] == "K"
               else ("durable" if rec["dur"] else "mla") for rec in (kinds[o] for o in order)]
    assert classes == sorted(classes, key=["intermediate", "mla", "durable"].index)
    assert classes[0] == "intermediate" and classes[-1] == "durable"
    first = await d.evict(1)
    assert [r.kind for r in first.removed] == ["ck"]
    survivors = await read_pool(d.index.redis, d.index.keys)
    assert len(survivors.ck) == 1 and next(iter(survivors.ck.values())) in survivors.pages


def test_score_formula_weights_each_term():
    w = EvictionWeights(recency=2.0, mla=10.0, intermediate=1.0, durable=100.0, depth=0.5)
    assert w.score("mla", last_used=3, prefix_tokens=8, pages=2) == 2.0 * 3 + 10.0 + 0.5 * 8 / 2
    assert lru().score("intermediate", 10**9, 0, 1) < lru().score("mla", 0, 0, 1)
    assert lru().score("mla", 10**9, 0, 1) < lru().score("durable", 0, 0, 3)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        policy_weights("fifo")
