"""Decoding resumed after a checkpoint moved between TP degrees gives the cold recompute's outputs.

A prefill node of TP degree s runs a prompt through its rank pools and snapshots the KDA state at a
hash-block boundary B. The checkpoint pages and the MLA pages of [0, B) then move to a decode node
of TP degree d over the real transfer path (a `PageServer` per source rank, `pull` into every
destination rank, re-sharding the heads on the way), into pages of other ids whose stale bytes
are garbage. The decode node restores the checkpoint into fresh state pages, runs the prompt's
tail from B and then a few single-token decode steps: the outputs must equal `recompute` of the
whole sequence from B. Leaving out one head's recurrent bytes, or only its q conv rows, of one
layer must break that equality.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import numpy as np
import pytest
import torch

from cachetier.config import CacheSpec, ModelSpec
from gpu_pool import transfer
from gpu_pool.layout import PageKind, PageLayout
from gpu_pool.pool import PagedPool
from gpu_pool.streams import PageMove, Stream
from kernels import page_copy
from tinymodel import ChunkRequest, TinyHybrid, outputs_match

TOKEN = "oracle-token"
EIGHT_HEADS = ModelSpec(name="tiny-8", kda_heads=8, kda_head_k_dim=8, kda_head_v_dim=8)
NINETY_SIX_HEADS = ModelSpec(name="tiny-96", kda_heads=96, kda_head_k_dim=4, kda_head_v_dim=4)
# Gated DeltaNet + GQA: value heads in pairs over one key head, 2 KV heads (split at TP 2,
# replicated at 4 and 8) or 6 (split unevenly between 2 and 3 ranks)
GDN_SIXTEEN_HEADS = ModelSpec(name="gdn-16", linear_kind="gdn", attention_kind="gqa",
                              kda_heads=16, kda_key_heads=8, kda_head_k_dim=8, kda_head_v_dim=8,
                              mla_latent_dim=0, gqa_kv_heads=2, gqa_head_dim=8)
GDN_NINETY_SIX_HEADS = ModelSpec(name="gdn-96", linear_kind="gdn", attention_kind="gqa",
                                 kda_heads=96, kda_key_heads=48, kda_head_k_dim=4,
                                 kda_head_v_dim=4, mla_latent_dim=0, gqa_kv_heads=6,
                                 gqa_head_dim=4)
CACHE = CacheSpec(hash_block_tokens=8, page_tokens=32, page_alignment=64, num_pages=18)
PROMPT_TOKENS, DECODE_STEPS = 62, 4
TOKENS = np.random.default_rng(3).integers(0, 2**32, PROMPT_TOKENS + DECODE_STEPS, dtype=np.uint64)
PREFILL_BOUNDS = (0, 29, PROMPT_TOKENS)
HIT = 56  # the last hash-block boundary of the second chunk: 24 tokens into the second page
# page ids: the decode node's differ from the prefill node's, so a move that keeps the id is wrong
SRC_MLA, SRC_STATE, SRC_CHECKPOINT = [0, 1], [2, 3, 4], [5, 6, 7]
DST_MLA, DST_CHECKPOINT, DST_STATE = [9, 10, 11], [12, 13, 14], [15, 16, 17]

CASES = [
    pytest.param(EIGHT_HEADS, 1, 2, id="1->2"),
    pytest.param(EIGHT_HEADS, 2, 4, id="2->4"),
    pytest.param(EIGHT_HEADS, 4, 2, id="4->2"),
    pytest.param(EIGHT_HEADS, 8, 1, id="8->1"),
    pytest.param(NINETY_SIX_HEADS, 1, 3, id="96heads-1->3"),
    pytest.param(NINETY_SIX_HEADS, 3, 1, id="96heads-3->1"),
    pytest.param(GDN_SIXTEEN_HEADS, 1, 2, id="gdn-1->2"),
    pytest.param(GDN_SIXTEEN_HEADS, 2, 4, id="gdn-2->4"),
    pytest.param(GDN_SIXTEEN_HEADS, 4, 2, id="gdn-4->2"),
    pytest.param(GDN_SIXTEEN_HEADS, 8, 1, id="gdn-8->1"),
    pytest.param(GDN_NINETY_SIX_HEADS, 3, 2, id="gdn-96heads-3->2"),
]

NewPools = Callable[[ModelSpec, int], list[PagedPool]]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matmuls only lose from a thread pool (they wait on its barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def new_pools() -> Iterator[NewPools]:
    """Creates the rank pools of a model at a TP degree, each full of random stale bytes."""
    with contextlib.ExitStack() as stack:
        def create(model: ModelSpec, degree: int) -> list[PagedPool]:
            spec = dataclasses.replace(model, tp_degree=degree)
            pools = [stack.enter_context(PagedPool.create(spec, CACHE)) for _ in range(degree)]
            for rank, pool in enumerate(pools):
                gen = torch.Generator().manual_seed(100 + rank)
                pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8,
                                                generator=gen))
            return pools
        yield create


@contextlib.asynccontextmanager
async def serving(pools: Sequence[PagedPool]) -> AsyncIterator[list[str]]:
    """A page server per source rank; yields their URLs in rank order."""
    servers = [transfer.PageServer(lambda p=p: p, lambda: TOKEN) for p in pools]
    try:
        yield [await server.start() for server in servers]
    finally:
        for server in servers:
            await server.close()


def prefill(model: TinyHybrid, pools: list[PagedPool]) -> torch.Tensor:
    """The prompt on the prefill node, one chunk per step, checkpointed at `HIT` inside the
    second chunk."""
    first, middle, last = PREFILL_BOUNDS
    chunks = [ChunkRequest(TOKENS, first, middle, [SRC_MLA], SRC_STATE),
              ChunkRequest(TOKENS, middle, last, [SRC_MLA], SRC_STATE, HIT, SRC_CHECKPOINT)]
    return torch.cat([model.forward(pools, [chunk])[0] for chunk in chunks])


def moves(model: ModelSpec) -> list[PageMove]:
    """What a hand-off of the hit moves: the MLA pages of [0, HIT) (the last one a token prefix,
    sized in the source rank's token rows) and the checkpoint, one page per KDA group."""
    page_tokens = CACHE.page_tokens
    mla = []
    for slot in range(-(-HIT // page_tokens)):
        tokens = min(page_tokens, HIT - slot * page_tokens)
        nbytes = 0 if tokens == page_tokens else tokens * model.mla_token_bytes
        mla.append(PageMove(SRC_MLA[slot], DST_MLA[slot], PageKind.MLA, nbytes))
    kda = [PageMove(src, dst, PageKind.KDA) for src, dst in zip(SRC_CHECKPOINT, DST_CHECKPOINT)]
    return mla + kda


async def move_checkpoint(src: list[PagedPool], dst: list[PagedPool], model: ModelSpec) -> int:
    """Every destination rank pulls its share from every source rank at once, as agents do."""
    async with serving(src) as urls:
        received = await asyncio.gather(*(
            transfer.pull(pool, rank, src[0].layout, urls, moves(src[0].layout.model), TOKEN)
            for rank, pool in enumerate(dst)))
    return sum(received)


def decode(model: TinyHybrid, pools: list[PagedPool]) -> torch.Tensor:
    """Restore the checkpoint on every rank, run the prompt's tail, then one token per step."""
    for pool in pools:
        nbytes = pool.layout.geometry.kda_page_bytes
        page_copy(pool.buffer, pool.buffer,
                  [[src, dst, 0, nbytes] for src, dst in zip(DST_CHECKPOINT, DST_STATE)])
    bounds = [HIT, PROMPT_TOKENS, *range(PROMPT_TOKENS + 1, len(TOKENS) + 1)]
    chunks = [ChunkRequest(TOKENS, start, stop, [DST_MLA], DST_STATE)
              for start, stop in itertools.pairwise(bounds)]
    return torch.cat([model.forward(pools, [chunk])[0] for chunk in chunks])


def mla_prefix(pools: Sequence[PagedPool], rank: int, pages: Sequence[int]) -> torch.Tensor:
    """Every layer's rows of [0, HIT) in `pages` of `pools[rank]`, `[slots, HIT, units, elems]`
    for its own units (the MLA latent, or its GQA KV heads)."""
    pool = pools[rank]
    rows = torch.cat([pool.mla_view(page) for page in pages], dim=1)[:, :HIT]
    return rows.view(*rows.shape[:2], len(pool.layout.rank_attn_heads(rank)), -1)


def full_prefix(pools: Sequence[PagedPool], pages: Sequence[int]) -> torch.Tensor:
    """The un-sharded rows of [0, HIT), every unit from the first rank holding it."""
    parts: dict[int, torch.Tensor] = {}
    for rank, pool in enumerate(pools):
        for unit, rows in zip(pool.layout.rank_attn_heads(rank),
                              mla_prefix(pools, rank, pages).unbind(2)):
            parts.setdefault(unit, rows)
    return torch.stack([parts[unit] for unit in sorted(parts)], dim=2)


@pytest.mark.parametrize("model, src_degree, dst_degree", CASES)
async def test_decoding_resumed_on_another_tp_degree_matches_recompute(
        new_pools: NewPools, model: ModelSpec, src_degree: int, dst_degree: int) -> None:
    src, dst = new_pools(model, src_degree), new_pools(model, dst_degree)
    prefill_node = TinyHybrid(src[0].layout.model)
    decode_node = TinyHybrid(dst[0].layout.model)
    expected = decode_node.recompute(TOKENS)
    assert outputs_match(prefill(prefill_node, src), expected[:PROMPT_TOKENS])
    received = await move_checkpoint(src, dst, model)
    kda_bytes = model.kda_layers * model.kda_heads * model.kda_head_bytes
    conv_bytes = model.kda_layers * model.conv_channels * model.conv_row_bytes
    mla_bytes = HIT * dst[0].layout.model.mla_token_bytes * model.layers_per_group
    # both parts of each head once, each rank's attention rows (MLA: the latent) on every rank
    assert received == conv_bytes + kda_bytes + dst_degree * mla_bytes
    truth = full_prefix(src, SRC_MLA)
    for rank, pool in enumerate(dst):  # the model reads one replica: check every rank here
        units = pool.layout.rank_attn_heads(rank)
        assert torch.equal(mla_prefix(dst, rank, DST_MLA), truth[:, :, units.start:units.stop]), (
            f"rank {rank}")
    assert outputs_match(decode(decode_node, dst), expected[HIT:])


Plan = Callable[[PageLayout, PageLayout, int, Sequence[PageMove]], dict[int, list[Stream]]]


def skip_first_head(plan: Plan, part: str) -> Plan:
    """`plan_fetch`, except that destination rank 0's first KDA stream of `part` (layer slot 0 of
    the first checkpoint page) starts one head later: that head's recurrent state, or its q conv
    rows, in that layer never arrive."""
    def planned(src: PageLayout, dst: PageLayout, dst_rank: int,
                page_moves: Sequence[PageMove]) -> dict[int, list[Stream]]:
        by_rank = plan(src, dst, dst_rank, page_moves)
        if dst_rank:
            return by_rank
        cut = src.head_bytes if part == "recurrent" else src.model.kda_head_k_dim * (
            src.model.conv_row_bytes)
        for streams in by_rank.values():
            for i, s in enumerate(streams):
                in_conv = s.dst_offset < dst.recurrent_offset
                if s.dst_page in DST_CHECKPOINT and in_conv == (part == "conv"):
                    streams[i] = dataclasses.replace(s, src_offset=s.src_offset + cut,
                                                     nbytes=s.nbytes - cut,
                                                     dst_offset=s.dst_offset + cut)
                    return by_rank
        raise AssertionError(f"the plan has no {part} stream to cut")
    return planned


@pytest.mark.parametrize("part", ["recurrent", "conv"])
@pytest.mark.parametrize("model, src_degree, dst_degree",
                         [CASES[1], CASES[3], CASES[4], CASES[7], CASES[9]])
async def test_a_head_stream_left_out_breaks_the_match(
        new_pools: NewPools, monkeypatch: pytest.MonkeyPatch, model: ModelSpec,
        src_degree: int, dst_degree: int, part: str) -> None:
    src, dst = new_pools(model, src_degree), new_pools(model, dst_degree)
    prefill(TinyHybrid(src[0].layout.model), src)
    monkeypatch.setattr(transfer, "plan_fetch", skip_first_head(transfer.plan_fetch, part))
    await move_checkpoint(src, dst, model)
    decode_node = TinyHybrid(dst[0].layout.model)
    assert not outputs_match(decode(decode_node, dst), decode_node.recompute(TOKENS)[HIT:])
