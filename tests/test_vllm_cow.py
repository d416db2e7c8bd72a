"""vLLM 0.32's copy-on-write of a mid-block hit on a hybrid, and the connector's completion of it
(`cachetier.vllm.cow`, `docs/vllm-cow-bug.md`).

Without an engine: the installed vLLM's copy on a synthetic overlay (two layer slots, each seen
through a short view then a block-wide one at the same byte) leaves the block-wide views'
tails behind on vLLM 0.32.0 and copies them on a vLLM that fixed it; `cow.CowCorrection` makes it
whole; the refusals name the release and the hash unit that avoids them.

With engines: a tiny Qwen3-Next of two (3 GDN + 1 attention) blocks (two layers per group, so
vLLM lays its tensors out in two layer slots, the layout whose copy it gets wrong; the suite's
one-block model never shows it), with the recommended engine arguments (`engine_args_for`:
128-token hash unit, 1,152-token block). Each engine serves P and Q from scratch, one request per
step, then resends both: vLLM resumes each resend from its own cache at the prompt's tail (3,200
and 3,328: 896 and 1,024 tokens into the third block, past the 736 tokens of one KV head's V rows
that vLLM's truncated copy reaches), a local hit inside a block whose tail block it copies. A
resend whose copy is whole computes what its first serve computed, from the same state and rows
in the same last chunk: its outputs are the cold computation's bit for bit (token ids and
logprobs). The cold computation is the first serve itself, by the same engine arguments: an engine
with prefix caching off cuts its prefills elsewhere, which alone moved this model's first-token
logprobs by 0.23 nats on such a prompt (measured), far above what an exact comparison allows.

- the local engine (vLLM's prefix cache alone): on vLLM 0.32.0 every resend differs from its first
  serve (equal on a vLLM that copies every view: the test then says so);
- an engine running the connector without the completion (`tests.vllm_unprotected_connector`): the
  same, though the tier holds the same tails (vLLM keeps a local hit unless the tier's is longer);
- an engine running the connector: every resend equals its first serve, at the same hits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm
from packaging.version import Version
from vllm.v1.worker import utils as vllm_worker_utils

from cachetier.run.cluster import Cluster
from cachetier.vllm.cow import (COPY_FUNCTION, CORRECTED_RELEASES, CopyOnWriteRefused,
                                CowCorrection, decide, probe, protect, skipped_views)
from cachetier.vllm.geometry import engine_args_for
from cachetier.vllm.tiny import write_tiny_qwen3_next
from tests.vllm_harness import check_no_pins, request, run_engine, tokens, vllm_cluster

RELEASE = Version(vllm.__version__).release
VLLM_SKIPS_VIEWS = RELEASE in CORRECTED_RELEASES  # vLLM 0.32.0: the copy is known to be truncated
P, Q = tokens(300, 3300), tokens(301, 3400)
TAILS = {"p": 3200, "q": 3328}  # (len - 1) // 128 * 128: inside the block [2304, 3456)


def test_the_installed_vllm_copy_behaves_as_the_connector_expects() -> None:
    """vLLM 0.32.0 truncates; any other release must copy every view (or the connector refuses
    its mid-block hits: revisit `cow.CORRECTED_RELEASES` then)."""
    expected = "skips views at a seen address" if VLLM_SKIPS_VIEWS else "copies every view"
    assert probe(getattr(vllm_worker_utils, COPY_FUNCTION)) == expected, vllm.__version__


def test_the_correction_copies_every_view_and_counts_what_it_completed() -> None:
    correction = CowCorrection(getattr(vllm_worker_utils, COPY_FUNCTION))
    assert probe(correction) == "copies every view"
    copies, _ = correction.take()
    assert copies == 2  # the probe's two block-wide views, one block each
    assert correction.take()[0] == 0


def test_a_tensor_of_one_layer_slot_is_left_to_vllm() -> None:
    """vLLM copies such a storage's whole blocks (the one-block tiny model's layout): nothing was
    skipped."""
    buffer = torch.zeros(4 * 64, dtype=torch.int8)
    views = [buffer.as_strided((4, 48), (64, 1)), buffer.view(torch.bfloat16).view(4, 32)]
    assert skipped_views(views, 4) == []
    two_slots = torch.zeros(2 * 4 * 64, dtype=torch.int8)
    overlay = [two_slots.as_strided((4, 48), (64, 1)), two_slots.as_strided((4, 64), (64, 1))]
    assert [v.shape for v in skipped_views(overlay, 4)] == [(4, 64)]


def test_what_the_connector_does_about_each_copy() -> None:
    skips, fixed, other = "skips views at a seen address", "copies every view", "copies otherwise"
    assert decide(skips, (0, 32, 0), 128, 1152) == "correct"
    assert decide(fixed, (0, 33, 0), 128, 1152) == "none"
    assert decide(skips, (0, 32, 1), 1152, 1152) == "none"  # no hit is mid-block
    for behaviour, release in ((skips, (0, 32, 1)), (other, (0, 32, 0))):
        with pytest.raises(CopyOnWriteRefused) as refused:
            decide(behaviour, release, 128, 1152)  # type: ignore[arg-type]
        message = str(refused.value)
        assert ".".join(map(str, release)) in message and "--vllm-hash-unit 1152" in message


def test_protect_installs_the_correction_wherever_vllm_bound_its_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = getattr(vllm_worker_utils, COPY_FUNCTION)
    bound = [m for m in list(sys.modules.values())
             if getattr(m, "__dict__", {}).get(COPY_FUNCTION) is original]
    for module in bound:
        monkeypatch.setattr(module, COPY_FUNCTION, original)  # undone after the test
    correction = protect(128, 1152)
    if not VLLM_SKIPS_VIEWS:
        assert correction is None
        return
    from vllm.v1.worker import gpu_model_runner  # the CPU and the GPU (v1) model runners' copy

    assert isinstance(correction, CowCorrection) and correction.original is original
    assert getattr(gpu_model_runner, COPY_FUNCTION) is correction
    assert all(getattr(m, COPY_FUNCTION) is correction for m in bound)
    assert protect(128, 1152) is correction  # once per process


# -- engines --------------------------------------------------------------------------------------

STEPS = [[request("p", P)], [request("q", Q)], [request("p-resend", P)], [request("q-resend", Q)]]


def _salted(salt: str) -> list[list[dict[str, Any]]]:
    """The steps in a namespace of their own: the two connector engines share one cluster, and
    neither may restore the other's saves."""
    return [[{**r, "salt": salt} for r in step] for step in STEPS]


@pytest.fixture(scope="module")
def two_block_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen-2"), hybrid_blocks=2)


@pytest.fixture(scope="module")
def cluster(two_block_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with vllm_cluster(two_block_model, tmp_path_factory.mktemp("cluster"),
                      pool_pages=128) as running:
        yield running


@pytest.fixture(scope="module")
def served(two_block_model: Path, cluster: Cluster,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("engines")
    info = cluster.run_dir / "info.json"
    unprotected = json.loads(info.read_text())
    unprotected["kv_transfer_config"].update(
        kv_connector="UnprotectedConnector",
        kv_connector_module_path="tests.vllm_unprotected_connector")
    unprotected_info = info.with_name("info-unprotected.json")
    unprotected_info.write_text(json.dumps(unprotected))
    return {"local": run_engine(two_block_model, workdir, "local", STEPS, info=None,
                                engine_args=engine_args_for(cluster.settings.config)),
            "unprotected": run_engine(two_block_model, workdir, "unprotected",
                                      _salted("unprotected"), info=unprotected_info),
            "protected": run_engine(two_block_model, workdir, "protected",
                                    _salted("protected"), info=info)}


def _resends_equal_first_serves(results: dict[str, Any]) -> dict[str, bool]:
    """Per prompt: the resend's outputs are its first serve's exactly (token ids, logprobs, top
    5), after a local hit at the prompt's tail (the same hit in every engine)."""
    equal = {}
    for rid, tail in TAILS.items():
        first, resend = results[rid], results[f"{rid}-resend"]
        assert first["num_cached_tokens"] == 0 and resend["num_cached_tokens"] == tail, rid
        equal[rid] = all(first[k] == resend[k] for k in ("token_ids", "logprobs", "top"))
    return equal


def test_vllm_alone_serves_mid_block_hits_wrong_on_vllm_0_32(served: dict[str, Any]) -> None:
    equal = _resends_equal_first_serves(served["local"])
    assert equal == {rid: not VLLM_SKIPS_VIEWS for rid in TAILS}, (vllm.__version__, equal)


def test_the_connector_without_the_completion_serves_its_local_hits_wrong(
        served: dict[str, Any]) -> None:
    results = served["unprotected"]
    assert all(results[f"{rid}-resend"]["connector"]["cachetier_loaded_tokens"] == 0
               for rid in TAILS)  # vLLM's local hit, not the tier's
    equal = _resends_equal_first_serves(results)
    assert equal == {rid: not VLLM_SKIPS_VIEWS for rid in TAILS}, (vllm.__version__, equal)


def test_the_connector_serves_mid_block_local_hits_as_computed(served: dict[str, Any]) -> None:
    results = served["protected"]
    assert all(results[f"{rid}-resend"]["connector"]["cachetier_loaded_tokens"] == 0
               for rid in TAILS)
    assert _resends_equal_first_serves(results) == {rid: True for rid in TAILS}
    completed = results["q-resend"]["connector"]["cachetier_cow_copies"]  # the engine's totals
    assert completed > 0 if VLLM_SKIPS_VIEWS else completed == 0


def test_no_pin_outlives_the_engines(served: dict[str, Any], cluster: Cluster) -> None:
    check_no_pins(cluster)
