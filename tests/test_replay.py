"""`cachetier replay` through the real index: the hand-made trace's known ratios, agreement with the
independent policy model, pools that stay sane under eviction, the CLI's output and its errors."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis

from cachetier.cli import main
from cachetier.config import load_config
from cachetier.engine.checkpoint_placement import BRANCH, LADDER, SEED, CheckpointPlacement
from cachetier.replay.adaptive import RECENCY, VALUE
from cachetier.replay.replayer import (PromptHashes, ReplayContext, ReplayError, budget_pages,
                                       parse_budget, unlimited)
from cachetier.replay.report import format_size
from cachetier.replay.runners import RUNNERS, replay_budget
from cachetier.replay.traces import (AgenticSpec, TraceRequest, read_trace, synth_agentic,
                                     synth_tokens, write_trace)
from index.hashing import chain_hashes
from index.meta import CORE_FIELD, decode_core
from index.records import StepRequest
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from tests import policy_model as pm
from tests.hand_trace import EXPECTED, HAND, TOTAL

BASELINES = ("oracle", "seed", "branch", "ladder", "coupled", "full-6144")
KIMI = load_config("kimi-k3")
CONTRACT = {"hit_ratio", "checkpoints_written", "checkpoints_alive", "checkpoint_bytes", "evictions"}
AGENTIC = synth_agentic(AgenticSpec(sessions=25, seed=3, max_context=40_000))


async def check_pools(redis: Redis, prefix: str, names: tuple[str, ...]) -> None:
    """Every pool of the replay passes the index's own sanity check, with no request left."""
    for name in names:
        state = await read_pool(redis, pool_keys(f"{prefix}.{name}"))
        core = decode_core(await redis.hget(pool_keys(f"{prefix}.{name}")[0], CORE_FIELD))
        sanity_check(state, int(core["num_pages"]), int(core["blocks_per_page"]))
        assert not state.req and not state.tix


async def test_hand_trace_gives_the_worked_out_hits(redis: Redis) -> None:
    result = await replay_budget(redis, HAND, KIMI, None, BASELINES, chunk_tokens=8192)
    for name in BASELINES:
        p = result.policies[name]
        assert (p.input_tokens, p.hit_tokens) == (TOTAL, EXPECTED[name]), name
        assert p.counters.evictions == 0
    assert result.policies["oracle"].counters.checkpoints_alive == 0
    # seed keeps every turn end: r1 @13, r2 @7, r3 @8, r4 @26, r5 @27 blocks, and the resend
    # points of the three block-aligned prompts: r2 @6, r4 @25, r5 @26
    seed = result.policies["seed"].counters
    assert seed.checkpoints_written == seed.checkpoints_alive == 5 + 3
    assert seed.checkpoint_bytes == 8 * 3 * KIMI.geometry.page_id_bytes
    await check_pools(redis, "replay", BASELINES)


@pytest.mark.parametrize("name", BASELINES)
async def test_real_index_agrees_with_the_policy_model(redis: Redis, name: str) -> None:
    # A chunk smaller than a page, so chunk ends, page ends and branch points all cut passes.
    chunk = 4096
    result = await replay_budget(redis, AGENTIC, KIMI, None, [name], chunk_tokens=chunk)
    policy = pm.BASELINES[name]()
    model = pm.Model(replace(policy, steps=replace(policy.steps, chunk_tokens=chunk)))
    expected = [model.serve(r) for r in sorted(AGENTIC, key=lambda r: r.timestamp)]
    got = result.policies[name]
    assert [s.hit_tokens for s in got.served] == expected
    assert got.counters.checkpoints_alive == len(model.ck)
    assert got.hit_tokens > 0


async def test_a_small_budget_evicts_and_the_pools_stay_sane(redis: Redis) -> None:
    budget = 60 * KIMI.geometry.page_id_bytes  # 60 page ids: 9.8 GB
    names = ("seed", "ladder", "coupled", "full-6144")
    limited = await replay_budget(redis, AGENTIC, KIMI, budget, names, 8192, pool_prefix="small")
    unlimited = await replay_budget(redis, AGENTIC, KIMI, None, names, 8192, pool_prefix="all")
    for name in names:
        p = limited.policies[name]
        assert p.counters.evictions > 0 and p.budget_pages == 60, name
        assert not any(s.refused for s in p.served)
        assert p.hit_tokens <= unlimited.policies[name].hit_tokens
    assert sum(p.hit_tokens for p in limited.policies.values()) < \
        sum(p.hit_tokens for p in unlimited.policies.values())
    await check_pools(redis, "small", names)


@pytest.mark.parametrize("trace", [HAND[::-1], AGENTIC[:40]], ids=["hand-reversed", "agentic"])
def test_prompt_hashes_equal_hashing_the_synthesised_prompt(trace: list[TraceRequest]) -> None:
    prompts = PromptHashes("kimi-k3", "xxh3_128")  # one per trace: ids mean nothing across traces
    for r in trace:  # reversed: a longer prompt first, then prompts sharing its prefix
        for block in (512, 6144):
            direct = chain_hashes(synth_tokens(r), prompts.root, block)
            assert prompts.hashes(r, block) == direct


@pytest.mark.parametrize("text, value", [
    ("400GB", 400 * 10**9), ("1.6TB", 1_600 * 10**9), ("100gb", 100 * 10**9),
    ("512GiB", 512 * 2**30), ("12345", 12345), ("unlimited", None), ("Unlimited", None),
])
def test_budget_sizes(text: str, value: int | None) -> None:
    assert parse_budget(text) == value


@pytest.mark.parametrize("text", ["100GB", "400GB", "1.6TB", "unlimited"])
def test_budget_labels_read_back(text: str) -> None:
    assert format_size(parse_budget(text)) == text


@pytest.mark.parametrize("text", ["", "GB", "12XB", "1.6.2TB", "-5GB", "0GB", "infGB", "nanGB"])
def test_bad_budgets_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bad budget"):
        parse_budget(text)


def test_budget_pages_counts_unified_page_ids() -> None:
    assert [budget_pages(parse_budget(b), KIMI) for b in ("100GB", "400GB", "1.6TB")] == \
        [614, 2457, 9828]
    with pytest.raises(ReplayError, match="buys no page"):
        budget_pages(10**6, KIMI)


def test_adaptive_without_its_module_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cachetier.replay.adaptive", None)
    ctx = ReplayContext(Redis(), KIMI, 8192, PromptHashes("kimi-k3", "xxh3_128"))
    with pytest.raises(ReplayError, match="adaptive.py is missing"):
        RUNNERS["adaptive"](ctx)


# -- the command ------------------------------------------------------------------------------------

def test_replay_json_has_the_contract_keys(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hand.jsonl"
    write_trace(path, HAND)
    assert main(["replay", str(path), "--json", "--policies", "oracle,seed"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == str(path) and out["requests"] == 5 and out["budget_bytes"] is None
    assert set(out["policies"]) == {"oracle", "seed"}
    for name, p in out["policies"].items():
        assert CONTRACT <= set(p)
        assert p["hit_ratio"] == round(EXPECTED[name] / TOTAL, 4)


def test_sweep_writes_json_and_a_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path, plot = tmp_path / "agentic.jsonl", tmp_path / "sweep.png"
    write_trace(path, AGENTIC[:60])
    assert main(["replay", str(path), "--json", "--policies", "oracle,seed,full-6144",
                 "--sweep", "unlimited,10GB", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["budget_bytes"] for s in out["sweep"]] == [10 * 10**9, None]  # ascending
    for step in out["sweep"]:
        assert set(step["policies"]) == {"oracle", "seed", "full-6144"}
        assert all(CONTRACT <= set(p) for p in step["policies"].values())
    # the oracle has no capacity: the same figures at every budget
    small, unlimited = (step["policies"]["oracle"] for step in out["sweep"])
    assert small["budget_pages"] is None and small["hit_tokens"] == unlimited["hit_tokens"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hand.jsonl"
    write_trace(path, HAND)
    assert main(["replay", str(path), "--policies", "ladder", "--budget", "400GB"]) == 0
    out = capsys.readouterr().out
    assert "budget 400GB" in out and "ladder" in out and f"{EXPECTED['ladder'] / TOTAL:.4f}" in out


@pytest.mark.parametrize("args, message", [
    (["--budget", "12XB"], "--budget: bad budget '12XB'"),
    (["--budget", "1MB"], "buys no page"),
    (["--sweep", "100GB,lots"], "--sweep: bad budget 'lots'"),
    (["--policies", "seed,lru"], "--policies: unknown replay runner 'lru'; expected one of oracle"),
    (["--policies", "seed,seed"], "--policies: replay runner 'seed' named twice"),
    (["--chunk", "0"], "--chunk: must be >= 1"),
])
def test_bad_arguments_exit_2_naming_the_flag(tmp_path, capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    path = tmp_path / "hand.jsonl"
    write_trace(path, HAND)
    assert main(["replay", str(path), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_line_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(HAND[0].to_json())
    path.write_text(f"{good}\n{good}\n{{\"timestamp\": 5, \"input_length\": 10}}\n")
    assert main(["replay", str(path), "--policies", "seed"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 3: missing field 'output_length'" in err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_trace_synth_writes_sessions_and_turns(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out" / "agentic.jsonl"
    assert main(["trace", "synth", str(path), "--sessions", "12", "--seed", "5",
                 "--max-context", "30000"]) == 0
    trace = read_trace(path)
    assert trace == synth_agentic(AgenticSpec(sessions=12, seed=5, max_context=30_000))
    assert all(r.session_id is not None and r.turn is not None for r in trace)
    assert f"wrote {len(trace)} requests" in capsys.readouterr().out
    assert main(["trace", "synth", str(path), "--sessions", "0"]) == 2


# -- an exact resend -------------------------------------------------------------------------------

def _resend_trace(length: int) -> list[TraceRequest]:
    """A prompt, the same prompt again (a retry, `n > 1` sampling, a regenerate), then its next
    turn: 700 tokens past its last hash-block boundary."""
    ids = tuple(range(1, -(-length // 512) + 1))
    turn_end = length // 512 * 512
    extension = TraceRequest(2, turn_end + 700, 1, ids[:turn_end // 512] + (900, 901))
    return [TraceRequest(0, length, 1, ids), TraceRequest(1, length, 1, ids), extension]


def _recency(ctx: ReplayContext):
    return ctx.pool("recency", ctx.config, RECENCY.policy, RECENCY.weights)


@pytest.mark.parametrize("length", [2048, 12288, 2100, 12300])
async def test_a_resent_prompt_hits_one_block_short_and_its_next_turn_at_its_end(redis, length):
    """A hit leaves a token to compute, so a resend can hit at (P - 1) // 512 * 512 at best:
    P - 512 for a block-aligned prompt (its resend point, kept one block before its turn end),
    P // 512 * 512 otherwise; the next turn still hits at the turn end. The recency mode keeps
    no turn end for a prompt of a page or more (its deepest rung serves it): only the shorter
    prompts are asked of it."""
    trace = _resend_trace(length)
    names = ("seed", "branch", "ladder", "coupled", "adaptive")
    result = await replay_budget(redis, trace, KIMI, None, names, chunk_tokens=8192)
    ctx = ReplayContext(redis, unlimited(KIMI), 8192, PromptHashes("kimi-k3", "xxh3_128"), "rec")
    recency = _recency(ctx)
    await recency.setup(redis)
    by_recency = [(await recency.serve(r)).hit_tokens for r in trace]
    turn_end = length // 512 * 512
    expected = [0, (length - 1) // 512 * 512, turn_end]
    for name in names[:3] + names[4:]:
        assert [s.hit_tokens for s in result.policies[name].served] == expected, name
    coupled = (length - 1) // 6144 * 6144, length // 6144 * 6144  # 6,144-token hash blocks
    assert [s.hit_tokens for s in result.policies["coupled"].served] == [0, *coupled]
    if length < KIMI.cache.page_tokens:
        assert by_recency == expected
    else:
        deepest_rung = (length - 1) // 6144 * 6144
        assert by_recency == [0, deepest_rung, deepest_rung]
    await check_pools(redis, "replay", names)


class _NoResendCut(CheckpointPlacement):
    """The placement as it was before resend points: no pass stops one block before the end."""

    def first_step(self, *args: Any) -> StepRequest:
        return replace(super().first_step(*args), stop_at_resend_point=False)

    def next_step(self, *args: Any) -> StepRequest:
        return replace(super().next_step(*args), stop_at_resend_point=False)


def _aligned_half(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Every other request cut down to its last hash-block boundary."""
    out = []
    for n, r in enumerate(trace):
        blocks = r.input_length // 512
        if n % 2 and blocks > 1:
            r = replace(r, input_length=blocks * 512, hash_ids=r.hash_ids[:blocks])
        out.append(r)
    return out


@pytest.mark.parametrize("placement", [SEED, BRANCH, LADDER, VALUE.policy, RECENCY.policy],
                         ids=lambda p: p.name)
async def test_resend_points_cost_at_most_one_checkpoint_per_aligned_prompt(redis, placement):
    trace = _aligned_half(AGENTIC)
    aligned = sum(r.input_length % 512 == 0 for r in trace)
    ctx = ReplayContext(redis, unlimited(KIMI), 4096, PromptHashes("kimi-k3", "xxh3_128"), "cnt")
    cut = ctx.pool("cut", ctx.config, placement)
    before = ctx.pool("before", ctx.config, _NoResendCut(**vars(placement)))
    served = {}
    for runner in (cut, before):
        await runner.setup(redis)
        served[runner] = [await runner.serve(r) for r in sorted(trace, key=lambda r: r.timestamp)]
    with_cut, without = await cut.counters(), await before.counters()
    assert aligned > 20
    assert 0 < with_cut.checkpoints_alive - without.checkpoints_alive <= aligned
    assert with_cut.checkpoints_written - without.checkpoints_written <= aligned
    assert sum(s.hit_tokens for s in served[cut]) > sum(s.hit_tokens for s in served[before])
