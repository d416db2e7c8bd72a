"""The output comparison (`cachetier.vllm.oracle`) and the bench's workload, on hand-made cases."""

from __future__ import annotations

import dataclasses
from typing import Any

from cachetier.vllm.oracle import compare
from cachetier.vllm.workload import Request, WorkloadSpec, build, oracle_hit_tokens


def _result(steps: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """A result whose greedy token at each position is the first of that position's top list."""
    return {"token_ids": [top[0][0] for top in steps], "logprobs": [top[0][1] for top in steps],
            "top": [[list(pair) for pair in top] for top in steps]}


def test_equal_outputs_within_rounding_are_equal() -> None:
    cold = _result([[(1, -1.0), (2, -1.5)], [(3, -2.0), (4, -2.2)]])
    served = _result([[(1, -1.02), (2, -1.49)], [(3, -2.05), (4, -2.2)]])
    verdict = compare(served, cold)
    assert verdict.outcome == "equal" and verdict.position == 2


def test_a_first_token_off_by_more_than_the_tolerance_is_a_mismatch() -> None:
    cold = _result([[(1, -1.0), (2, -1.5)]])
    assert compare(_result([[(1, -1.2), (2, -1.5)]]), cold).outcome == "mismatch"
    # a runner-up off by as much fails too: the whole shared distribution is compared
    assert compare(_result([[(1, -1.0), (2, -1.7)]]), cold).outcome == "mismatch"


def test_later_tokens_are_allowed_the_drift_of_decoding() -> None:
    cold = _result([[(1, -1.0)], [(2, -1.0)], [(3, -1.0)]])
    served = _result([[(1, -1.0)], [(2, -1.0)], [(3, -1.13)]])  # 0.13 at position 2: within
    assert compare(served, cold).ok
    assert not compare(served, cold, drift=0.0).ok


def test_a_parting_on_a_tie_stops_the_comparison_and_a_clear_choice_does_not() -> None:
    cold = _result([[(1, -1.0), (2, -1.03)], [(5, -1.0)]])
    tie = _result([[(2, -1.01), (1, -1.02)], [(9, -0.1)]])  # the served engine took the runner-up
    assert compare(tie, cold).outcome == "tie"
    clear = _result([[(2, -1.0), (1, -1.3)]])
    cold_clear = _result([[(1, -1.0), (2, -1.3)]])
    assert compare(clear, cold_clear).outcome == "mismatch"


def test_no_top_token_in_common_is_a_mismatch() -> None:
    assert compare(_result([[(7, -1.0)]]), _result([[(1, -1.0)]])).outcome == "mismatch"


def test_successive_turns_of_a_session_land_on_different_engines_and_forks_start_later() -> None:
    rounds = build(WorkloadSpec(engines=2, sessions=3, forks=1, turns=3))
    by_id = {r.rid: r for batch in rounds for r in batch}
    for session in range(3):
        engines = [by_id[f"s{session}-t{turn}"].engine for turn in range(3)]
        assert engines[0] != engines[1] != engines[2]
    assert "s3-t0" not in by_id and "s3-t1" in by_id  # the fork's first request is in round 1
    parent, fork = by_id["s0-t0"].prompt, by_id["s3-t1"].prompt
    assert fork[:len(parent)] == parent


def test_the_ideal_hit_is_the_deepest_block_of_a_prefix_shared_with_an_earlier_request() -> None:
    a, b = list(range(300)), list(range(250)) + [999] * 100
    rounds = [[Request("a", a, 0, 0)], [Request("b", b, 1, 1), Request("c", a[:256], 1, 0)]]
    assert oracle_hit_tokens(rounds, 128) == {"a": 0, "b": 128, "c": 128}  # c leaves a token


def test_tool_outputs_lengthen_every_later_turn_within_their_bounds() -> None:
    agent = build(WorkloadSpec(sessions=2, forks=0, turns=3, tool_tokens=(400, 600)))
    tools = {r.rid: len(r.prompt) for batch in agent for r in batch}
    for session in range(2):
        growth = [tools[f"s{session}-t{t}"] - tools[f"s{session}-t{t - 1}"] for t in (1, 2)]
        low, high = 64 + 150 + 400, 64 + 500 + 600  # answer + user message + tool output
        assert all(low <= g <= high for g in growth), growth


def test_resends_repeat_every_session_s_last_turn_on_the_engine_that_served_it() -> None:
    spec = WorkloadSpec(engines=2, sessions=3, forks=1, turns=3)
    plain, resent = build(spec), build(dataclasses.replace(spec, resends=True))
    assert resent[:-1] == plain
    assert [(r.rid, r.prompt, r.engine) for r in resent[-1]] == [
        (f"{r.rid}-resend", r.prompt, r.engine) for r in plain[-1]]
    assert {r.round for r in resent[-1]} == {3} and len(resent[-1]) == 4  # forks included
