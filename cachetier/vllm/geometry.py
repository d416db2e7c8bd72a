"""Which pool serves which vLLM engine: the geometry both must share, read from each side.

The alignment rules (the connector refuses an engine that breaks one, naming it):

- cachetier's hash block is vLLM's hash unit (`prefix_match_unit`, 128 by default here). A hit is
  a multiple of it, so it is a boundary vLLM can resume at, and every boundary state vLLM offers
  in align mode (the ends of its attention blocks and each prompt's last hash-unit boundary) is a
  boundary cachetier can key a checkpoint by.
- cachetier's page is vLLM's attention block (`block_size`): vLLM sizes that block so that one
  attention block and one linear-attention state take the same bytes, which is cachetier's unified
  page too, so one page id holds one vLLM block of either kind with the same padding. A
  full-attention model (GQA or MLA, no linear state) has no such constraint: its block is 128
  tokens (`_KERNEL_BLOCK_BASE`, which every CPU and CUDA backend accepts, AMX MLA included), and
  a hit may land on any hash-unit boundary, as every prefix's KV is all a resume needs.
- The model fields (families, groups, heads, dims, dtypes, TP degree) are the pool's `ModelSpec`:
  `model_spec_from_vllm` rebuilds it from the engine's `KVCacheConfig` (the state shapes vLLM
  actually allocates, not what a config file says), and `geometry_differences` lists every field
  that disagrees.
- The namespace of the hashes is the model's fingerprint (`model_fingerprint`: its config and
  weight files), vLLM's `cache_salt` and the LoRA adapter: two engines share entries only when
  they would compute the same bytes.

`engine_args_for` gives the vLLM engine arguments that realise these rules for a model directory
(what `cachetier up --vllm-model` writes into its info file), and `config_for_model` the pool
configuration that matches them, computed from the model's `config.json` the way vLLM sizes its
blocks (the connector checks the result against the real engine at start).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any

from cachetier.config import DTYPE_BYTES, CacheSpec, Config, ModelSpec
from cachetier.hf_config import NO_LINEAR_STATE, hf_model_fields

FINE_HASH_UNIT = 128  # the default hash unit: prompt tails restored at 128-token boundaries
SSM_STATE_DTYPE = "float32"  # vLLM keeps the GDN recurrent state in float32 (pinned below)
_KERNEL_BLOCK_BASE = 128  # the smallest attention block vLLM's CPU and CUDA backends both accept


_KDA_MLA_REFUSAL = ("KDA + MLA hybrids (Kimi Linear, Kimi K3) run only on vLLM's GPU kernels "
                    "(vllm/models/kimi_k3), so their block layout could not be checked against "
                    "an engine here: not served through vLLM yet (GDN + GQA hybrids and "
                    "full-attention GQA or MLA models are)")


class GeometryMismatch(ValueError):
    """The engine and the pool disagree; the message names every differing field."""


def model_fingerprint(model_dir: str | Path) -> str:
    """A short id of the model's bytes: its config.json and every weight file (name, size and
    content). Engines with the same fingerprint compute the same KV for the same tokens."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    files = [root / "config.json", *sorted(root.glob("*.safetensors"))]
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:24]


def config_for_model(model_dir: str | Path, *, num_pages: int, max_batch: int = 64,
                     hash_unit: int | None = None, tp_degree: int = 1) -> Config:
    """The pool configuration for a model served by vLLM with `engine_args_for` on `tp_degree`
    ranks (one agent per rank, each pool page one rank's share of a block): a GDN + GQA hybrid,
    or a full-attention model (GQA or MLA). The hash unit is `FINE_HASH_UNIT` unless given (any
    divisor of vLLM's block; a hybrid's block itself keeps only block-end states, and serves less
    of each prompt)."""
    fields = hf_model_fields(Path(model_dir) / "config.json")
    if fields["kda_groups"] and fields["linear_kind"] != "gdn":
        raise GeometryMismatch(f"{model_dir}: {_KDA_MLA_REFUSAL}")
    if fields["kda_groups"]:
        fields["kda_state_dtype"] = SSM_STATE_DTYPE
    model = ModelSpec(**fields, tp_degree=tp_degree)
    block = attention_block_tokens(model) if model.kda_groups else _KERNEL_BLOCK_BASE
    unit = hash_unit or FINE_HASH_UNIT
    if unit <= 0 or block % unit:
        raise GeometryMismatch(f"hash unit {unit} does not divide vLLM's {block}-token block")
    cache = CacheSpec(hash_block_tokens=unit, page_tokens=block, page_alignment=128,
                      num_pages=num_pages, max_batch=max_batch)
    return Config(model, cache)


def attention_block_tokens(model: ModelSpec) -> int:
    """vLLM's hybrid block size: the fewest tokens, a multiple of the kernel base, whose
    attention page holds one linear-attention state (vLLM pads the state page to it). Each rank
    sizes its own pages, from its share of the heads."""
    token_bytes = model.mla_token_bytes
    state_bytes = model.kda_rank_conv_bytes + model.kda_rank_recurrent_bytes
    base = math.lcm(_KERNEL_BLOCK_BASE, FINE_HASH_UNIT)
    return base * math.ceil(state_bytes / (base * token_bytes))


def engine_args_for(config: Config) -> dict[str, Any]:
    """Every vLLM engine argument the connector relies on, pinned rather than left to defaults
    (the mamba ones for a hybrid only).

    The hash unit stays below a hybrid's block although vLLM 0.32.0 truncates its own copy of a
    hit's tail block there (two layers per group or more, `cow`): the connector's workers
    complete that copy, which keeps every hit, where the block as the unit would avoid the copy
    and lose the prompt tails (`bench vllm --hybrid-blocks 2 --resends`: 155,520 hit tokens
    against 168,064, 7.5% fewer; the completion: the same 168,064, for 0.3% of the step time),
    and vLLM gives a connector no way to own a local hit's tail instead (it keeps its local hit
    unless the connector's is longer). An engine given these arguments
    without the connector is not protected."""
    args: dict[str, Any] = {"enable_prefix_caching": True,
                            "prefix_match_unit": config.cache.hash_block_tokens,
                            "block_size": config.cache.page_tokens,
                            "dtype": config.model.mla_dtype,
                            "tensor_parallel_size": config.model.tp_degree}
    if config.model.kda_groups:
        args |= {"mamba_cache_mode": "align",
                 "mamba_ssm_cache_dtype": config.model.kda_state_dtype}
    return args


def model_spec_from_vllm(kv_cache_config: Any, tp_degree: int) -> ModelSpec:
    """The `ModelSpec` an engine's `KVCacheConfig` describes: GDN state + GQA groups, or
    full-attention groups alone (GQA or MLA)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    linear = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    full = [g for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    # an MLA spec is a FullAttentionSpec too: read as GQA, its latent would pass for one head
    mla = [g for g in full if isinstance(g.kv_cache_spec, MLAAttentionSpec)]
    if linear and mla:
        raise GeometryMismatch(f"the engine's attention is MLA beside a linear-attention state: "
                               f"{_KDA_MLA_REFUSAL}")
    if not full or len(linear) + len(full) != len(groups) or mla and len(mla) != len(full):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise GeometryMismatch(f"the engine's KV cache groups are neither GDN state + full "
                               f"attention nor full attention alone: {kinds}")
    layers = {len(g.layer_names) for g in (*linear, *full)}
    if len(layers) != 1:
        raise GeometryMismatch(f"the engine's groups hold different layer counts: {sorted(layers)}")
    attention = full[0].kv_cache_spec
    if mla:
        attention_fields = {"attention_kind": "mla", "mla_latent_dim": attention.head_size,
                            "gqa_kv_heads": 0, "gqa_head_dim": 0}
    else:
        attention_fields = {"attention_kind": "gqa", "mla_latent_dim": 0,
                            "gqa_kv_heads": attention.num_kv_heads * tp_degree,
                            "gqa_head_dim": attention.head_size}
    linear_fields = _linear_fields(linear[0].kv_cache_spec, tp_degree) if linear else {
        **NO_LINEAR_STATE}
    linear_fields["kda_groups"] = len(linear)
    return ModelSpec(name="vllm", **linear_fields, **attention_fields, mla_groups=len(full),
                     layers_per_group=layers.pop(), mla_dtype=_dtype_name(attention.dtype),
                     tp_degree=tp_degree)


def _linear_fields(state: Any, tp_degree: int) -> dict[str, Any]:
    """A GDN `MambaSpec`'s fields, from the state shapes vLLM allocates on one rank."""
    (conv_len, conv_channels), (heads, v_dim, k_dim) = state.shapes
    conv_dtype, state_dtype = (_dtype_name(d) for d in state.dtypes)
    key_heads = (conv_channels - heads * v_dim) // (2 * k_dim)  # conv_dim = 2 Hk K + H V
    return {"linear_kind": "gdn", "kda_heads": heads * tp_degree,
            "kda_key_heads": key_heads * tp_degree, "kda_head_k_dim": k_dim,
            "kda_head_v_dim": v_dim, "kda_state_dtype": state_dtype,
            "conv_kernel": conv_len + 1, "conv_dtype": conv_dtype}


def geometry_differences(pool: Config, engine_model: ModelSpec, engine_block_tokens: int,
                         engine_hash_unit: int) -> list[str]:
    """Each field where the engine differs from the pool, as `field: engine X, pool Y`."""
    differences = [f"model.{f.name}: engine {getattr(engine_model, f.name)!r}, pool "
                   f"{getattr(pool.model, f.name)!r}"
                   for f in dataclasses.fields(ModelSpec)
                   if f.name != "name"
                   and getattr(engine_model, f.name) != getattr(pool.model, f.name)]
    if engine_block_tokens != pool.cache.page_tokens:
        differences.append(f"block_size: engine {engine_block_tokens}, pool page_tokens "
                           f"{pool.cache.page_tokens}")
    if engine_hash_unit != pool.cache.hash_block_tokens:
        differences.append(f"prefix_match_unit: engine {engine_hash_unit}, pool "
                           f"hash_block_tokens {pool.cache.hash_block_tokens}")
    return differences


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise GeometryMismatch(f"dtype {name} is not one the cache stores ({sorted(DTYPE_BYTES)})")
    return name
