"""The model's sizes and its random weights, both derived from a `ModelSpec` and a seed.

The cache-facing sizes (linear-attention heads and state dims, the MLA row width or the GQA KV
heads, layer counts) come from the spec so the model's state is exactly what the pool stores;
the rest (embedding, attention heads, output) is free and kept tiny. Weights come from a seeded
`torch.Generator`, so every process that builds the model with the same seed computes the same
function: the oracle of one process checks the pages written by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cachetier.config import ModelSpec


class UnsupportedModel(ValueError):
    """The tiny model cannot stand in for this `ModelSpec` (its caches would not be exact)."""


@dataclass(frozen=True)
class Dims:
    """Every size of the model, either family. `mla_latent` (the no-rope part of a cached MLA row)
    is derived."""

    kda_groups: int
    mla_groups: int
    blocks: int
    kda_heads: int
    kda_k: int
    kda_v: int
    mla_row: int
    conv_kernel: int
    linear_kind: str  # "kda" or "gdn"
    key_heads: int
    attention_kind: str  # "mla" or "gqa"
    kv_heads: int
    kv_head_dim: int
    rope_dim: int = 4
    d_model: int = 32
    vocab: int = 32_000
    out_dim: int = 16
    mla_heads: int = 2
    mla_head_dim: int = 8
    mla_value_dim: int = 8
    gqa_query_heads_per_kv: int = 2

    @classmethod
    def from_spec(cls, spec: ModelSpec, **free: int) -> Dims:
        """Refuse specs whose cache the model could not reproduce bit for bit: the oracle compares
        fp32 outputs at 1e-5, so it needs fp32 caches. `spec.tp_degree` is not read: the model
        computes every head whatever the degree (its pools split the heads, not the model), so a
        spec at any degree gives the same sizes and, with the same seed, the same weights."""
        for key in ("kda_state_dtype", "conv_dtype", "mla_dtype"):
            if getattr(spec, key) != "float32":
                raise UnsupportedModel(f"model {spec.name!r}: {key}={getattr(spec, key)!r}; the "
                                       "tiny model stores fp32 caches only")
        dims = cls(kda_groups=spec.kda_groups, mla_groups=spec.mla_groups,
                   blocks=spec.layers_per_group, kda_heads=spec.kda_heads,
                   kda_k=spec.kda_head_k_dim, kda_v=spec.kda_head_v_dim,
                   mla_row=spec.mla_latent_dim, conv_kernel=spec.conv_kernel,
                   linear_kind=spec.linear_kind, key_heads=spec.key_heads,
                   attention_kind=spec.attention_kind, kv_heads=spec.gqa_kv_heads,
                   kv_head_dim=spec.gqa_head_dim, **free)
        if dims.rope_dim <= 0 or dims.rope_dim % 2:
            raise UnsupportedModel(f"rope_dim={dims.rope_dim} must be a positive even number")
        if dims.attention_kind == "gqa":
            if dims.kv_head_dim % 2:
                raise UnsupportedModel(f"model {spec.name!r}: gqa_head_dim={spec.gqa_head_dim} "
                                       "must be even (rotary pairs)")
        elif dims.mla_latent <= 0:
            raise UnsupportedModel(f"model {spec.name!r}: mla_latent_dim={spec.mla_latent_dim} "
                                   f"leaves no latent beside rope_dim={dims.rope_dim}")
        return dims

    @property
    def mla_latent(self) -> int:
        return self.mla_row - self.rope_dim

    @property
    def conv_channels(self) -> int:
        """The short convolution's channels: q and k (key heads x K each), then v (H*V)."""
        return 2 * self.key_heads * self.kda_k + self.kda_heads * self.kda_v

    @property
    def gate_width(self) -> int:
        """Decay-gate columns: one per key channel of each head (KDA) or one per head (GDN)."""
        return self.kda_heads * (self.kda_k if self.linear_kind == "kda" else 1)

    @property
    def gqa_query_heads(self) -> int:
        return self.kv_heads * self.gqa_query_heads_per_kv

    @property
    def attn_units(self) -> int:
        """What a cached token row splits into: KV heads (GQA) or the one latent (MLA)."""
        return self.kv_heads if self.attention_kind == "gqa" else 1

    @property
    def attn_unit_elems(self) -> int:
        return 2 * self.kv_head_dim if self.attention_kind == "gqa" else self.mla_row


@dataclass(frozen=True)
class KdaWeights:
    """One linear-attention layer, KDA or GDN. `w_in` packs the q, k, v, decay-gate and
    write-strength projections, so a token costs one matmul (columns in that order: Hk*K, Hk*K,
    H*V, `gate_width`, H; Hk key heads); `conv` is the depthwise causal convolution over the q,
    k, v columns (the conv channels), oldest input first."""

    norm: torch.Tensor  # [d]
    w_in: torch.Tensor  # [d, C + gate_width + H]
    conv: torch.Tensor  # [C, kernel]
    a_bias: torch.Tensor  # [H, K or 1]: keeps the decay near 1 so old state stays visible
    wo: torch.Tensor  # [H*V, d]


@dataclass(frozen=True)
class GqaWeights:
    """One grouped-query attention layer: `Hq = kv_heads * gqa_query_heads_per_kv` query heads,
    each group reading one KV head; `w_kv` projects K then V of every KV head
    (`[kv_heads, 2, head_dim]` per token, the cached row)."""

    norm: torch.Tensor  # [d]
    wq: torch.Tensor  # [d, Hq*D]
    w_kv: torch.Tensor  # [d, Hkv*2*D]
    wo: torch.Tensor  # [Hq*D, d]


@dataclass(frozen=True)
class MlaWeights:
    norm: torch.Tensor  # [d]
    w_dkv: torch.Tensor  # [d, C]: down-projection to the cached latent
    w_kr: torch.Tensor  # [d, R]: the decoupled rotary key, cached beside the latent
    wq: torch.Tensor  # [d, Hm*Dn]
    wqr: torch.Tensor  # [d, Hm*R]
    w_uk: torch.Tensor  # [Hm, C, Dn]: key up-projection (absorbed into the query)
    w_uv: torch.Tensor  # [Hm, Dv, C]: value up-projection
    wo: torch.Tensor  # [Hm*Dv, d]

    # derived once per layer, when the weights are built: the up-projections absorbed, as MLA
    # inference does, so attention reads nothing but the cached rows and a span costs one matmul
    # per projection
    w_row: torch.Tensor = field(init=False, repr=False, compare=False)  # [d, C+R]
    w_query: torch.Tensor = field(init=False, repr=False, compare=False)  # [d, Hm*(C+R)]
    w_out: torch.Tensor = field(init=False, repr=False, compare=False)  # [Hm*C, d]

    def __post_init__(self) -> None:
        """`w_row`: what a token caches, `[latent | key before rotation]`. `w_query`: per head
        `[wq_h w_uk_h^T | wqr_h]` (the key up-projection absorbed into the query; the rotary part
        rotates after), pre-scaled by 1/sqrt(Dn + R). `w_out`: per head `w_uv_h^T wo_h`, from the
        attended latent to the residual."""
        heads, _, head_dim = self.w_uk.shape
        d, rope_dim, value_dim = self.wq.shape[0], self.wqr.shape[1] // heads, self.w_uv.shape[1]
        absorbed = torch.einsum("jhn,hcn->jhc", self.wq.view(d, heads, head_dim), self.w_uk)
        query = torch.cat((absorbed, self.wqr.view(d, heads, rope_dim)), dim=2)
        wo = self.wo.view(heads, value_dim, -1)
        object.__setattr__(self, "w_row", torch.cat((self.w_dkv, self.w_kr), dim=1))
        object.__setattr__(self, "w_query",
                           (query * (head_dim + rope_dim) ** -0.5).reshape(d, -1))
        object.__setattr__(self, "w_out", (self.w_uv.transpose(1, 2) @ wo).reshape(-1, d))


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [vocab, d]
    kda: list[list[KdaWeights]]  # [group][slot]
    mla: list[list[MlaWeights | GqaWeights]]  # [group][slot]
    final_norm: torch.Tensor  # [d]
    out: torch.Tensor  # [d, out_dim]


def init_weights(dims: Dims, seed: int) -> Weights:
    gen = torch.Generator().manual_seed(seed)

    def dense(*shape: int, fan_in: int | None = None) -> torch.Tensor:
        """Unit-variance outputs; `fan_in` defaults to the first dim (`x @ W` matrices)."""
        return torch.randn(shape, generator=gen) * (fan_in or shape[0]) ** -0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dims.d_model, generator=gen)

    d, hv = dims.d_model, dims.kda_heads * dims.kda_v

    def kda() -> KdaWeights:
        a_bias = 2.0 + 2.0 * torch.rand((dims.kda_heads, dims.gate_width // dims.kda_heads, 1),
                                        generator=gen)
        conv = dense(dims.conv_channels, dims.conv_kernel, fan_in=dims.conv_kernel)
        return KdaWeights(norm(), dense(d, dims.conv_channels + dims.gate_width + dims.kda_heads),
                          conv, a_bias, dense(hv, d))

    def gqa() -> GqaWeights:
        hq, hkv, dh = dims.gqa_query_heads, dims.kv_heads, dims.kv_head_dim
        return GqaWeights(norm(), dense(d, hq * dh), dense(d, hkv * 2 * dh), dense(hq * dh, d))

    def mla() -> MlaWeights:
        c, hm, r, dn, dv = (dims.mla_latent, dims.mla_heads, dims.rope_dim, dims.mla_head_dim,
                            dims.mla_value_dim)
        return MlaWeights(norm(), dense(d, c), dense(d, r), dense(d, hm * dn), dense(d, hm * r),
                          dense(hm, c, dn, fan_in=dn), dense(hm, dv, c, fan_in=c),
                          dense(hm * dv, d))

    embed = torch.randn((dims.vocab, d), generator=gen)
    kda_w = [[kda() for _ in range(dims.blocks)] for _ in range(dims.kda_groups)]
    attention = gqa if dims.attention_kind == "gqa" else mla
    mla_w = [[attention() for _ in range(dims.blocks)] for _ in range(dims.mla_groups)]
    return Weights(embed, kda_w, mla_w, norm(), dense(d, dims.out_dim))
