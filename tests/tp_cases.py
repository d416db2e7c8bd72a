"""Test helpers for moving KDA states between tensor-parallel degrees: small models whose heads
split evenly (8 heads) or unevenly (96 heads over 3 and 2 ranks), page ids on both sides, rank pools
of a degree, and the un-sharded ground truth with its sharding onto the source ranks.

Page ids are scattered and different on both sides, so a transfer that writes a state at its
source page id, or in the wrong order, fails the comparison with the ground truth.
"""

from __future__ import annotations

import dataclasses

import torch

from cachetier.config import CacheSpec, ModelSpec
from gpu_pool import PageKind, PagedPool

CACHE = CacheSpec(hash_block_tokens=4, page_tokens=8, page_alignment=64, num_pages=6)
EIGHT_HEADS = ModelSpec(kda_heads=8, kda_head_k_dim=4, kda_head_v_dim=8, mla_latent_dim=8)
NINETY_SIX_HEADS = ModelSpec(kda_heads=96, kda_head_k_dim=2, kda_head_v_dim=4, mla_latent_dim=8)
SRC_PAGES = [5, 0, 3]  # where the states live on the source ranks
DST_PAGES = [1, 4, 2]  # where they must land on the destination ranks


def rank_pools(model: ModelSpec, degree: int, device: str) -> list[PagedPool]:
    """One pool per rank of `model` at TP `degree`; the caller closes them."""
    spec = dataclasses.replace(model, tp_degree=degree)
    return [PagedPool.create(spec, CACHE, device=device, debug=True) for _ in range(degree)]


def full_states(model: ModelSpec) -> torch.Tensor:
    """Un-sharded states `[pages, layer_slots, heads, K, V]`: the ground truth."""
    g = torch.Generator().manual_seed(0)
    shape = (len(SRC_PAGES), model.layers_per_group, model.kda_heads, model.kda_head_k_dim,
             model.kda_head_v_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, model.kda_state_dtype))


def shard(states: torch.Tensor, pools: list[PagedPool], pages: list[int]) -> None:
    """Write each rank's heads of `states` into its pool's `pages`, through the typed views."""
    for rank, pool in enumerate(pools):
        heads = pool.layout.rank_heads(rank)
        for i, page in enumerate(pages):
            pool.tag(page, PageKind.KDA)
            pool.kda_view(page).copy_(states[i, :, heads.start:heads.stop])
