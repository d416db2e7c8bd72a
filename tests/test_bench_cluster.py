"""`cachetier bench cluster --json` end to end through the CLI, short: one redis-server and a
local 3x2 Redis Cluster in the same run, a master killed half-way through the cluster's."""

from __future__ import annotations

import json

import pytest

from cachetier.cli import main

KEYS = {"single_rps", "cluster_rps", "shards", "pools", "wait_p50_us", "failover_unavailable_s",
        "lost_acknowledged_writes", "shard_cpu_us_per_request", "single_cpu_us_per_request",
        "one_core_per_shard_rps", "single_one_core_rps", "note"}


def test_quick_run_reports_both_targets_and_the_failover(capsys: pytest.CaptureFixture[str]):
    code = main(["bench", "cluster", "--json", "--pools", "3", "--clients", "1",
                 "--duration", "3", "--samples", "20"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert KEYS <= result.keys()
    assert result["single_rps"] > 0 and result["cluster_rps"] > 0
    assert result["shards"] == 3 and result["pools"] == 3
    assert result["pools_per_shard"] == [1, 1, 1]          # placed evenly
    assert result["lost_acknowledged_writes"] == 0
    assert 0 < result["failover_unavailable_s"] < 30
    assert len(result["shard_cpu_us_per_request"]) == 2     # the killed shard's master is gone
    assert all(cpu > 0 for cpu in result["shard_cpu_us_per_request"].values())
    assert result["one_core_per_shard_rps"] > 0
    assert "bench cluster: one redis-server" in err         # progress on stderr


def test_bad_sizes_are_refused_before_any_work(capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "cluster", "--pools", "0"]) != 0
    assert "--pools" in capsys.readouterr().err
