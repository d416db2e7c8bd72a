"""The replay package: trace parsing, synthetic traces, token synthesis, and the policy model's
hit ratios on the hand-made trace of `tests.hand_trace`, whose every hit is worked out there."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest

from cachetier.replay.traces import (AgenticSpec, TraceError, TraceRequest, block_tokens_for,
                                     parse_lines, read_trace, synth_agentic, synth_tokens,
                                     write_trace)
from tests import policy_model as pm
from tests.hand_trace import B, EXPECTED, HAND, R1, TOTAL, req


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hand_trace_hit_ratios_at_unlimited_capacity(name: str) -> None:
    stats = pm.simulate(HAND, pm.BASELINES[name](), check=True)
    assert stats.input_tokens == TOTAL
    assert stats.hit_tokens == EXPECTED[name]
    assert stats.hit_ratio == pytest.approx(EXPECTED[name] / TOTAL)


def test_adaptive_matches_ladder_when_nothing_is_evicted() -> None:
    # Same passes as ladder (r4's only rung @24 is its deepest, so it is a `rung`, not `spec`).
    assert pm.simulate(HAND, pm.adaptive(), check=True).hit_tokens == EXPECTED["ladder"]
    stats = pm.simulate(HAND, pm.adaptive(), capacity=10_000, check=True)
    assert stats.hit_tokens == EXPECTED["ladder"] and stats.evicted_pages == 0


def test_chunking_changes_nothing_at_unlimited_capacity() -> None:
    chunked = replace(pm.seed(), steps=pm.Steps(chunk_tokens=1000))
    stats = pm.simulate(HAND, chunked, check=True)
    assert stats.hit_tokens == EXPECTED["seed"]
    assert stats.checkpoints["intermediate"] > 0  # written, then recycled


def test_coupled_with_every_page_end_equals_full_6144() -> None:
    every = replace(pm.coupled(), steps=pm.Steps(stop_at_page_end=True))
    assert pm.simulate(HAND, every).hit_tokens == EXPECTED["full-6144"]


# r1 leaves page 1 (full), page 2 (block 13) and its turn-end checkpoint anchored on page 2:
# 5 page ids. An unrelated 3-block request needs 1 page + 3 (state) + 3 (checkpoint) = 7.
R_OTHER = req(1, [500, 501, 502, 503], 3 * B + 10)  # not block-aligned: no resend point
R1_AGAIN = req(2, [*range(1, 14), 101], 13 * B + 50)  # r1's 13 blocks, another tail


@pytest.mark.parametrize("capacity, evicted, hit", [(12, 0, 13 * B), (10, 4, 0)])
def test_evicting_the_anchor_page_drops_its_checkpoint(capacity: int, evicted: int, hit: int) -> None:
    # With 10 ids, 2 must go: the LRU head is r1's leaf page 2 (durable tier: it anchors the turn
    # end, and was never hit so last_used = 0), and its checkpoint goes with it (4 ids freed).
    model = pm.Model(pm.seed(), capacity)
    for r in (R1, R_OTHER):
        model.serve(r)
        model.check()
    assert model.stats.evicted_pages == evicted
    assert model.serve(R1_AGAIN) == hit
    model.check()


def test_policies_keep_the_index_invariants_under_pressure() -> None:
    trace = synth_agentic(AgenticSpec(sessions=25, seed=3, max_context=40_000))
    for policy in [*(f() for f in pm.BASELINES.values()), pm.adaptive()]:
        limited = pm.simulate(trace, policy, capacity=60, check=True)
        unlimited = pm.simulate(trace, policy)
        assert limited.hit_tokens <= unlimited.hit_tokens and limited.refused == 0


def test_budget_pages_for_kimi_k3() -> None:
    assert pm.budget_pages(100 * pm.GB) == 614
    assert pm.budget_pages(400 * pm.GB) == 2457
    assert pm.budget_pages(1600 * pm.GB) == 9828


# -- traces ---------------------------------------------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({**GOOD, "hash_ids": [7]}), "expected ceil(1000 / 512) = 2"),
    (json.dumps({**GOOD, "input_length": 0}), "input_length must be an integer >= 1"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "missing field 'timestamp'"),
    (json.dumps({**GOOD, "hash_ids": [7, -1]}), "hash_ids[1] must be an integer >= 0"),
    (json.dumps({**GOOD, "hash_ids": "78"}), "non-list field 'hash_ids'"),
    (json.dumps({**GOOD, "turn": True}), "turn must be an integer"),
])
def test_bad_lines_name_their_line_number(line: str, message: str) -> None:
    with pytest.raises(TraceError) as err:
        list(parse_lines([json.dumps(GOOD), "", line]))
    assert err.value.line == 3 and message in str(err.value) and str(err.value).startswith("line 3:")


def test_ids_that_are_not_prefix_chained_are_refused() -> None:
    lines = [json.dumps(GOOD), json.dumps({**GOOD, "hash_ids": [9, 7]})]  # 7 after 9, at block 1
    with pytest.raises(TraceError, match="line 2: .*not prefix-chained"):
        list(parse_lines(lines))
    assert len(list(parse_lines(lines, check_chaining=False))) == 2


def test_write_then_read_round_trips(tmp_path) -> None:
    trace = synth_agentic(AgenticSpec(sessions=5, seed=1))
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    assert all(r.session_id is not None and r.turn is not None for r in trace)


def test_synth_is_deterministic_by_seed_and_prefix_chained() -> None:
    spec = AgenticSpec(sessions=30, seed=7)
    a, b = synth_agentic(spec), synth_agentic(spec)
    assert a == b and a != synth_agentic(replace(spec, seed=8))
    buf = io.StringIO()
    write_trace(buf, a)
    assert list(parse_lines(buf.getvalue().splitlines())) == a  # the chaining check passes
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    # within a session a turn's prompt extends the previous one: its complete blocks come back
    last: dict[int, TraceRequest] = {}
    for r in a:
        prev = last.get(r.session_id)  # type: ignore[arg-type]
        if prev is not None:
            full = prev.complete_blocks()
            assert r.hash_ids[:full] == prev.hash_ids[:full] and r.input_length > prev.input_length
        last[r.session_id] = r  # type: ignore[index]
    # sessions share system prompts: some first block is common to several sessions
    firsts = [r.hash_ids[0] for r in a if r.turn == 0]
    assert len(set(firsts)) < len(firsts)
    lengths = [r.input_length for r in a]
    assert min(lengths) < 10_000 and max(lengths) > 50_000


def test_token_synthesis_follows_the_ids() -> None:
    r1, r2 = req(0, [1, 2, 3], 2 * B + 100), req(1, [1, 2, 4], 3 * B)
    t1, t2 = synth_tokens(r1), synth_tokens(r2)
    assert t1.dtype == np.uint32 and t1.shape == (2 * B + 100,)
    assert np.array_equal(t1[:2 * B], t2[:2 * B]) and not np.array_equal(t1[2 * B:], t2[2 * B:2 * B + 100])
    assert np.array_equal(t1[2 * B:], block_tokens_for([3])[0, :100])  # partial = prefix of the block
    assert np.array_equal(block_tokens_for([5, 6]), block_tokens_for([5, 6]))
