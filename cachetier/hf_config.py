"""A model's cache geometry read from its Hugging Face `config.json`, so a user does not retype it.

Two layouts are understood: Qwen3-Next / Qwen3.5 (Gated DeltaNet + grouped-query attention:
`linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`,
`linear_conv_kernel_dim`, `num_key_value_heads`, `head_dim`, and `layer_types` or
`full_attention_interval`) and Kimi Linear (KDA + MLA: `linear_attn_config` with `num_heads`,
`head_dim`, `short_conv_kernel_size`, `full_attn_layers`, and the MLA latent `kv_lora_rank +
qk_rope_head_dim`). Full-attention models are understood too, with no linear-attention state
(`kda_groups=0`, `NO_LINEAR_STATE`): DeepSeek-V2/V3 style MLA (`kv_lora_rank`,
`qk_rope_head_dim`) and grouped-query attention (Llama, Qwen3: `num_attention_heads`,
`num_key_value_heads`, `head_dim`), every layer a full-attention one. Layers are grouped as the
unified page needs them, `gcd(linear, full)` layers per group (one group of every layer for a
full-attention model). Only model fields come from the file: the tensor-parallel degree and the
whole `CacheSpec` stay the preset's. Every missing or unsupported field is an `HfConfigError` naming
`hf_config.<key>` (`cachetier.config` turns it into its `ConfigError`; this module stays below
it, so the configuration does not import in a circle).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

# the checkpoint dtypes Hugging Face configs name (`torch_dtype`) that the cache stores
HF_DTYPES = ("bfloat16", "float16", "float32")

# A full-attention model's linear-attention fields: it has no such state (`kda_groups=0`), and
# every description of one gives these same smallest valid values, so two compare equal.
NO_LINEAR_STATE: dict[str, Any] = {"linear_kind": "kda", "kda_groups": 0, "kda_heads": 1,
                                   "kda_key_heads": 0, "kda_head_k_dim": 1, "kda_head_v_dim": 1,
                                   "kda_state_dtype": "float32", "conv_kernel": 1,
                                   "conv_dtype": "float32"}


class HfConfigError(ValueError):
    """A config.json field is missing or unsupported; `field` names it as `hf_config.<key>`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def hf_model_fields(path: str | Path) -> dict[str, Any]:
    """The `ModelSpec` fields (all but `tp_degree`) that the config.json at `path` describes."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise HfConfigError("--hf-config", str(exc)) from exc
    if not isinstance(data, dict):
        raise HfConfigError("--hf-config", f"{path}: not a JSON object")
    data = data.get("text_config", data)  # Qwen3.5 nests the language model's config
    if "linear_num_value_heads" in data:
        return _gated_deltanet(data)
    if "linear_attn_config" in data:
        return _kimi_linear(data)
    if "kv_lora_rank" in data:
        return _full_attention(data, _mla_fields(data))
    if "num_attention_heads" in data:
        return _full_attention(data, _gqa_fields(data))
    raise HfConfigError("hf_config.model_type", f"unsupported model {data.get('model_type')!r}: "
                        "neither a Gated DeltaNet config (linear_num_value_heads), a Kimi "
                        "Linear one (linear_attn_config), nor a full-attention one (kv_lora_rank "
                        "for MLA, num_attention_heads for GQA)")


def _full_attention(data: Mapping[str, Any], attention: dict[str, Any]) -> dict[str, Any]:
    """A model whose every layer is full attention (no sliding window: its pages would not hold
    a whole prefix)."""
    layers = _int(data, "num_hidden_layers")
    kinds = data.get("layer_types") or ["full_attention"] * layers
    if set(kinds) != {"full_attention"} or data.get("use_sliding_window"):
        raise HfConfigError("hf_config.layer_types", f"a layer other than full attention "
                            f"({sorted(set(kinds) - {'full_attention'}) or 'sliding window'}): "
                            "not a model this cache serves")
    dtype = _dtype(data)
    return {"name": str(data.get("model_type", "hf")), **NO_LINEAR_STATE,
            **_groups(0, layers), **attention, "mla_dtype": dtype}


def _mla_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_kind": "mla",
            "mla_latent_dim": _int(data, "kv_lora_rank") + _int(data, "qk_rope_head_dim"),
            "gqa_kv_heads": 0, "gqa_head_dim": 0}


def _gqa_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """Grouped-query attention's KV heads: `num_key_value_heads`, or every attention head where a
    config leaves it out (Hugging Face's convention for multi-head attention)."""
    kv_heads = "num_key_value_heads" if "num_key_value_heads" in data else "num_attention_heads"
    return {"attention_kind": "gqa", "mla_latent_dim": 0, "gqa_kv_heads": _int(data, kv_heads),
            "gqa_head_dim": _head_dim(data)}


def _gated_deltanet(data: Mapping[str, Any]) -> dict[str, Any]:
    layers = _int(data, "num_hidden_layers")
    kinds = data.get("layer_types")
    if kinds is None:
        interval = _int(data, "full_attention_interval")
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise HfConfigError("hf_config.layer_types", f"expected a list of {layers} layer types")
    unknown = set(kinds) - {"full_attention", "linear_attention"}
    if unknown:
        raise HfConfigError("hf_config.layer_types", f"unsupported layer types {sorted(unknown)}")
    dtype = _dtype(data)
    return {"name": str(data.get("model_type", "hf")), "linear_kind": "gdn",
            **_groups(kinds.count("linear_attention"), kinds.count("full_attention")),
            "kda_heads": _int(data, "linear_num_value_heads"),
            "kda_key_heads": _int(data, "linear_num_key_heads"),
            "kda_head_k_dim": _int(data, "linear_key_head_dim"),
            "kda_head_v_dim": _int(data, "linear_value_head_dim"),
            "kda_state_dtype": _dtype(data, "mamba_ssm_dtype", dtype),
            "conv_kernel": _int(data, "linear_conv_kernel_dim"), "conv_dtype": dtype,
            **_gqa_fields(data), "mla_dtype": dtype}


def _kimi_linear(data: Mapping[str, Any]) -> dict[str, Any]:
    linear = data["linear_attn_config"]
    if not isinstance(linear, dict):
        raise HfConfigError("hf_config.linear_attn_config", "expected an object")
    full = linear.get("full_attn_layers")
    if not isinstance(full, list):
        raise HfConfigError("hf_config.linear_attn_config.full_attn_layers",
                            "missing or not a list of layer numbers")
    layers = _int(data, "num_hidden_layers")
    heads = _int(linear, "num_heads", "linear_attn_config.")
    head_dim = _int(linear, "head_dim", "linear_attn_config.")
    dtype = _dtype(data)
    return {"name": str(data.get("model_type", "hf")), "linear_kind": "kda",
            **_groups(layers - len(full), len(full)),
            "kda_heads": heads, "kda_key_heads": 0, "kda_head_k_dim": head_dim,
            "kda_head_v_dim": head_dim, "kda_state_dtype": dtype,
            "conv_kernel": _int(linear, "short_conv_kernel_size", "linear_attn_config."),
            "conv_dtype": dtype, **_mla_fields(data), "mla_dtype": dtype}


def _groups(linear: int, full: int) -> dict[str, int]:
    """Equal-sized groups for both kinds: the unified page gives every group the same slots."""
    if full <= 0:
        raise HfConfigError("hf_config.num_hidden_layers", "no full-attention layer: not a hybrid "
                            "model this cache serves")
    per_group = math.gcd(linear, full)
    return {"kda_groups": linear // per_group, "mla_groups": full // per_group,
            "layers_per_group": per_group}


def _int(data: Mapping[str, Any], key: str, prefix: str = "") -> int:
    value = data.get(key)
    if value is None:
        raise HfConfigError(f"hf_config.{prefix}{key}", "missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HfConfigError(f"hf_config.{prefix}{key}",
                            f"expected a positive integer, got {value!r}")
    return value


def _head_dim(data: Mapping[str, Any]) -> int:
    """`head_dim`, or hidden size over attention heads where a config leaves it implicit."""
    if "head_dim" in data:
        return _int(data, "head_dim")
    return _int(data, "hidden_size") // _int(data, "num_attention_heads")


def _dtype(data: Mapping[str, Any], key: str = "torch_dtype", default: str | None = None) -> str:
    value = data.get(key, data.get("dtype") if key == "torch_dtype" else default)
    if value is None:
        raise HfConfigError(f"hf_config.{key}", "missing")
    if value not in HF_DTYPES:
        raise HfConfigError(f"hf_config.{key}", f"unsupported dtype {value!r}; expected one of "
                            f"{list(HF_DTYPES)}")
    return str(value)
