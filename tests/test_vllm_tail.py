"""Prompt tails through the tier (its default 128-token hash unit): bit for bit vLLM's own reuse.

With a 128-token hash unit vLLM keeps a state at each prompt's last 128-token boundary, inside
its 1,152-token block, and the pool saves it with the block's first rows. Engine A serves a
prompt P; engine B, started after A exits, serves continuations of P (restored at P's tail,
2,432: a first chunk inside the block and one crossing its end) and an exact resend of A's
second prompt (restored at that prompt's own tail). A reference engine with the same arguments
and no connector serves the same requests after the same prompts, resuming from its own cache at
the same boundaries with the same chunks: every output must be the reference's exactly (token
ids and logprobs), not within the oracle's rounding tolerance. Before the connector read vLLM's
CPU K cache as dim-major, B was up to 0.03 nats off here (the partial block's rows were other
bytes); a whole-block restore never showed it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachetier.run.cluster import Cluster
from cachetier.vllm.geometry import FINE_HASH_UNIT, engine_args_for
from tests.vllm_harness import check_no_pins, request, run_engine, tokens, vllm_cluster

P = tokens(100, 2500)  # its tail boundary, (2500 - 1) // 128 * 128 = 2,432, is no block end
TAIL = 2432
SECOND = P + tokens(101, 300)  # A serves it too: its own tail, 2,688, is saved from A
INSIDE = P + tokens(104, 300)  # from the tail to 2,800: the first chunk stays in block 2
CROSSING = P + tokens(105, 1500)  # from the tail to 3,456 (the block end), then on
A_STEPS = [[request("p", P)], [request("second", SECOND)]]
B_STEPS = [[request("inside", INSIDE)], [request("crossing", CROSSING)],
           [request("second-resend", SECOND)]]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with vllm_cluster(model_dir, tmp_path_factory.mktemp("cluster"), pool_pages=256) as running:
        yield running


@pytest.fixture(scope="module")
def served(model_dir: Path, cluster: Cluster,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("engines")
    info = cluster.run_dir / "info.json"
    run_engine(model_dir, workdir, "a", A_STEPS, info=info)
    b = run_engine(model_dir, workdir, "b", B_STEPS, info=info)
    reference = run_engine(model_dir, workdir, "reference", A_STEPS + B_STEPS, info=None,
                           engine_args=engine_args_for(cluster.settings.config))
    return {"b": b, "reference": reference}


def test_tail_restores_are_vllm_local_reuse_bit_for_bit(served: dict[str, Any]) -> None:
    b, reference = served["b"], served["reference"]
    hits = {"inside": TAIL, "crossing": TAIL,
            "second-resend": (len(SECOND) - 1) // FINE_HASH_UNIT * FINE_HASH_UNIT}
    for rid, hit in hits.items():
        report = b[rid]["connector"]
        assert report["cachetier_loaded_tokens"] == hit, rid  # B had nothing: all from the tier
        assert reference[rid]["num_cached_tokens"] == hit, rid  # vLLM's own hit, the same one
        assert b[rid]["token_ids"] == reference[rid]["token_ids"], rid
        assert b[rid]["logprobs"] == reference[rid]["logprobs"], rid
        assert b[rid]["top"] == reference[rid]["top"], rid


def test_no_pin_outlives_the_engines(served: dict[str, Any], cluster: Cluster) -> None:
    check_no_pins(cluster)
