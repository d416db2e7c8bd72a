"""The LRU policy's order on a real pool: intermediate checkpoints go first, then MLA pages, and
durable (turn-boundary) checkpoints with the pages anchoring them outlive both, even when older;
and the one score formula, term by term."""

from __future__ import annotations

import pytest

from eviction.policy import (CLASSES, TIER, Entry, EvictionWeights, PerClass, lru, eviction_weights,
                             recency, value)
from index.snapshot import read_pool
from tests.index_harness import commit_item, make, new_request, only, serve, small_config


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
    classes = [("durable" if rec["cls"] != "intermediate" else "intermediate") if rec["k"] == "K"
               else ("durable" if any(rec["cn"][1:]) else "mla") for rec in (kinds[o] for o in order)]
    assert classes == sorted(classes, key=["intermediate", "mla", "durable"].index)
    assert classes[0] == "intermediate" and classes[-1] == "durable"
    first = await d.evict(1)
    assert [r.kind for r in first.removed] == ["ck"]
    survivors = await read_pool(d.index.redis, d.index.keys)
    assert len(survivors.ck) == 1 and next(iter(survivors.ck.values())) in survivors.pages


def one_hot(cls: str, value: int) -> tuple[int, ...]:
    return tuple(value if c == cls else 0 for c in CLASSES)


def test_score_formula_weights_each_term():
    w = EvictionWeights(recency=2.0, clock=3.0, mla=10.0, depth=0.5,
                        bonus=PerClass(intermediate=1.0, turn=100.0, spec=50.0),
                        value=PerClass(turn=1.0, branch=2.0, spec=0.25))
    page = Entry(True, last_used=3, clock_stamp=7.0, prefix_tokens=8, pages=2,
                 counts=(0,) * len(CLASSES), gains=(0,) * len(CLASSES))
    assert w.score(page, kda_groups=3) == 2.0 * 3 + 3.0 * 7.0 + 10.0 + 0.5 * 8 / 2
    # a page anchoring a turn end (gain 40) and a branch point (gain 12): the highest bonus,
    # and their value over every page its eviction frees (its 2 + 3 per checkpoint)
    anchoring = Entry(True, 3, 7.0, 8, 2, counts=(0, 1, 1, 0, 0, 0), gains=(0, 40, 12, 0, 0, 0))
    assert w.terms(anchoring, kda_groups=3) == (100.0, (1.0 * 40 + 2.0 * 12) / (2 + 2 * 3))
    spec = Entry(False, 5, 0.0, 12, 3, counts=one_hot("spec", 1), gains=one_hot("spec", 24))
    assert w.score(spec, kda_groups=3) == 2.0 * 5 + 50.0 + 0.5 * 12 / 3 + 0.25 * 24 / 3


@pytest.mark.parametrize("weights", [lru(), recency(), value()], ids=["lru", "recency", "value"])
def test_policies_as_pool_fields_name_every_weight(weights):
    fields = weights.as_pool_fields()
    assert len(fields) == 4 + 2 * len(CLASSES)
    assert all(isinstance(v, float) for v in fields.values())


def test_lru_keeps_three_tiers_and_recency_demotes_speculation():
    def ck(w: EvictionWeights, cls: str, lu: int) -> float:
        return w.score(Entry(False, lu, 0.0, 0, 3, one_hot(cls, 1), one_hot(cls, 0)), 3)

    def page(w: EvictionWeights, lu: int, cls: str | None = None) -> float:
        counts = one_hot(cls, 1) if cls else (0,) * len(CLASSES)
        return w.score(Entry(True, lu, 0.0, 0, 1, counts, (0,) * len(CLASSES)), 3)

    assert ck(lru(), "intermediate", 10**9) < page(lru(), 0) < ck(lru(), "turn", 0)
    assert page(lru(), 0, "rung") == 2 * TIER == ck(lru(), "superseded", 0) == ck(lru(), "spec", 0)
    assert page(lru(), 0, "intermediate") == TIER
    assert ck(recency(), "spec", 10**9) < page(recency(), 0) < ck(recency(), "branch", 0)
    assert ck(recency(), "superseded", 0) == ck(recency(), "intermediate", 0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_weights("fifo")
