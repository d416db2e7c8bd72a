"""Tiny models with random weights, in folders vLLM loads offline: a Qwen3-Next (Gated DeltaNet
+ GQA), and two full-attention ones (`write_tiny_full_attention`: a Qwen3 with GQA, a DeepSeek-V3
with MLA).

The oracle of the connector's tests and of `bench vllm` needs a real hybrid model that vLLM serves
on this machine's CPU without the hub: 3 GDN layers and 1 full-attention layer, hidden 128, GDN
heads of 128 (the CPU kernel supports no smaller one), 2 KV heads of 32. The default init gives
near-constant outputs, which would make the output comparison blind, so every weight is redrawn
from `N(0, std)` with a fixed seed: the same seed writes the same model, greedy outputs differ from
token to token. The GDN decay is then set for a long memory (`A_log` = -4, `dt_bias` = -2: a
state keeps ~99.8 % per token), or the recurrent state a hit restores would hardly matter to the
outputs (with random decay parameters it halves every token) and the oracle could not see it.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_ARCH = {
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "intermediate_size": 256, "max_position_embeddings": 65536, "tie_word_embeddings": False,
}


LONG_MEMORY_A_LOG = -4.0
LONG_MEMORY_DT_BIAS = -2.0


def write_tiny_qwen3_next(path: str | Path, *, seed: int = 0, std: float = 0.07,
                          hybrid_blocks: int = 1) -> Path:
    """Write the model to `path` (config.json + safetensors), unless the same one is there.
    `hybrid_blocks` stacks that many (3 GDN + 1 attention) blocks: with 2 or more, vLLM lays each
    group's layers out in several layer slots of one tensor, the layout its copy-on-write of a
    mid-block hit gets wrong (`cachetier.vllm.cow`); one block never shows it."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    stamp = path / "cachetier-tiny.json"
    arch = _stacked(TINY_ARCH, hybrid_blocks)
    wanted = {"seed": seed, "std": std, "a_log": LONG_MEMORY_A_LOG,
              "dt_bias": LONG_MEMORY_DT_BIAS, **arch}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path
    generator = torch.Generator().manual_seed(seed)
    config = Qwen3NextConfig(**arch, torch_dtype="bfloat16")
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
            if name.endswith("linear_attn.A_log"):
                parameter.add_(LONG_MEMORY_A_LOG)
            elif name.endswith("linear_attn.dt_bias"):
                parameter.add_(LONG_MEMORY_DT_BIAS)
    model.to(torch.bfloat16).save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    return path


def _stacked(arch: dict[str, object], blocks: int) -> dict[str, object]:
    """`arch` with its layers repeated `blocks` times."""
    if blocks < 1:
        raise ValueError(f"hybrid_blocks: at least 1, got {blocks}")
    layer_types = list(arch["layer_types"]) * blocks  # type: ignore[call-overload]
    return {**arch, "num_hidden_layers": len(layer_types), "layer_types": layer_types}


# Full-attention models: 2 layers, hidden 128. The GQA one has the hybrid's attention (2 KV heads
# of 32); the MLA one a latent of 512 + 64 (the only size vLLM's CPU MLA kernels take), dense
# MLPs (no expert routing to tie the outputs of near-equal experts).
TINY_FULL_ATTENTION_ARCH: dict[str, dict[str, object]] = {
    "gqa": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "max_position_embeddings": 65536, "tie_word_embeddings": False},
    "mla": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "moe_intermediate_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
            "v_head_dim": 32, "max_position_embeddings": 65536, "tie_word_embeddings": False},
}


def write_tiny_full_attention(path: str | Path, attention: str, *, seed: int = 0,
                              std: float = 0.07) -> Path:
    """Write the `attention` ("gqa" or "mla") full-attention model to `path`, unless the same
    seed is there. Weights are redrawn as the hybrid's; the norms keep their unit scale, so that
    the outputs are far from uniform and a wrong KV row moves them visibly."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"gqa": (Qwen3Config, Qwen3ForCausalLM),
                                 "mla": (DeepseekV3Config, DeepseekV3ForCausalLM)}[attention]
    arch = TINY_FULL_ATTENTION_ARCH[attention]
    path = Path(path)
    stamp = path / "cachetier-tiny.json"
    wanted = {"seed": seed, "std": std, "attention": attention, **arch}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path
    generator = torch.Generator().manual_seed(seed)
    model = model_class(config_class(**arch, torch_dtype="bfloat16"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * std
            parameter.copy_(noise + 1 if name.endswith("norm.weight") else noise)
    model.to(torch.bfloat16).save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    return path
