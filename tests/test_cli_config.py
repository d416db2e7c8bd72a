"""`cachetier config show`, the bench delegation, the flags that pick registry entries by name
(`demo --policy`, `replay --policies`) and those that take a secret (by file or environment,
never as a value), run in-process through `cli.main`."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from cachetier.cli import build_parser, main
from cachetier.config import load_config
from cachetier.engine.checkpoint_placement import PLACEMENTS
from cachetier.replay.replayer import PromptHashes, ReplayContext
from cachetier.replay.runners import RUNNER_NAMES, RUNNERS
from cachetier.replay.traces import TraceRequest, write_trace


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr, whether `main` returns or argparse exits."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def show_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_cli(capsys, "config", "show", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_kimi_k3_preset(capsys: pytest.CaptureFixture[str]) -> None:
    described = show_json(capsys, "--preset", "kimi-k3")
    assert described["page_bytes"] == 7077888  # 6,144 tokens x 576 bf16 latents
    # per layer: the kernel-4 conv rows of 3 x 96 x 128 q/k/v channels, then 96 heads' states
    assert described["kda_conv_bytes"] == 3 * 96 * 128 * 3 * 2 == 221184
    assert described["kda_recurrent_bytes"] == 96 * 128 * 128 * 2
    assert described["kda_page_bytes"] == 221184 + 96 * 128 * 128 * 2 == 3366912
    assert described["kda_padding_fraction"] == pytest.approx(0.5243, abs=1e-4)
    assert described["mla_padding_fraction"] == 0.0
    assert described["checkpoint_conv_bytes"] == 69 * 221184
    assert described["checkpoint_recurrent_bytes"] == 69 * 96 * 128 * 128 * 2  # the seed's 217 MB
    assert described["checkpoint_bytes_unpadded"] == 69 * 3366912
    assert described["model"]["kda_groups"] * described["model"]["layers_per_group"] == 69
    assert described["cache"] == {"hash_block_tokens": 512, "page_tokens": 6144,
                                  "page_alignment": 4096, "num_pages": 4096, "max_batch": 256,
                                  "hash_algo": "xxh3_128"}


def test_qwen3_next_preset(capsys: pytest.CaptureFixture[str]) -> None:
    described = show_json(capsys, "--preset", "qwen3-next")
    model = described["model"]
    assert (model["linear_kind"], model["attention_kind"]) == ("gdn", "gqa")
    assert model["kda_groups"] * model["layers_per_group"] == 36
    assert model["mla_groups"] * model["layers_per_group"] == 12
    # GQA: 512 tokens x 2 KV heads x (K, V) x 256 bf16
    assert described["mla_page_bytes"] == 512 * 2 * 2 * 256 * 2 == 1048576
    # GDN per layer: conv over q, k (16 key heads x 128) and v (32 value heads x 128) = 8,192
    # channels x 3 bf16, then 32 value heads' 128 x 128 bf16 states
    assert described["kda_conv_bytes"] == (2 * 16 * 128 + 32 * 128) * 3 * 2 == 49152
    assert described["kda_recurrent_bytes"] == 32 * 128 * 128 * 2
    assert described["kda_page_bytes"] == described["page_bytes"] == 1097728
    assert described["kda_padding_fraction"] == 0.0
    assert described["mla_padding_fraction"] == pytest.approx(1 - 1048576 / 1097728, abs=1e-4)
    assert described["checkpoint_bytes_unpadded"] == 36 * 1097728
    assert described["checkpoint_bytes_pooled"] == 3 * 12 * 1097728


def test_gqa_kv_heads_split_then_replicate_over_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    tokens = [show_json(capsys, "--preset", "qwen3-next", "--set", f"model.tp_degree={tp}")
              ["mla_page_bytes"] for tp in (1, 2, 4)]
    assert tokens == [1048576, 524288, 524288]  # 2 KV heads: one per rank from TP 2 on


QWEN3_NEXT_HF = {
    "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "torch_dtype": "bfloat16",
}
KIMI_LINEAR_HF = {
    "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]},
}


def write_json(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_hf_config_of_qwen3_next_is_the_preset(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    path = write_json(tmp_path, QWEN3_NEXT_HF)
    from_file = show_json(capsys, "--preset", "qwen3-next", "--hf-config", path)
    preset = show_json(capsys, "--preset", "qwen3-next")
    assert {**from_file["model"], "name": "qwen3-next"} == preset["model"]
    assert from_file["page_bytes"] == preset["page_bytes"]


def test_hf_config_layer_types_list(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    data = {key: value for key, value in QWEN3_NEXT_HF.items() if key != "full_attention_interval"}
    path = write_json(tmp_path, {"text_config": {**data, "num_hidden_layers": 8,
                                                 "layer_types": kinds * 2}})
    model = show_json(capsys, "--preset", "qwen3-next", "--hf-config", path)["model"]
    assert (model["kda_groups"], model["mla_groups"], model["layers_per_group"]) == (3, 1, 2)


def test_hf_config_of_kimi_linear(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = show_json(capsys, "--preset", "kimi-k3", "--hf-config",
                      write_json(tmp_path, KIMI_LINEAR_HF))["model"]
    assert (model["linear_kind"], model["attention_kind"]) == ("kda", "mla")
    # 20 KDA and 7 MLA layers share no larger group size than 1
    assert (model["kda_groups"], model["mla_groups"], model["layers_per_group"]) == (20, 7, 1)
    assert (model["kda_heads"], model["kda_head_k_dim"], model["mla_latent_dim"]) == (32, 128, 576)


# Full-attention configs as their model families write them (a DeepSeek-V3's MLA, a Llama's GQA)
DEEPSEEK_V3_HF = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512,
                  "qk_rope_head_dim": 64, "num_attention_heads": 128, "num_key_value_heads": 128,
                  "torch_dtype": "bfloat16"}
LLAMA_HF = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("data", "attention"), [(DEEPSEEK_V3_HF, "mla"), (LLAMA_HF, "gqa")])
def test_hf_config_of_a_full_attention_model(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             data: dict, attention: str) -> None:
    """No linear state: one group of every layer, and a page of full-attention rows alone."""
    shown = show_json(capsys, "--hf-config", write_json(tmp_path, data))
    model = shown["model"]
    assert (model["kda_groups"], model["mla_groups"], model["layers_per_group"]) == (
        0, 1, data["num_hidden_layers"])
    assert model["attention_kind"] == attention
    assert ((model["mla_latent_dim"], model["gqa_kv_heads"], model["gqa_head_dim"])
            == ((576, 0, 0) if attention == "mla" else (0, 8, 128)))
    row = 576 * 2 if attention == "mla" else 8 * 2 * 128 * 2  # bytes per token per layer
    assert shown["page_bytes"] >= shown["cache"]["page_tokens"] * row


@pytest.mark.parametrize(("data", "field"), [
    ({**LLAMA_HF, "layer_types": ["sliding_attention"] * 32}, "hf_config.layer_types"),
    ({**LLAMA_HF, "use_sliding_window": True}, "hf_config.layer_types"),
    ({k: v for k, v in DEEPSEEK_V3_HF.items() if k != "qk_rope_head_dim"},
     "hf_config.qk_rope_head_dim: missing"),
    ({k: v for k, v in QWEN3_NEXT_HF.items() if k != "linear_num_key_heads"},
     "hf_config.linear_num_key_heads: missing"),
    ({**QWEN3_NEXT_HF, "torch_dtype": "int4"}, "hf_config.torch_dtype: unsupported dtype"),
    ({**QWEN3_NEXT_HF, "full_attention_interval": 0}, "hf_config.full_attention_interval"),
    ({"model_type": "llama", "hidden_size": 4096}, "hf_config.model_type: unsupported model"),
    ({**KIMI_LINEAR_HF, "linear_attn_config": {"num_heads": 32, "head_dim": 128}},
     "hf_config.linear_attn_config.full_attn_layers"),
])
def test_bad_hf_config_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path, data: dict, field: str) -> None:
    code, out, err = run_cli(capsys, "config", "show", "--hf-config", write_json(tmp_path, data))
    assert code == 2 and out == "" and field in err


def test_tiny_preset_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    described = show_json(capsys)
    assert described["model"]["name"] == "tiny"
    # 192 conv channels x 3 fp32 + 4 heads x 16 x 16 fp32 = 6,400 bytes, rounded up to 512
    assert described["kda_page_bytes"] == 2304 + 4096
    assert described["page_bytes"] == 6656
    assert described["kda_padding_fraction"] == pytest.approx(1 - 6400 / 6656, abs=1e-4)
    assert described["mla_padding_fraction"] == pytest.approx(1 - 4096 / 6656, abs=1e-4)


def test_set_overrides_a_field(capsys: pytest.CaptureFixture[str]) -> None:
    described = show_json(capsys, "--preset", "kimi-k3", "--set", "model.tp_degree=4",
                          "--set", "cache.hash_algo=sha256")
    assert described["model"]["tp_degree"] == 4
    assert described["kda_page_bytes"] == 3 * 24 * 128 * 3 * 2 + 24 * 128 * 128 * 2
    assert described["cache"]["hash_algo"] == "sha256"


@pytest.mark.parametrize(("override", "field"), [
    ("model.tp_degree=5", "model.tp_degree"),
    ("cache.page_tokens=100", "cache.page_tokens"),
    ("cache.num_pages=many", "cache.num_pages"),
    ("model.bogus=1", "model.bogus"),
    ("model.linear_kind=mamba", "model.linear_kind"),
    ("model.kda_key_heads=2", "model.kda_key_heads"),  # KDA: one key head per value head
    ("model.attention_kind=gqa", "model.gqa_kv_heads"),  # GQA needs its own fields
])
def test_invalid_set_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str], override: str,
                                              field: str) -> None:
    code, out, err = run_cli(capsys, "config", "show", "--set", override)
    assert code == 2 and out == ""
    assert field in err


def test_toml_file_overrides_the_preset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cache.toml"
    path.write_text('[model]\nkda_heads = 8\n\n[cache]\npage_tokens = 128\nhash_algo = "sha256"\n')
    described = show_json(capsys, "--config", str(path), "--set", "cache.num_pages=9")
    assert described["model"]["kda_heads"] == 8
    assert described["cache"]["page_tokens"] == 128
    assert described["cache"]["num_pages"] == 9
    assert described["kda_page_bytes"] == 3 * 8 * 16 * 3 * 4 + 8 * 16 * 16 * 4


@pytest.mark.parametrize(("text", "message"), [
    ("[model]\nbogus = 1\n", "model.bogus: unknown field"),
    ("[servers]\nport = 1\n", "servers: unknown section"),
    ("[model\n", "--config"),
])
def test_bad_toml_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str,
                               message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, _, err = run_cli(capsys, "config", "show", "--config", str(path))
    assert code == 2 and message in err


def test_missing_toml_file_and_unknown_preset_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "config", "show", "--config", "/nonexistent/x.toml")
    assert code == 2 and "/nonexistent/x.toml" in err
    code, _, err = run_cli(capsys, "config", "show", "--preset", "huge")
    assert code == 2 and "unknown preset 'huge'" in err


def test_text_output_loads_back_as_a_config_file(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    code, text, _ = run_cli(capsys, "config", "show", "--preset", "kimi-k3")
    assert code == 0 and "# page_bytes = 7077888" in text
    path = tmp_path / "k3.toml"
    path.write_text(text)
    assert show_json(capsys, "--config", str(path)) == show_json(capsys, "--preset", "kimi-k3")


def test_unknown_flag_and_malformed_set_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "config", "show", "--bogus")[0] == 2
    code, _, err = run_cli(capsys, "config", "show", "--set", "model.tp_degree")
    assert code == 2 and "SECTION.KEY=VALUE" in err


def fake_bench(monkeypatch: pytest.MonkeyPatch, name: str, run: object) -> None:
    module = types.ModuleType(f"cachetier.bench.{name}")
    module.add_arguments = lambda parser: parser.add_argument("--tokens", type=int, default=1)
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)


def test_bench_lookup_awaits_an_async_run(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def run(args: object) -> dict:
        return {"cases": [{"tokens": args.tokens, "p50_us": 120.123456}]}  # type: ignore[attr-defined]

    fake_bench(monkeypatch, "lookup", run)
    code, out, _ = run_cli(capsys, "bench", "lookup", "--json", "--tokens", "4096")
    assert code == 0 and json.loads(out) == {"cases": [{"tokens": 4096, "p50_us": 120.123456}]}
    code, out, _ = run_cli(capsys, "bench", "lookup", "--tokens", "7")
    assert code == 0 and out.split() == ["tokens", "p50_us", "7", "120.1"]


def test_bench_restore_runs_a_sync_run_and_prints_a_table(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fake_bench(monkeypatch, "restore", lambda args: {
        "device": "cpu", "cases": [{"pages": 1, "gbps": 1.5}, {"pages": 64, "gbps": 12.25}]})
    code, out, _ = run_cli(capsys, "bench", "restore")
    assert code == 0
    assert out.splitlines() == ["device: cpu", "pages   gbps", "    1    1.5", "   64  12.25"]


def test_missing_bench_module_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cachetier.bench.restore", None)
    code, out, err = run_cli(capsys, "bench", "restore", "--json")
    assert code == 1 and out == ""
    assert "bench restore is not available: module cachetier.bench.restore is missing" in err


# -- names picked from a registry: demo --policy (placements), replay --policies (runners) ---------

NAME_ERROR = re.compile(r"^cachetier: (--policy|--policies): unknown (checkpoint placement|replay "
                        r"runner) '([^']*)'; expected one of ([\w-]+, )*[\w-]+$")
PLACEMENT_LIST = ", ".join(PLACEMENTS)
RUNNER_LIST = ", ".join(RUNNER_NAMES)


@pytest.fixture
def demo_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`demo` without a cluster: `up` calls the demo at once, which records its options."""
    runs: list[Any] = []
    monkeypatch.setattr("cachetier.run.cluster.up", lambda settings, serve: serve("cluster") or 0)
    monkeypatch.setattr("cachetier.run.demo.run_demo",
                        lambda cluster, options: runs.append(options))
    return runs


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "two.jsonl"
    write_trace(path, [TraceRequest(0, 1024, 1, (7, 8)), TraceRequest(1, 1600, 1, (7, 8, 9, 10))])
    return path


UNKNOWN_PLACEMENT = "--policy: unknown checkpoint placement {!r}; expected one of " + PLACEMENT_LIST


@pytest.mark.parametrize("value, message", [
    ("lru", UNKNOWN_PLACEMENT.format("lru")),
    ("oracle", UNKNOWN_PLACEMENT.format("oracle")),
    ("Seed", UNKNOWN_PLACEMENT.format("Seed")),
    ("seed,branch", "--policy: one checkpoint placement only, got seed, branch"),
    (" , ", f"--policy: no checkpoint placement named; expected one of {PLACEMENT_LIST}"),
], ids=["eviction-policy", "runner-only", "case", "two", "none"])
def test_demo_refuses_a_bad_placement_before_starting_anything(
        capsys: pytest.CaptureFixture[str], demo_runs: list[Any], value: str, message: str) -> None:
    code, out, err = run_cli(capsys, "demo", "--policy", value)
    assert (code, out, err.strip()) == (2, "", f"cachetier: {message}")
    assert demo_runs == []


@pytest.mark.parametrize("value, message", [
    ("seed,lru", f"--policies: unknown replay runner 'lru'; expected one of {RUNNER_LIST}"),
    ("seed,,Branch", f"--policies: unknown replay runner 'Branch'; expected one of {RUNNER_LIST}"),
    ("seed, seed", "--policies: replay runner 'seed' named twice"),
    (",", f"--policies: no replay runner named; expected one of {RUNNER_LIST}"),
], ids=["eviction-policy", "case", "twice", "none"])
def test_replay_refuses_a_bad_runner_alike(capsys: pytest.CaptureFixture[str], trace: Path,
                                           value: str, message: str) -> None:
    code, out, err = run_cli(capsys, "replay", str(trace), "--policies", value)
    assert (code, out, err.strip()) == (2, "", f"cachetier: {message}")


def test_both_flags_refuse_an_unknown_name_in_the_same_shape(
        capsys: pytest.CaptureFixture[str], demo_runs: list[Any], trace: Path) -> None:
    demo = run_cli(capsys, "demo", "--policy", "nope")[2].strip()
    replay = run_cli(capsys, "replay", str(trace), "--policies", "nope")[2].strip()
    shapes = [NAME_ERROR.match(err) for err in (demo, replay)]
    assert all(shapes), (demo, replay)
    assert [m.group(1, 2, 3) for m in shapes] == [  # type: ignore[union-attr]
        ("--policy", "checkpoint placement", "nope"), ("--policies", "replay runner", "nope")]


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_demo_runs_every_placement_by_its_name(capsys: pytest.CaptureFixture[str],
                                               demo_runs: list[Any], name: str) -> None:
    assert run_cli(capsys, "demo", "--policy", f" {name} ")[0] == 0
    assert run_cli(capsys, "demo")[0] == 0
    assert [options.policy for options in demo_runs] == [name, "branch"]


def test_replay_runs_the_runners_it_is_given(capsys: pytest.CaptureFixture[str],
                                             trace: Path) -> None:
    code, out, err = run_cli(capsys, "replay", str(trace), "--json", "--policies", " seed ,ladder,")
    assert code == 0, err
    assert list(json.loads(out)["policies"]) == ["seed", "ladder"]


def test_every_placement_name_is_the_runner_that_runs_it() -> None:
    """The demo's names are the placements', spelled as the replay runners that run them."""
    ctx = ReplayContext(Redis(), load_config("kimi-k3"), 8192, PromptHashes("kimi-k3", "xxh3_128"))
    assert set(PLACEMENTS) < set(RUNNER_NAMES)
    for name, placement in PLACEMENTS.items():
        assert RUNNERS[name](ctx).policy is placement


def test_help_says_which_names_each_flag_takes(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: names are not cut at their hyphens
    demo_help = " ".join(run_cli(capsys, "demo", "--help")[1].split())
    assert f"--policy NAME checkpoint placement, one of {PLACEMENT_LIST} (default branch)" \
        in demo_help
    replay_help = " ".join(run_cli(capsys, "replay", "--help")[1].split())
    assert f"--policies NAME,NAME,... replay runners to compare, among {RUNNER_LIST} " \
           "(default: all)" in replay_help


SECRET = "s3cr3t-" * 6


@pytest.mark.parametrize("argv, flag, variable", [
    (["serve", "--redis", "redis://127.0.0.1:1", "--secret", SECRET], "--secret",
     "CACHETIER_SECRET"),
    (["serve", "--redis", "redis://127.0.0.1:1", "--redis-user", "cachetier",
      f"--redis-password={SECRET}"], "--redis-password", "CACHETIER_REDIS_PASSWORD"),
    (["agent", "--service", "tcp://127.0.0.1:1", "--pool", "p", "--token", SECRET], "--token",
     "CACHETIER_TOKEN"),
    (["events", "vllm", "--mqtt", "mqtt://127.0.0.1:1", "--endpoint", "tcp://*:5557", "--token",
      SECRET], "--token", "CACHETIER_TOKEN"),
    (["up", "--secret", SECRET], "--secret", "CACHETIER_SECRET"),
    (["demo", "--secret", SECRET], "--secret", "CACHETIER_SECRET"),
    (["chaos", "--secret", SECRET], "--secret", "CACHETIER_SECRET"),
], ids=["serve", "serve-redis-password", "agent", "events-vllm", "up", "demo", "chaos"])
def test_a_secret_given_on_the_command_line_is_refused(capsys: pytest.CaptureFixture[str],
                                                       argv: list[str], flag: str,
                                                       variable: str) -> None:
    """Refused at parsing, before anything runs, and not taken for an abbreviation of the file
    flag either: the message says where a secret goes instead."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_known_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: a secret on the command line is readable by every local user: " \
           f"use {flag}-file PATH or set {variable}" in err


@pytest.fixture
def up_settings(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`up` without a cluster: the settings it would run with."""
    started: list[Any] = []
    monkeypatch.setattr("cachetier.run.cluster.up", lambda settings: started.append(settings) or 0)
    monkeypatch.delenv("CACHETIER_SECRET", raising=False)
    return started


def test_up_takes_its_secret_from_a_file_or_the_environment(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            up_settings: list[Any]) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    run_dir = ["--run-dir", str(tmp_path / "run")]
    assert run_cli(capsys, "up", "--secret-file", str(tmp_path / "secret"), *run_dir)[0] == 0
    assert run_cli(capsys, "up", *run_dir)[0] == 0  # a new random one
    monkeypatch.setenv("CACHETIER_SECRET", SECRET[::-1])
    assert run_cli(capsys, "up", *run_dir)[0] == 0
    file, random, environment = (settings.secret for settings in up_settings)
    assert (file, environment) == (SECRET, SECRET[::-1])
    assert len(random) == 32 and random not in (SECRET, SECRET[::-1])
