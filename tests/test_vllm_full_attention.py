"""cachetier as vLLM's KV connector for full-attention models, end to end: real engines, a real
cluster, for both attention kinds the pool stores.

A tiny Qwen3 (GQA) and a tiny DeepSeek-V3 (MLA, a 576-wide latent), random weights written by
the test, have no linear-attention state: every prefix of their KV is a place to resume, so the
connector saves each hash-unit boundary a prefill crosses and a hit lands on any of them.
Engine A serves sessions with a forked system prompt in chunks smaller than a page; engine B,
started after A exits, serves their later turns and exact resends; every output must be the
reference engine's (the connector's engine arguments without the connector) by
`cachetier.vllm.oracle`, and B's hits must be exactly the boundaries A saved. Then damaged pages
must be caught by that comparison, and an engine unlike the pool refused.

vLLM runs MLA with prefix caching only on its AMX kernels (on other CPUs it turns prefix caching
off, and those kernels cannot resume from a cached prefix): the MLA case needs a CPU with AMX
tiles, and its engine forced onto the other kernels must not start. Those kernels also
round a prefill by where it is cut, far beyond the oracle's tolerance: the tiny MLA model's
first token after 1,800 tokens prefilled in chunks of 96, 100 or 128 against at once, 0.12-0.2
nats apart; and two sessions sent together are cut as their arrival decides (two runs of one
engine without a connector, same pair: first tokens 0.23 nats apart; GQA stays within the
tolerance). The connector's "ask again" moves requests between steps too, so the MLA engines
serve one request per step, each prefilled uncut: then each computes what the reference
computes, and only the GQA case checks chunks smaller than a page and batches.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cachetier.vllm.engine_run import EngineFailed
from cachetier.vllm.geometry import FINE_HASH_UNIT, engine_args_for
from cachetier.vllm.kv_copy import pool_attention_views
from cachetier.vllm.oracle import compare
from cachetier.vllm.tiny import write_tiny_full_attention
from gpu_pool import PagedPool
from tests.vllm_harness import (assert_reference_outputs, check_no_pins, pinned_hit, request,
                                run_engine, tokens, vllm_cluster)

UNIT = FINE_HASH_UNIT  # the hash unit, and here vLLM's block and the pool's page as well
SYSTEM = tokens(1, 700)  # ends part-way through a page
S1_T1 = SYSTEM + tokens(2, 1100)
S1_T2 = S1_T1 + tokens(3, 500)
S2_T1 = SYSTEM + tokens(5, 900)  # a fork of the system prompt, mid-page
S2_T2 = S2_T1 + tokens(6, 300)
DAMAGED = tokens(10, 8 * UNIT + 1)
MISS = tokens(11, 600)
A_STEPS = [[request("s1t1", S1_T1), request("s2t1", S2_T1)], [request("s1t2", S1_T2)],
           [request("damaged", DAMAGED)]]
A_CHUNK = {"gqa": 100, "mla": None}  # GQA: every chunk smaller than a page, cut mid-page
B_STEPS = [[request("s1t2-resend", S1_T2), request("miss", MISS)], [request("s2t2", S2_T2)]]


def steps_for(attention: str, steps: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """`steps` as the family's engines take them: MLA one request per step (see above)."""
    return steps if attention == "gqa" else [[r] for step in steps for r in step]

AMX = torch.cpu._is_amx_tile_supported()
FAMILIES = ["gqa", pytest.param("mla", marks=pytest.mark.skipif(
    not AMX, reason="vLLM serves MLA with prefix caching only on its AMX CPU kernels"))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One model, its cluster and the engines' results (A, B and the reference)."""
    attention = request.param
    model = write_tiny_full_attention(tmp_path_factory.mktemp(f"tiny-{attention}"), attention)
    workdir = tmp_path_factory.mktemp(f"engines-{attention}")
    with vllm_cluster(model, tmp_path_factory.mktemp(f"cluster-{attention}"),
                      pool_pages=256) as cluster:
        info = cluster.run_dir / "info.json"
        chunk = A_CHUNK[attention]
        a = run_engine(model, workdir, "a", steps_for(attention, A_STEPS), info=info,
                       engine_args={} if chunk is None else {"max_num_batched_tokens": chunk})
        b = run_engine(model, workdir, "b", steps_for(attention, B_STEPS), info=info)
        reference = run_engine(model, workdir, "reference",
                               steps_for(attention, A_STEPS + B_STEPS), info=None,
                               engine_args=engine_args_for(cluster.settings.config))
        yield {"attention": attention, "model": model, "cluster": cluster, "info": info,
               "workdir": workdir, "a": a, "b": b, "reference": reference}


def _report(result: dict[str, Any]) -> dict[str, int]:
    return result["connector"]


def _saved_to(prompt: list[int]) -> int:
    """The deepest boundary a prefill of `prompt` saves: its last whole hash unit."""
    return len(prompt) // UNIT * UNIT


def _hit_for(prompt: list[int], saved: int) -> int:
    """Where a hit on a prefix saved to `saved` lands: vLLM leaves the prompt's last token to
    compute, so no deeper than the prompt's last unit boundary before it."""
    return min(saved, (len(prompt) - 1) // UNIT * UNIT)


def test_engine_b_resumes_from_engine_a_at_every_saved_boundary(family: dict[str, Any]) -> None:
    assert_reference_outputs({"a": family["a"], "b": family["b"]}, family["reference"],
                             f"{family['attention']} ")
    b = family["b"]
    # B started cold: the resend comes from the tier whole; the fork's next turn finds the
    # system prompt's whole units in B's own cache (the resend's) and the rest in the tier
    local = {"s1t2-resend": 0, "s2t2": _saved_to(SYSTEM)}
    for rid, prompt, saved in (("s1t2-resend", S1_T2, _saved_to(S1_T2)),
                               ("s2t2", S2_T2, _saved_to(S2_T1))):
        report = _report(b[rid])
        assert report["cachetier_hit_tokens"] == _hit_for(prompt, saved), (rid, report)
        assert report["cachetier_loaded_tokens"] == report["cachetier_hit_tokens"] - local[rid], (
            rid, report)
        assert b[rid]["num_cached_tokens"] == report["cachetier_hit_tokens"], rid
    assert _report(b["miss"])["cachetier_hit_tokens"] == 0
    assert b["miss"]["num_cached_tokens"] == 0


def test_a_prefill_saves_each_boundary_it_crosses(family: dict[str, Any]) -> None:
    """Each step saves the deepest whole unit its chunk reaches past what vLLM's own cache held
    (the fork finds some of the system prompt there once the first session computed it; the next
    turn, its first turn). GQA's chunks are shorter than a unit, so each step crosses one
    boundary at most: every whole unit is a save of its own. An uncut MLA prefill saves once."""
    a = family["a"]
    for rid, prompt in (("s1t1", S1_T1), ("s2t1", S2_T1), ("s1t2", S1_T2)):
        local = a[rid]["num_cached_tokens"]
        saves = (_saved_to(prompt) - local) // UNIT if A_CHUNK[family["attention"]] else 1
        assert _report(a[rid])["cachetier_saved_boundaries"] == saves, (rid, local,
                                                                        _report(a[rid]))
        assert _report(a[rid])["cachetier_loaded_tokens"] == 0
    # Sent together, one of the first turns starts cold and the other finds the system prompt's
    # whole units in vLLM's own cache: which one is the scheduler's choice, since the connector's
    # "ask again" can hold either back a step (s1t1 first is the usual order, not a rule).
    firsts = sorted(a[rid]["num_cached_tokens"] for rid in ("s1t1", "s2t1"))
    assert firsts == [0, _saved_to(SYSTEM)], firsts
    assert a["s1t2"]["num_cached_tokens"] == _hit_for(S1_T2, _saved_to(S1_T1))


def test_no_pin_outlives_the_engines(family: dict[str, Any]) -> None:
    check_no_pins(family["cluster"])


def test_damaged_pages_are_caught_and_an_engine_unlike_the_pool_is_refused(
        family: dict[str, Any]) -> None:
    """Damage the pages of DAMAGED's hit: its exact resend, served from them, must fail the
    oracle, while an undamaged restore in the same engine (the resend B served) passes it (the
    comparison can fail, so its passes mean something). Then the other family's model, on this
    pool, is refused naming its model and its attention; for MLA, an engine on vLLM's non-AMX
    MLA kernels does not start (vLLM forces their 16-token blocks, which the pinned hash unit
    does not allow; the connector's own check, prefix caching on, stands behind it)."""
    cluster, info = family["cluster"], family["info"]
    pool = PagedPool.attach(pickle.loads(cluster.handle_file(0).read_bytes()))
    pinned = pinned_hit(cluster, info, DAMAGED)
    assert pinned.hit_tokens == _hit_for(DAMAGED, _saved_to(DAMAGED))
    noise = torch.Generator().manual_seed(7)
    for slot in range(pool.layout.model.layers_per_group):
        views = pool_attention_views(pool.buffer, pool.layout, slot)
        for page in pinned.mla_pages[0][-2:]:  # the last two pages before the resend's tail
            for part, _ in views.parts:
                part[page] = torch.randn(part[page].shape, generator=noise).to(part.dtype)
    after = run_engine(family["model"], family["workdir"], "damaged",
                       [[request("damaged", DAMAGED)], [request("s1t2-resend", S1_T2)]],
                       info=info)
    assert _report(after["damaged"])["cachetier_loaded_tokens"] == pinned.hit_tokens
    verdict = compare(after["damaged"], family["reference"]["damaged"])
    assert verdict.outcome == "mismatch", f"damage not caught ({verdict})"
    assert _report(after["s1t2-resend"])["cachetier_loaded_tokens"] == _hit_for(
        S1_T2, _saved_to(S1_T2))
    assert compare(after["s1t2-resend"], family["reference"]["s1t2-resend"]).ok

    other_kind = {"gqa": "mla", "mla": "gqa"}[family["attention"]]
    other = write_tiny_full_attention(family["workdir"] / "other", other_kind)
    # Without AMX, vLLM refuses the pool's hash unit for MLA itself (its other kernels force
    # 16-token blocks) before the connector is asked; unset, the engine starts (vLLM turning
    # prefix caching off) and must be refused by the connector.
    other_args = {"prefix_match_unit": None} if other_kind == "mla" and not AMX else {}
    with pytest.raises(EngineFailed) as failed:
        run_engine(other, family["workdir"], "other", [[request("x", MISS)]], info=info,
                   engine_args=other_args)
    assert "refuses this engine" in failed.value.log and "model:" in failed.value.log
    assert (f"model.attention_kind: engine '{other_kind}', pool '{family['attention']}'"
            in failed.value.log)
    if family["attention"] == "mla":  # vLLM's non-AMX MLA kernels force 16-token blocks
        with pytest.raises(EngineFailed) as failed:
            run_engine(family["model"], family["workdir"], "no-amx", [[request("x", MISS)]],
                       info=info, engine_args={"attention_backend": "CPU_MLA"})
        assert "block size (16)" in failed.value.log
    check_no_pins(cluster)
