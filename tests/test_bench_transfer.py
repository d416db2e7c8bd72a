"""`cachetier bench transfer --quick` through the CLI: tiny pages, every case's keys present."""

from __future__ import annotations

import json

import pytest

from cachetier.cli import main

CASE_KEYS = {"src_tp", "dst_tp", "bytes", "gbps", "raw_socket_gbps", "ratio"}


def test_quick_run_reports_ours_next_to_a_raw_socket_copy(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "transfer", "--json", "--quick", "--reps", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    cases = json.loads(out)["cases"]
    assert [(c["src_tp"], c["dst_tp"]) for c in cases] == [(1, 1), (1, 2), (2, 1)]
    for case in cases:
        assert CASE_KEYS <= case.keys()
        assert case["bytes"] == cases[0]["bytes"] > 0          # the same checkpoints every case
        assert case["gbps"] > 0 and case["raw_socket_gbps"] > 0
        assert case["ratio"] == pytest.approx(case["gbps"] / case["raw_socket_gbps"], rel=0.02)
    assert cases[1]["vs_same_tp"] == pytest.approx(cases[1]["gbps"] / cases[0]["gbps"], rel=0.02)
    assert "bench transfer: TP 1 -> 2" in err
