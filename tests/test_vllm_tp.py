"""Tensor parallelism through the connector: two-rank vLLM engines, one agent per rank.

The cluster is `cachetier up --vllm-model --agents 2`'s: the pool's pages hold one rank's share of
the heads (one GQA KV head and half the GDN heads of the tiny model per rank), rank r's worker
maps agent r's pool. Engine A (TP 2) serves prompts P and C, then a continuation X of P computed
from scratch (salted) as the reference; engine B (TP 2), started after A exits, serves X, restored
from the tier at P's tail, and must give the reference's outputs. Before B runs, rank 1's share of
C's pages is damaged and nothing else: B's resend of C must then fail the oracle, so the pass of X
shows that each rank restored its own share, not that one rank's bytes happened to suffice.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from cachetier.run.cluster import Cluster
from cachetier.vllm.geometry import FINE_HASH_UNIT
from cachetier.vllm.kv_copy import pool_attention_views, pool_state_views
from cachetier.vllm.oracle import compare
from gpu_pool import PagedPool
from tests.vllm_harness import (check_no_pins, pinned_hit, request, run_engine, tokens,
                                vllm_cluster)

TP = 2
P = tokens(200, 2500)  # saved by A at its tail, (2500 - 1) // 128 * 128 = 2,432
TAIL = 2432
X = P + tokens(201, 400)
C = tokens(202, 2305)  # its exact resend resumes at 2,304
A_STEPS = [[request("p", P), request("c", C)], [request("x", X, salt="from-scratch")]]
B_STEPS = [[request("x", X)], [request("c", C)]]
ENGINE = {"tensor_parallel_size": TP}


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with vllm_cluster(model_dir, tmp_path_factory.mktemp("cluster"), pool_pages=256,
                      agents=TP) as running:
        yield running


@pytest.fixture(scope="module")
def served(model_dir: Path, cluster: Cluster,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("engines")
    info = cluster.run_dir / "info.json"
    a = run_engine(model_dir, workdir, "a", A_STEPS, info=info, engine_args=ENGINE)
    _damage_rank_share(cluster, info, C, rank=1)
    b = run_engine(model_dir, workdir, "b", B_STEPS, info=info, engine_args=ENGINE)
    return {"a": a, "b": b}


def _damage_rank_share(cluster: Cluster, info: Path, prompt: list[int], rank: int) -> None:
    """Noise into one rank's share of the prompt's attention pages and checkpoint state."""
    hit = pinned_hit(cluster, info, prompt)
    assert hit.hit_tokens > 0
    pool = PagedPool.attach(pickle.loads(cluster.handle_file(rank).read_bytes()))
    noise = torch.Generator().manual_seed(rank)
    for slot in range(pool.layout.model.layers_per_group):
        attention = pool_attention_views(pool.buffer, pool.layout, slot)
        state = pool_state_views(pool.buffer, pool.layout, slot)
        damaged = [(part, page) for page in hit.mla_pages[0]
                   for part in (attention.keys, attention.values)]
        damaged += [(state.recurrent, page) for page in hit.checkpoint_pages]
        for part, page in damaged:
            part[page] = (torch.randn(part[page].shape, generator=noise) * 3).to(part.dtype)


def test_a_two_rank_engine_restores_every_rank_share(served: dict[str, Any]) -> None:
    a, b = served["a"], served["b"]
    restored = b["x"]
    report = restored["connector"]
    assert report["cachetier_loaded_tokens"] == TAIL, report  # B had nothing of its own
    verdict = compare(restored, a["x"])
    assert verdict.ok, f"x: {verdict}"


def test_one_rank_damaged_share_is_caught(served: dict[str, Any]) -> None:
    a, b = served["a"], served["b"]
    report = b["c"]["connector"]
    tail = (len(C) - 1) // FINE_HASH_UNIT * FINE_HASH_UNIT
    assert report["cachetier_loaded_tokens"] == tail, report
    verdict = compare(b["c"], a["c"])
    assert verdict.outcome == "mismatch", f"c: rank 1's damaged share not caught ({verdict})"


def test_no_pin_outlives_the_engines(served: dict[str, Any], cluster: Cluster) -> None:
    check_no_pins(cluster)
