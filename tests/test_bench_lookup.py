"""`cachetier bench lookup --quick` end to end through the CLI, against the tests' redis-server."""

from __future__ import annotations

import asyncio
import json

import pytest
from redis.asyncio import Redis

from cachetier.bench.lookup_phases import phase_library, phase_times
from cachetier.cli import main
from index.scripts import library
from tests.redis_harness import all_keys

CASE_KEYS = {"tokens", "batch", "p50_us", "p99_us", "rtt_p50_us", "ratio_p50", "hash_ms",
             "round_trips_per_step", "hit_tokens", "server_us_per_request", "noop_p50_us",
             "noop_ratio_p50", "noop_server_us_per_request", "server_us_per_request_p10"}
POSITIVE = ("p50_us", "p99_us", "rtt_p50_us", "ratio_p50", "hash_ms", "server_us_per_request",
            "noop_p50_us", "noop_ratio_p50")


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "lookup", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_quick_run_hits_every_case_in_one_round_trip(capsys: pytest.CaptureFixture[str],
                                                      operator_url: str) -> None:
    before = all_keys(operator_url)
    code, out, err = bench(capsys, "--json", "--quick", "--repeats", "5", "--redis", operator_url)
    assert code == 0, err
    result = json.loads(out)
    assert result["preset"] == "kimi-k3" and result["redis_version"]
    assert result["latency_tracking"] == "no"  # the server's setting: this one cachetier started
    assert [(c["tokens"], c["batch"]) for c in result["cases"]] == [
        (4096, 1), (4096, 4), (16384, 1), (16384, 4)]
    for case in result["cases"]:
        assert CASE_KEYS <= case.keys()
        assert case["hit_tokens"] == case["tokens"] - 512
        assert case["round_trips_per_step"] == 1 and case["scripts_per_step"] == 1
        assert all(case[key] > 0 for key in POSITIVE), case
        assert case["p99_us"] >= case["p50_us"]
        assert case["ratio_p50"] == pytest.approx(case["p50_us"] / case["rtt_p50_us"], rel=1e-2)
        # The server's share of a step is part of its latency, and the step's alone (not the bare
        # round trip's); the no-op with the same arguments is a floor below the real script.
        assert case["server_us_per_request"] * case["batch"] < case["p50_us"]
        assert case["server_us_per_request"] * case["batch"] <= case["script_p50_us"]
        assert case["noop_p50_us"] < case["p50_us"]
        assert case["noop_ratio_p50"] < case["ratio_p50"]
        assert case["noop_ratio_p50"] == pytest.approx(case["noop_p50_us"] / case["rtt_p50_us"],
                                                       rel=1e-2)
        assert 0 <= case["noop_server_us_per_request"] < case["server_us_per_request"]
        assert 0 < case["server_us_per_request_p10"] <= case["server_us_per_request"]
    assert "bench lookup: 16384 tokens x 4" in err       # progress goes to stderr, not stdout
    assert all_keys(operator_url) == before                  # a shared server is left as found


def test_own_server_and_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = bench(capsys, "--quick", "--tokens", "1024", "--batches", "2",
                           "--repeats", "3")
    assert code == 0, err
    assert "redis_version:" in out and "ratio_p50" in out


@pytest.mark.parametrize("flags, field", [(["--tokens", "1000"], "--tokens"),
                                          (["--tokens", "512"], "--tokens"),
                                          (["--batches", "0"], "--batches"),
                                          (["--repeats", "0"], "--repeats")])
def test_bad_sizes_are_refused_before_any_work(capsys: pytest.CaptureFixture[str],
                                               flags: list[str], field: str) -> None:
    code, out, err = bench(capsys, "--quick", "--redis", "redis://127.0.0.1:1", *flags)
    assert code == 2 and out == ""
    assert f"cachetier: {field}:" in err


PHASES = ["meta", "batch", "validate", "match", "size", "capacity", "pins", "evict", "reserve",
          "restore", "slots", "record", "answer", "writes", "reply"]


def libraries(url: str) -> set[str]:
    async def names() -> set[str]:
        async with Redis.from_url(url) as client:
            listed = await client.execute_command("FUNCTION", "LIST")
            return {entry[b"library_name"].decode() for entry in listed}
    return asyncio.run(names())


def test_phases_split_the_step_script_where_its_markers_say(capsys: pytest.CaptureFixture[str],
                                                            operator_url: str) -> None:
    before_keys, before_libraries = all_keys(operator_url), libraries(operator_url)
    code, out, err = bench(capsys, "--json", "--quick", "--repeats", "5", "--phases",
                           "--redis", operator_url, "--tokens", "4096", "--batches", "1", "4")
    assert code == 0, err
    for case in json.loads(out)["cases"]:
        phases = case["phases_us_per_request"]
        assert list(phases) == PHASES  # every marker of plan_step.lua, in its order
        assert all(us >= 0 for us in phases.values())
        assert phases["meta"] > 0 and case["phase_probe_us"] >= 0  # an HMGET is never free
        assert case["phases_sum_us_per_request"] == pytest.approx(sum(phases.values()), abs=0.1)
        assert case["phases_call_us_per_request"] > 0
        # the client's work around the call: packing a msgpack batch, decoding a plan
        assert set(case["client_us_per_request"]) == {"arguments", "decode"}
        assert all(us > 0 for us in case["client_us_per_request"].values())
    assert "4096 tokens x 4: phases, us per request: meta" in err
    # neither the probed library nor any key outlives the run; cachetier's own stays loaded
    assert all_keys(operator_url) == before_keys
    own = library().source.split("\n", 1)[0].removeprefix("#!lua name=")
    after = libraries(operator_url)
    assert own in after and after - before_libraries <= {own}


def test_phase_times_add_up_each_phase_over_the_call() -> None:
    trace = [b"start", 100, b"probe", 102, b"match", 110, b"size", 111, b"match", 117, b"reply", 130]
    assert phase_times(trace) == {"probe": 2, "match": 8 + 6, "size": 1, "reply": 13}
    with pytest.raises(RuntimeError, match="origin"):
        phase_times(trace[2:])


def test_the_loaded_library_keeps_its_markers_as_comments() -> None:
    plain, probed = library().source, phase_library()
    assert "phase_mark" not in plain and "-- phase end: meta" in plain
    markers = plain.count("-- phase end: ")
    assert probed.source.count("phase_mark(\"") == markers + 2  # the origin and its probes
    assert "-- phase end: " not in probed.source.split(probed.step_function, 1)[1].split(
        "redis.register_function", 1)[0]
    assert probed.step_function not in plain and probed.name not in plain  # no name shared
