"""The engine-pool agreement of `cachetier.vllm.geometry`, on vLLM's own spec classes.

`tests/test_vllm_connector.py` shows a real engine accepted and refused (another model, another
block size); here every field the refusal compares, including those no CPU engine can vary (the
CPU GDN kernel runs in bfloat16 only), is changed one at a time on the `KVCacheConfig` a tiny
Qwen3-Next engine builds, and each change must be named.
"""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, MLAAttentionSpec)

from cachetier.private_files import write_private
from cachetier.vllm.geometry import (GeometryMismatch, attention_block_tokens, config_for_model,
                                     engine_args_for, geometry_differences, model_spec_from_vllm)
from cachetier.vllm.info import connector_info, write_info
from cachetier.vllm.settings import ConnectorConfigError, ConnectorSettings
from cachetier.vllm.tiny import write_tiny_full_attention


def _engine_config(*, attention_dtype: torch.dtype = torch.bfloat16, kv_heads: int = 2,
                   state_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
                   block: int = 1152, tp: int = 1) -> KVCacheConfig:
    """What vLLM 0.32 builds for the tiny Qwen3-Next on the CPU (seen in a real engine), on each
    rank of a `tp`-rank engine (heads and conv channels split, the block unchanged)."""
    state = MambaSpec(block_size=block, shapes=((3, 1024 // tp), (4 // tp, 128, 128)),
                      dtypes=state_dtypes, page_size_padded=294912 // tp,
                      mamba_cache_mode="align")
    attention = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads // tp, head_size=32,
                                  dtype=attention_dtype)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], state) for i in range(3)]
    groups.append(KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_pool_for_a_model_matches_its_engine(model_dir: Path) -> None:
    config = config_for_model(model_dir, num_pages=32)
    engine = model_spec_from_vllm(_engine_config(), tp_degree=1)
    assert geometry_differences(config, engine, 1152, 128) == []  # the default unit: tails
    assert attention_block_tokens(config.model) == 1152 == config.cache.page_tokens
    assert config.geometry.page_bytes == 294912  # vLLM's unified page, padding included
    whole_blocks = config_for_model(model_dir, num_pages=32, hash_unit=1152)
    assert geometry_differences(whole_blocks, engine, 1152, 1152) == []
    with pytest.raises(GeometryMismatch, match="does not divide"):
        config_for_model(model_dir, num_pages=32, hash_unit=500)
    assert engine_args_for(config) == {
        "enable_prefix_caching": True, "mamba_cache_mode": "align", "prefix_match_unit": 128,
        "block_size": 1152, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32",
        "tensor_parallel_size": 1}


@pytest.mark.parametrize(("change", "named"), [
    ({"attention_dtype": torch.float16}, "model.mla_dtype: engine 'float16', pool 'bfloat16'"),
    ({"kv_heads": 4}, "model.gqa_kv_heads: engine 4, pool 2"),
    ({"state_dtypes": (torch.bfloat16, torch.bfloat16)},
     "model.kda_state_dtype: engine 'bfloat16', pool 'float32'"),
    ({"state_dtypes": (torch.float32, torch.float32)},
     "model.conv_dtype: engine 'float32', pool 'bfloat16'"),
])
def test_each_difference_is_named(model_dir: Path, change: dict, named: str) -> None:
    config = config_for_model(model_dir, num_pages=32)
    engine = model_spec_from_vllm(_engine_config(**change), tp_degree=1)
    assert named in geometry_differences(config, engine, 1152, 128)


def test_block_and_hash_unit_differences_are_named(model_dir: Path) -> None:
    config = config_for_model(model_dir, num_pages=32)
    engine = model_spec_from_vllm(_engine_config(), tp_degree=1)
    assert geometry_differences(config, engine, 2304, 256) == [
        "block_size: engine 2304, pool page_tokens 1152",
        "prefix_match_unit: engine 256, pool hash_block_tokens 128"]


def test_a_two_rank_pool_matches_each_rank_of_a_two_rank_engine(model_dir: Path) -> None:
    """Each rank's pages hold its share of the heads: half the page of one rank, the block
    unchanged (vLLM's two-rank engine chose 1,152 tokens too, seen here)."""
    config = config_for_model(model_dir, num_pages=32, tp_degree=2)
    rank = model_spec_from_vllm(_engine_config(tp=2), tp_degree=2)
    assert geometry_differences(config, rank, 1152, 128) == []
    assert config.cache.page_tokens == 1152 and config.geometry.page_bytes == 294912 // 2
    assert engine_args_for(config)["tensor_parallel_size"] == 2
    single = config_for_model(model_dir, num_pages=32)
    assert geometry_differences(single, rank, 1152, 128) == [
        "model.tp_degree: engine 2, pool 1"]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_full_attention_engine_matches_the_pool_of_its_model(attention: str,
                                                              tmp_path: Path) -> None:
    """What vLLM builds for the tiny full-attention models (seen in real engines): one group of
    both layers, GQA as `FullAttentionSpec`, MLA as `MLAAttentionSpec` (a FullAttentionSpec too:
    read as GQA, its 576-wide latent would pass for one head)."""
    spec = (FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
            if attention == "gqa" else
            MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))
    engine = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)])
    config = config_for_model(write_tiny_full_attention(tmp_path, attention), num_pages=32)
    model = model_spec_from_vllm(engine, tp_degree=1)
    assert geometry_differences(config, model, 128, 128) == []
    assert (model.kda_groups, model.attention_kind) == (0, attention)
    assert config.cache.page_tokens == 128 and config.geometry.page_bytes == 128 * (
        2 * 2 * 32 * 2 if attention == "gqa" else 576 * 2)
    assert "mamba_cache_mode" not in engine_args_for(config)
    other = config_for_model(write_tiny_full_attention(tmp_path / "other",
                                                       {"gqa": "mla", "mla": "gqa"}[attention]),
                             num_pages=32)
    assert f"model.attention_kind: engine '{attention}', pool '{other.model.attention_kind}'" in (
        geometry_differences(other, model, 128, 128))


def test_mla_beside_a_linear_state_is_refused_by_name() -> None:
    """A KDA + MLA engine (Kimi Linear): vLLM runs it on GPU kernels only, so its block layout
    was never checked against an engine here; the refusal says so instead of guessing."""
    mla = MLAAttentionSpec(block_size=1152, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = _engine_config()
    config.kv_cache_groups[3] = KVCacheGroupSpec(["model.layers.3.self_attn.attn"], mla)
    with pytest.raises(GeometryMismatch, match="MLA beside a linear-attention state: KDA \\+ MLA"):
        model_spec_from_vllm(config, tp_degree=1)


def test_an_engine_with_other_groups_is_refused() -> None:
    config = _engine_config()
    config = dataclasses.replace(config, kv_cache_groups=config.kv_cache_groups[:3])
    with pytest.raises(GeometryMismatch, match="neither GDN state \\+ full attention nor full"):
        model_spec_from_vllm(config, tp_degree=1)


def test_connector_settings_name_the_bad_key(tmp_path: Path) -> None:
    good = {"service": "tcp://127.0.0.1:1", "token": "t", "pool": "p", "handle_file": "/h",
            "model_id": "m"}
    assert ConnectorSettings.from_extra_config(good).placement == "ladder"
    no_token = {k: v for k, v in good.items() if k != "token"}
    for broken, message in (({**good, "pool": 3}, "pool: expected str"),
                            (no_token, "token is missing"),
                            ({**good, "token_file": "/t"}, "token or token_file, not both"),
                            ({**no_token, "token_file": str(tmp_path / "none")},
                             "token_file: .*No such file"),
                            ({**good, "colour": "red"}, "unknown keys \\['colour'\\]"),
                            ({**good, "placement": "nowhere"}, "placement: unknown")):
        with pytest.raises(ConnectorConfigError, match=message):
            ConnectorSettings.from_extra_config(broken)


def test_each_rank_finds_its_own_agent_and_all_share_the_engine_id() -> None:
    good = {"service": "tcp://127.0.0.1:1", "token": "t", "pool": "p",
            "handle_file": "/run/agent-{rank}.handle", "model_id": "m"}
    settings = ConnectorSettings.from_extra_config(good, engine_id="engine-7")
    assert [settings.handle_file_of(r) for r in (0, 1)] == ["/run/agent-0.handle",
                                                             "/run/agent-1.handle"]
    assert settings.engine_id == "engine-7"  # vLLM's, the same in the scheduler and each rank
    one = ConnectorSettings.from_extra_config({**good, "handle_file": "/run/agent-0.handle"})
    assert one.handle_file_of(0) == "/run/agent-0.handle"
    with pytest.raises(ConnectorConfigError, match="needs a '\\{rank\\}'"):
        one.handle_file_of(1)


def test_the_info_file_is_readable_by_its_owner_only(tmp_path: Path, usual_umask: None) -> None:
    """It holds the client token."""
    info = tmp_path / "info.json"
    write_info(info, {"token": "client.mac"})
    assert stat.S_IMODE(info.stat().st_mode) == 0o600
    assert json.loads(info.read_text()) == {"token": "client.mac"}


def test_vllm_serve_args_name_the_token_file_not_the_token(model_dir: Path,
                                                           tmp_path: Path) -> None:
    """`vllm serve MODEL $(jq -r '.vllm_serve_args[]' FILE)` puts every flag on a command line
    every local user reads: the connector is given the token's file, and reads it at start."""
    token_file = write_private(tmp_path / "client", "client.mac\n")
    info = connector_info(service="tcp://127.0.0.1:1", token="client.mac", token_file=token_file,
                          pool="p", handle_file="/run/agent-{rank}.handle", model_dir=model_dir,
                          config=config_for_model(model_dir, num_pages=32))
    assert info["token"] == "client.mac"  # for the user's own clients
    assert not [flag for flag in info["vllm_serve_args"] if "client.mac" in flag]
    extra = info["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["token_file"] == str(token_file) and "token" not in extra
    assert ConnectorSettings.from_extra_config(extra).token == "client.mac"
