"""Test helpers for moving KDA states between tensor-parallel degrees: small models whose heads
split evenly (8 heads) or unevenly (96 heads over 3 and 2 ranks), page ids on both sides, rank pools
of a degree, and the un-sharded ground truth of both state parts (conv rows and recurrent
matrices) with its sharding onto the ranks.

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
