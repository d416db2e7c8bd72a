"""Re-sharding KDA states between TP degrees on the transfer path recovers the exact states.

Source ranks of degree s each hold their heads of every state; for every (source rank, destination
rank) pair that shares heads, one `head_reshard` launch moves those heads for all pages, either
straight into the destination pool or through a packed staging buffer (the network hop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from cachetier.config import CacheSpec, ModelSpec
from gpu_pool import PageKind, PagedPool
from kernels import head_reshard
from tests.test_kernels import Target, target  # noqa: F401  (shared backend fixture)

CACHE = CacheSpec(hash_block_tokens=4, page_tokens=8, page_alignment=64, num_pages=6)
EIGHT_HEADS = ModelSpec(kda_heads=8, kda_head_k_dim=4, kda_head_v_dim=8, mla_latent_dim=8)
NINETY_SIX_HEADS = ModelSpec(kda_heads=96, kda_head_k_dim=2, kda_head_v_dim=4, mla_latent_dim=8)
SRC_PAGES = [5, 0, 3]  # where the states live on the source ranks
DST_PAGES = [1, 4, 2]  # where they must land on the destination ranks

RESHARDS = [
    pytest.param(EIGHT_HEADS, 1, 2, id="1->2"),
    pytest.param(EIGHT_HEADS, 2, 4, id="2->4"),
    pytest.param(EIGHT_HEADS, 4, 2, id="4->2"),
    pytest.param(EIGHT_HEADS, 8, 1, id="8->1"),
    pytest.param(NINETY_SIX_HEADS, 3, 2, id="96heads-3->2"),
    pytest.param(NINETY_SIX_HEADS, 2, 3, id="96heads-2->3"),
]
DTYPES = [pytest.param("float32", id="fp32"), pytest.param("bfloat16", id="bf16")]


def rank_pools(model: ModelSpec, degree: int, device: str) -> list[PagedPool]:
    spec = dataclasses.replace(model, tp_degree=degree)
    return [PagedPool.create(spec, CACHE, device=device, debug=True) for _ in range(degree)]


def full_states(model: ModelSpec) -> torch.Tensor:
    """Un-sharded states `[pages, layer_slots, heads, K, V]`: the ground truth."""
    g = torch.Generator().manual_seed(0)
    shape = (len(SRC_PAGES), model.layers_per_group, model.kda_heads, model.kda_head_k_dim,
             model.kda_head_v_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, model.kda_state_dtype))


def shard(states: torch.Tensor, pools: list[PagedPool], pages: list[int]) -> None:
    for rank, pool in enumerate(pools):
        heads = pool.layout.rank_heads(rank)
        for i, page in enumerate(pages):
            pool.tag(page, PageKind.KDA)
            pool.kda_view(page).copy_(states[i, :, heads.start:heads.stop])


def transfer(src_pools: list[PagedPool], dst_pools: list[PagedPool], staged: bool, backend: str) -> int:
    """Every overlapping (src rank, dst rank) pair in one launch (two when staged); returns launches."""
    launches = 0
    for rs, src in enumerate(src_pools):
        src_heads = src.layout.rank_heads(rs)
        for rd, dst in enumerate(dst_pools):
            dst_heads = dst.layout.rank_heads(rd)
            shared = range(max(src_heads.start, dst_heads.start), min(src_heads.stop, dst_heads.stop))
            if not shared:
                continue
            launches += move(src, dst, src_heads, dst_heads, shared, staged, backend)
    return launches


def move(src: PagedPool, dst: PagedPool, src_heads: range, dst_heads: range, shared: range,
         staged: bool, backend: str) -> int:
    hb = src.layout.head_bytes
    pairs = list(zip(SRC_PAGES, DST_PAGES))
    if not staged:
        assert head_reshard(src.buffer, dst.buffer, pairs, head_bytes=hb, src_heads=src_heads,
                            dst_heads=dst_heads) == backend
        return 1
    wire = torch.empty(src.layout.layer_slots, len(pairs), len(shared) * hb, dtype=torch.uint8,
                       device=src.device)
    slots = list(range(len(pairs)))
    assert head_reshard(src.buffer, wire, list(zip(SRC_PAGES, slots)), head_bytes=hb,
                        src_heads=src_heads, dst_heads=shared) == backend
    assert head_reshard(wire, dst.buffer, list(zip(slots, DST_PAGES)), head_bytes=hb,
                        src_heads=shared, dst_heads=dst_heads) == backend
    return 2


@pytest.fixture
def pools() -> Iterator[list[PagedPool]]:
    created: list[PagedPool] = []
    yield created
    for p in created:
        p.close()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model, src_degree, dst_degree", RESHARDS)
def test_reshard_recovers_exact_states(target: Target, pools: list[PagedPool], model: ModelSpec,
                                       src_degree: int, dst_degree: int, dtype: str,
                                       staged: bool) -> None:
    model = dataclasses.replace(model, kda_state_dtype=dtype)
    states = full_states(model)
    src_pools = rank_pools(model, src_degree, target.device)
    dst_pools = rank_pools(model, dst_degree, target.device)
    pools.extend(src_pools + dst_pools)
    shard(states, src_pools, SRC_PAGES)
    for pool in dst_pools:
        for page in DST_PAGES:
            pool.tag(page, PageKind.KDA)
    launches = transfer(src_pools, dst_pools, staged, target.backend)
    assert launches == (2 if staged else 1) * overlapping_pairs(model.kda_heads, src_degree, dst_degree)
    for rank, pool in enumerate(dst_pools):
        heads = pool.layout.rank_heads(rank)
        for i, page in enumerate(DST_PAGES):
            assert torch.equal(pool.kda_view(page).cpu(), states[i, :, heads.start:heads.stop])


def overlapping_pairs(heads: int, s: int, d: int) -> int:
    """Rank pairs whose head ranges intersect: what one launch per pair should add up to."""
    src = [range(r * heads // s, (r + 1) * heads // s) for r in range(s)]
    dst = [range(r * heads // d, (r + 1) * heads // d) for r in range(d)]
    return sum(1 for a in src for b in dst if max(a.start, b.start) < min(a.stop, b.stop))
