"""Test helpers for moving linear-attention states and full-attention rows between tensor-parallel
degrees: small models of both families (KDA + MLA, GDN + GQA) whose heads split evenly (8 or 16
heads) or unevenly (96 heads over 3 and 2 ranks), page ids on both sides, rank pools of a degree,
and the un-sharded ground truth of both state parts (conv rows and recurrent matrices) and of the
attention rows, with its sharding onto the ranks.

Page ids are scattered and different on both sides, so a transfer that writes a state at its
source page id, or in the wrong order, fails the comparison with the ground truth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cachetier.config import CacheSpec, ModelSpec
from gpu_pool import PageKind, PagedPool

CACHE = CacheSpec(hash_block_tokens=4, page_tokens=8, page_alignment=64, num_pages=6)
EIGHT_HEADS = ModelSpec(kda_heads=8, kda_head_k_dim=4, kda_head_v_dim=8, mla_latent_dim=8)
NINETY_SIX_HEADS = ModelSpec(kda_heads=96, kda_head_k_dim=2, kda_head_v_dim=4, mla_latent_dim=8)
# the Gated DeltaNet + GQA family: twice as many value heads as key heads (as Qwen3-Next), KV heads
# split over 2 ranks and replicated over more (2 heads), or split 6 ways over 2 and 3 ranks
GDN_SIXTEEN_HEADS = ModelSpec(name="gdn-16", linear_kind="gdn", attention_kind="gqa",
                              kda_heads=16, kda_key_heads=8, kda_head_k_dim=4, kda_head_v_dim=8,
                              mla_latent_dim=0, gqa_kv_heads=2, gqa_head_dim=4)
GDN_NINETY_SIX_HEADS = ModelSpec(name="gdn-96", linear_kind="gdn", attention_kind="gqa",
                                 kda_heads=96, kda_key_heads=48, kda_head_k_dim=2,
                                 kda_head_v_dim=4, mla_latent_dim=0, gqa_kv_heads=6,
                                 gqa_head_dim=2)
SRC_PAGES = [5, 0, 3]  # where the states live on the source ranks
DST_PAGES = [1, 4, 2]  # where they must land on the destination ranks


def rank_pools(model: ModelSpec, degree: int, device: str) -> list[PagedPool]:
    """One pool per rank of `model` at TP `degree`; the caller closes them."""
    spec = dataclasses.replace(model, tp_degree=degree)
    return [PagedPool.create(spec, CACHE, device=device, debug=True) for _ in range(degree)]


@dataclass(frozen=True)
class States:
    """Un-sharded states of `SRC_PAGES`: `conv [pages, layer_slots, C, kernel - 1]` (global
    channels: all heads' q, then k, then v) and `recurrent [pages, layer_slots, heads, K, V]`."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def full_states(model: ModelSpec) -> States:
    """The ground truth, random in every byte of both parts."""
    g = torch.Generator().manual_seed(0)
    lead = (len(SRC_PAGES), model.layers_per_group)
    conv = torch.randn(*lead, model.conv_channels, model.conv_kernel - 1, generator=g)
    recurrent = torch.randn(*lead, model.kda_heads, model.kda_head_k_dim, model.kda_head_v_dim,
                            generator=g)
    return States(conv.to(getattr(torch, model.conv_dtype)),
                  recurrent.to(getattr(torch, model.kda_state_dtype)))


def write_rank(pool: PagedPool, rank: int, states: States, i: int, page: int) -> None:
    """Write `rank`'s share of state `i` (its heads' conv rows and recurrent matrices) into
    `page`, through the typed views."""
    heads = pool.layout.rank_heads(rank)
    conv = pool.conv_view(page)
    for ours, theirs in pool.layout.conv_rows(heads, rank):
        conv[:, theirs.start:theirs.stop] = states.conv[i, :, ours.start:ours.stop]
    pool.kda_view(page).copy_(states.recurrent[i, :, heads.start:heads.stop])


def shard(states: States, pools: list[PagedPool], pages: list[int]) -> None:
    """Write each rank's share of `states` into its pool's `pages`."""
    for rank, pool in enumerate(pools):
        for i, page in enumerate(pages):
            pool.tag(page, PageKind.KDA)
            write_rank(pool, rank, states, i, page)


def attention_rows(model: ModelSpec, pages: int, tokens: int) -> torch.Tensor:
    """Un-sharded full-attention rows `[pages, layer_slots, tokens, units, elems]`: the MLA latent
    (one unit) or K then V of every GQA KV head; random."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(pages, model.layers_per_group, tokens, model.attn_heads,
                       model.attn_head_elems, generator=g).to(getattr(torch, model.mla_dtype))


def rank_rows(pool: PagedPool, rank: int, rows: torch.Tensor) -> torch.Tensor:
    """`rank`'s share of `rows [..., units, elems]`, flattened as its page rows."""
    units = pool.layout.rank_attn_heads(rank)
    return rows[..., units.start:units.stop, :].flatten(-2)
