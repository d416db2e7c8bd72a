"""`cachetier bench service --quick` end to end through the CLI, against the tests' redis-server:
a service and an in-process CPU agent, steps through the service next to the index called
directly, and a short throughput run, batched and (`--unbatched`) not, on one event loop or on
each of two (`--loops`), plan + release or (`--cycle full`) with each step committed and
confirmed."""

from __future__ import annotations

import json

import pytest

from cachetier.cli import main
from tests.redis_harness import all_keys

CASE_KEYS = {"batch", "tokens", "service_p50_us", "service_p99_us", "direct_p50_us",
             "rtt_p50_us", "ratio", "copies_per_step", "hit_tokens"}
POSITIVE = ("service_p50_us", "service_p99_us", "direct_p50_us", "rtt_p50_us", "ratio",
            "copies_per_step", "copy_bytes_per_step", "agent_copy_p50_us")


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "service", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_quick_run_reports_service_direct_and_throughput(capsys: pytest.CaptureFixture[str],
                                                         operator_url: str) -> None:
    before = all_keys(operator_url)
    code, out, err = bench(capsys, "--json", "--quick", "--unbatched", "--cycle", "full",
                           "--redis", operator_url)
    assert code == 0, err
    result = json.loads(out)
    assert [(c["batch"], c["tokens"]) for c in result["cases"]] == [(1, 1024), (4, 1024)]
    for case in result["cases"]:
        assert CASE_KEYS <= case.keys()
        assert all(case[key] > 0 for key in POSITIVE), case
        assert case["service_p99_us"] >= case["service_p50_us"]
        assert case["hit_tokens"] == case["tokens"] - 512      # all but the last block cached
        assert case["copies_per_step"] >= case["batch"]          # real restore copies
        assert case["ratio"] == pytest.approx(case["service_p50_us"] / case["direct_p50_us"],
                                              rel=1e-2)
    assert result["throughput_steps_per_s"] > 0 and result["throughput_min_client_steps"] > 0
    assert result["throughput_plan_p50_us"] <= result["throughput_cycle_p50_us"]
    assert result["throughput_cycle"].startswith("plan+commit+confirm+release")
    assert 0 < result["throughput_commit_p50_us"] <= result["throughput_cycle_p50_us"]
    unbatched = result["unbatched"]  # the same run through a replica that batches nothing
    assert unbatched["steps_per_s"] > 0 and unbatched["min_client_steps"] > 0
    assert unbatched["cycle"] == result["throughput_cycle"] and unbatched["commit_p50_us"] > 0
    for run in (result, {f"throughput_{k}": v for k, v in unbatched.items()}):
        # four scripts a cycle on the server, every client, service and agent in this process
        assert run["throughput_redis_cpu_us_per_step"] > 0
        assert run["throughput_process_cpu_us_per_step"] > run["throughput_redis_cpu_us_per_step"]
    assert result["batching_speedup"] == pytest.approx(
        result["throughput_steps_per_s"] / unbatched["steps_per_s"], rel=2e-2)
    assert result["batching_plan_p50_ratio"] == pytest.approx(
        unbatched["plan_p50_us"] / result["throughput_plan_p50_us"], rel=2e-2)
    assert result["clients"] == 4 and result["agents"].startswith("in-process cpu")
    assert "bench service: 1024 tokens x 4" in err            # progress on stderr, not stdout
    assert all_keys(operator_url) == before                       # a shared server is left as found


def test_both_event_loops_in_one_run(capsys: pytest.CaptureFixture[str], operator_url: str) -> None:
    code, out, err = bench(capsys, "--json", "--quick", "--loops", "asyncio,uvloop",
                           "--redis", operator_url)
    assert code == 0, err
    result = json.loads(out)
    assert result["event_loop"] == "asyncio"  # the first loop's figures lead
    loops = result["loops"]
    assert list(loops) == ["asyncio", "uvloop"]
    assert loops["asyncio"]["throughput_steps_per_s"] == result["throughput_steps_per_s"]
    assert all(figures["throughput_steps_per_s"] > 0 and set(figures["service_p50_us"]) ==
               {"1x1024", "4x1024"} for figures in loops.values())
    assert result["uvloop_speedup"] == pytest.approx(
        loops["uvloop"]["throughput_steps_per_s"] / loops["asyncio"]["throughput_steps_per_s"],
        rel=2e-2)
    assert "event loop uvloop" in err


@pytest.mark.parametrize("flags, field", [(["--tokens", "1000"], "--tokens"),
                                          (["--tokens", "512"], "--tokens"),
                                          (["--batches", "0"], "--batches"),
                                          (["--clients", "0"], "--clients"),
                                          (["--loops", "tokio"], "--loops"),
                                          (["--loops", "uvloop,uvloop"], "--loops")])
def test_bad_sizes_are_refused_before_any_work(capsys: pytest.CaptureFixture[str],
                                               flags: list[str], field: str) -> None:
    code, _, err = bench(capsys, "--quick", "--redis", "redis://127.0.0.1:1", *flags)
    assert code == 2 and field in err
