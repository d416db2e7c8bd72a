"""Pages pulled over TCP from the ranks of a source pool into the ranks of a destination pool of
another TP degree land exactly where the destination layout puts them, and nowhere else.

Every check compares the whole destination buffer with a reference built through the pool's typed
views from the un-sharded ground truth (untouched pages and padding must keep their garbage).
Failures use a scripted source (`SocketServer` with a handler the test writes) or a real page
server in a child process killed mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from cachetier.config import CacheSpec, ModelSpec
from cachetier.errors import ErrorCode, RemoteError, TransferFailed
from cachetier.wire.framing import encode_frame
from cachetier.wire.protocol import ok_frame
from cachetier.wire.sockio import SocketServer, read_frame, send_buffers
from gpu_pool import PageKind, PageLayout, PagedPool
from gpu_pool.streams import PageMove, Stream, plan_fetch
from gpu_pool.transfer import (STREAM_HEADER, BadStreamHeader, PageServer, StreamsAccepted, fetch,
                               pull)
from tests.tp_cases import (CACHE, DST_PAGES, EIGHT_HEADS, GDN_NINETY_SIX_HEADS, GDN_SIXTEEN_HEADS,
                            NINETY_SIX_HEADS, SRC_PAGES, States, attention_rows, full_states,
                            rank_pools, rank_rows, shard, write_rank)

TOKEN = "peer-token"
MLA_SRC = [1, 2, 4]
MLA_DST = [0, 3, 5]
MLA_TOKENS = [8, 3, 8]  # the middle page is a partly filled one: only its token prefix moves
PAGE_BYTES = PageLayout.from_specs(EIGHT_HEADS, CACHE).page_bytes

RESHARDS = [
    pytest.param(EIGHT_HEADS, 1, 1, id="1->1"),
    pytest.param(EIGHT_HEADS, 1, 2, id="1->2"),
    pytest.param(EIGHT_HEADS, 2, 4, id="2->4"),
    pytest.param(EIGHT_HEADS, 4, 2, id="4->2"),
    pytest.param(EIGHT_HEADS, 8, 1, id="8->1"),
    pytest.param(NINETY_SIX_HEADS, 1, 3, id="96heads-1->3"),
    pytest.param(NINETY_SIX_HEADS, 3, 2, id="96heads-3->2"),
    pytest.param(NINETY_SIX_HEADS, 2, 3, id="96heads-2->3"),
    pytest.param(dataclasses.replace(EIGHT_HEADS, kda_state_dtype="bfloat16",
                                     conv_dtype="bfloat16"), 2, 4, id="bf16-2->4"),
    pytest.param(dataclasses.replace(NINETY_SIX_HEADS, kda_state_dtype="bfloat16",
                                     conv_dtype="bfloat16"), 3, 2, id="96heads-bf16-3->2"),
    pytest.param(dataclasses.replace(EIGHT_HEADS, conv_dtype="bfloat16"), 4, 2,
                 id="bf16-conv-fp32-state-4->2"),
    pytest.param(dataclasses.replace(EIGHT_HEADS, conv_kernel=1), 2, 4, id="no-conv-2->4"),
    pytest.param(GDN_SIXTEEN_HEADS, 1, 1, id="gdn-1->1"),
    pytest.param(GDN_SIXTEEN_HEADS, 1, 2, id="gdn-1->2"),
    pytest.param(GDN_SIXTEEN_HEADS, 2, 4, id="gdn-2->4"),
    pytest.param(GDN_SIXTEEN_HEADS, 4, 2, id="gdn-4->2"),
    pytest.param(GDN_SIXTEEN_HEADS, 8, 1, id="gdn-8->1"),
    pytest.param(GDN_NINETY_SIX_HEADS, 3, 2, id="gdn-96heads-3->2"),
    pytest.param(GDN_NINETY_SIX_HEADS, 2, 3, id="gdn-96heads-2->3"),
    pytest.param(dataclasses.replace(GDN_SIXTEEN_HEADS, kda_state_dtype="bfloat16",
                                     conv_dtype="bfloat16", mla_dtype="bfloat16"), 2, 4,
                 id="gdn-bf16-2->4"),
]


@pytest.fixture
def pools() -> Iterator[list[PagedPool]]:
    created: list[PagedPool] = []
    yield created
    for p in created:
        p.close()


@contextlib.asynccontextmanager
async def serving(pools: list[PagedPool]) -> AsyncIterator[list[str]]:
    servers = [PageServer(lambda p=p: p, lambda: TOKEN) for p in pools]
    try:
        yield [await s.start() for s in servers]
    finally:
        for s in servers:
            await s.close()


def mla_latents(model: ModelSpec) -> torch.Tensor:
    return attention_rows(model, len(MLA_SRC), CACHE.page_tokens)


def moves(model: ModelSpec) -> list[PageMove]:
    """The moves, sized in `model`'s token rows: the source's (a GQA rank's row depends on TP)."""
    kda = [PageMove(s, d, PageKind.KDA) for s, d in zip(SRC_PAGES, DST_PAGES)]
    mla = [PageMove(s, d, PageKind.MLA, n * model.mla_token_bytes if n < CACHE.page_tokens else 0)
           for s, d, n in zip(MLA_SRC, MLA_DST, MLA_TOKENS)]
    return kda + mla


def garbage(pool: PagedPool, seed: int) -> torch.Tensor:
    data = torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    pool.buffer.copy_(data)
    return data


def expected_buffer(model: ModelSpec, rank: int, before: torch.Tensor, states: States,
                    latents: torch.Tensor) -> torch.Tensor:
    """The destination rank's buffer as it must be: its garbage, with the moved pages written
    through a reference pool's typed views from the ground truth."""
    with PagedPool.create(model, CACHE) as ref:
        ref.buffer.copy_(before)
        for i, page in enumerate(DST_PAGES):
            write_rank(ref, rank, states, i, page)
        for i, (page, tokens) in enumerate(zip(MLA_DST, MLA_TOKENS)):
            ref.mla_view(page)[:, :tokens] = rank_rows(ref, rank, latents[i, :, :tokens])
        return ref.buffer.clone()


def fill_sources(src_pools: list[PagedPool], states: States, latents: torch.Tensor) -> None:
    shard(states, src_pools, SRC_PAGES)
    for rank, pool in enumerate(src_pools):  # a latent is replicated, KV heads split
        for i, page in enumerate(MLA_SRC):
            pool.tag(page, PageKind.MLA)
            pool.mla_view(page).copy_(rank_rows(pool, rank, latents[i]))


@pytest.mark.parametrize("model, src_degree, dst_degree", RESHARDS)
async def test_every_destination_byte_is_the_reference(pools, model, src_degree, dst_degree):
    states, latents = full_states(model), mla_latents(model)
    src_pools = rank_pools(model, src_degree, "cpu")
    dst_pools = rank_pools(model, dst_degree, "cpu")
    pools.extend(src_pools + dst_pools)
    fill_sources(src_pools, states, latents)
    before = [garbage(p, seed=10 + r) for r, p in enumerate(dst_pools)]
    dst_model = dst_pools[0].layout.model
    async with serving(src_pools) as urls:
        received = await asyncio.gather(*(
            pull(p, r, src_pools[0].layout, urls, moves(src_pools[0].layout.model), TOKEN)
            for r, p in enumerate(dst_pools)))
    for rank, pool in enumerate(dst_pools):
        expected = expected_buffer(dst_model, rank, before[rank], states, latents)
        assert torch.equal(pool.buffer, expected), f"destination rank {rank}"
    state_bytes = (model.kda_heads * model.kda_head_bytes
                   + model.conv_channels * model.conv_row_bytes)
    kda_bytes = len(SRC_PAGES) * model.layers_per_group * state_bytes
    mla_bytes = sum(MLA_TOKENS) * dst_model.mla_token_bytes * model.layers_per_group
    assert sum(received) == kda_bytes + dst_degree * mla_bytes   # each head once, rows per rank


def test_the_plan_pulls_each_shared_head_run_once_per_slot():
    """Per (slot, source rank): the run's q, k and v conv rows, then its recurrent bytes."""
    src = layout_of(NINETY_SIX_HEADS, 3)  # 32 heads a rank, 2 + 2 + 4 conv channels a head
    dst = layout_of(NINETY_SIX_HEADS, 2)  # 48 heads a rank
    plan = plan_fetch(src, dst, 1, [PageMove(5, 1, PageKind.KDA)])    # heads 48..95
    hb, row = NINETY_SIX_HEADS.kda_head_bytes, NINETY_SIX_HEADS.conv_row_bytes
    src_conv, dst_conv = 32 * 8 * row, 48 * 8 * row
    slots = NINETY_SIX_HEADS.layers_per_group

    def runs(s: int, src_head: int, dst_head: int, heads: int) -> list[Stream]:
        """q at 0, k after the rank's q channels, v after its k channels, on each side."""
        return [Stream(5, s, src_head * 2 * row, heads * 2 * row, 1, dst_head * 2 * row),
                Stream(5, s, (64 + src_head * 2) * row, heads * 2 * row, 1,
                       (96 + dst_head * 2) * row),
                Stream(5, s, (128 + src_head * 4) * row, heads * 4 * row, 1,
                       (192 + dst_head * 4) * row),
                Stream(5, s, src_conv + src_head * hb, heads * hb, 1, dst_conv + dst_head * hb)]
    assert plan == {1: [x for s in range(slots) for x in runs(s, 16, 0, 16)],    # heads 48..63
                    2: [x for s in range(slots) for x in runs(s, 0, 16, 32)]}    # heads 64..95


def test_between_equal_degrees_a_kda_page_is_one_stream_per_slot():
    layout = layout_of(EIGHT_HEADS, 2)
    plan = plan_fetch(layout, layout, 1, [PageMove(5, 1, PageKind.KDA)])
    whole = layout.geometry.kda_page_bytes
    assert plan == {1: [Stream(5, s, 0, whole, 1, 0) for s in range(layout.layer_slots)]}


def test_a_gdn_run_of_value_heads_brings_the_key_heads_it_reads():
    """GDN-16 (16 value heads over 8 key heads) from TP 1 to rank 1 of TP 2: value heads 8..15
    and key heads 4..7, so the q and k runs are half as wide as the v run."""
    src, dst = layout_of(GDN_SIXTEEN_HEADS, 1), layout_of(GDN_SIXTEEN_HEADS, 2)
    plan = plan_fetch(src, dst, 1, [PageMove(5, 1, PageKind.KDA)])
    row, hb = GDN_SIXTEEN_HEADS.conv_row_bytes, GDN_SIXTEEN_HEADS.kda_head_bytes
    k, v = GDN_SIXTEEN_HEADS.kda_head_k_dim, GDN_SIXTEEN_HEADS.kda_head_v_dim
    src_conv = (2 * 8 * k + 16 * v) * row

    def runs(s: int) -> list[Stream]:
        return [Stream(5, s, 4 * k * row, 4 * k * row, 1, 0),
                Stream(5, s, (8 + 4) * k * row, 4 * k * row, 1, 4 * k * row),
                Stream(5, s, (16 * k + 8 * v) * row, 8 * v * row, 1, 8 * k * row),
                Stream(5, s, src_conv + 8 * hb, 8 * hb, 1, dst.recurrent_offset)]
    assert plan == {0: [x for s in range(src.layer_slots) for x in runs(s)]}


def test_a_gqa_page_is_one_stream_per_slot_where_both_ranks_hold_the_same_kv_heads():
    page = PageMove(5, 1, PageKind.MLA, 3 * layout_of(GDN_SIXTEEN_HEADS, 2).model.mla_token_bytes)
    for src_degree, dst_degree, dst_rank, src_rank in [(2, 2, 1, 1), (2, 4, 2, 1), (4, 2, 1, 3)]:
        src = layout_of(GDN_SIXTEEN_HEADS, src_degree)
        dst = layout_of(GDN_SIXTEEN_HEADS, dst_degree)
        nbytes = 3 * src.model.mla_token_bytes
        plan = plan_fetch(src, dst, dst_rank, [dataclasses.replace(page, nbytes=nbytes)])
        assert plan == {src_rank: [Stream(5, s, 0, nbytes, 1, 0) for s in range(src.layer_slots)]}


def test_a_gqa_page_split_differently_moves_each_tokens_shared_heads():
    """TP 1 (KV heads 0 and 1 in each token row) to rank 1 of TP 2 (head 1 only): per token, the
    second half of the source row to the whole destination row."""
    src, dst = layout_of(GDN_SIXTEEN_HEADS, 1), layout_of(GDN_SIXTEEN_HEADS, 2)
    head = GDN_SIXTEEN_HEADS.attn_head_bytes
    plan = plan_fetch(src, dst, 1, [PageMove(5, 1, PageKind.MLA, 3 * 2 * head)])
    assert plan == {0: [Stream(5, s, t * 2 * head + head, head, 1, t * head)
                        for s in range(src.layer_slots) for t in range(3)]}


def layout_of(model: ModelSpec, degree: int) -> PageLayout:
    return PageLayout.from_specs(dataclasses.replace(model, tp_degree=degree), CACHE)


@pytest.mark.parametrize("move, dst_model, message", [
    (PageMove(0, CACHE.num_pages, PageKind.KDA), EIGHT_HEADS, "page 6 out of range"),
    (PageMove(0, 1, PageKind.MLA, 5), EIGHT_HEADS, "not a whole number"),
    (PageMove(0, 1, PageKind.KDA, 64), EIGHT_HEADS, "moves whole"),
    (PageMove(0, 1, PageKind.UNTAGGED), EIGHT_HEADS, "cannot transfer"),
    (PageMove(0, 1, PageKind.KDA), dataclasses.replace(EIGHT_HEADS, kda_head_v_dim=4),
     "different models"),
], ids=["page", "mla-prefix", "kda-prefix", "kind", "model"])
def test_a_move_that_does_not_fit_is_refused_before_any_byte(move, dst_model, message):
    src = layout_of(EIGHT_HEADS, 2)
    dst = layout_of(dst_model, 1)
    with pytest.raises(ValueError, match=message):
        plan_fetch(src, dst, 0, [move])


async def test_the_source_refuses_a_bad_token_or_range_and_keeps_serving(pools):
    (src,), (dst,) = rank_pools(EIGHT_HEADS, 1, "cpu"), rank_pools(EIGHT_HEADS, 1, "cpu")
    pools.extend([src, dst])
    page_bytes = src.layout.page_bytes
    good = [Stream(0, 0, 0, page_bytes, 1, 0)]
    async with serving([src]) as (url,):
        with pytest.raises(RemoteError) as err:
            await fetch(url, "wrong", good, dst)
        assert err.value.code == ErrorCode.UNAUTHORIZED and not err.value.retryable
        bad = [Stream(0, 0, 8, page_bytes, 1, 0)]  # runs past the source page
        with pytest.raises(RemoteError) as err:
            await fetch(url, TOKEN, bad, dst)
        assert err.value.code == ErrorCode.BAD_REQUEST and "does not fit" in str(err.value)
        src.buffer[0, 0] = 9
        assert await fetch(url, TOKEN, good, dst) == page_bytes
    assert bool((dst.buffer[0, 1] == 9).all())


@contextlib.asynccontextmanager
async def scripted_source(send: list[bytes]) -> AsyncIterator[str]:
    """A source that accepts any request, then writes `send` and closes the connection."""
    async def handler(conn) -> None:
        frame = await read_frame(conn, 2**20)
        await send_buffers(conn, [encode_frame(ok_frame(frame["id"], StreamsAccepted(
            len(frame["streams"]), sum(row[3] for row in frame["streams"]))))] + send)

    server = SocketServer(handler)
    try:
        yield await server.start("tcp://127.0.0.1:0")
    finally:
        await server.close()


@pytest.mark.parametrize("header, message", [
    ((6, 0, 0, 64), "outside the destination layout"),             # page past the pool
    ((1, 0, PAGE_BYTES - 64, 128), "outside the destination layout"),  # runs past the page
    ((2, 0, 0, 64), "not the stream asked for"),                   # in bounds, not asked for
], ids=["page", "range", "unasked"])
async def test_a_header_not_asked_for_is_refused_and_nothing_is_written(pools, header, message):
    (dst,) = rank_pools(EIGHT_HEADS, 1, "cpu")
    pools.append(dst)
    before = garbage(dst, seed=3)
    async with scripted_source([STREAM_HEADER.pack(*header), bytes(header[3])]) as url:
        with pytest.raises(BadStreamHeader, match=message):
            await fetch(url, TOKEN, [Stream(0, 0, 0, 64, 1, 0)], dst)
    assert torch.equal(dst.buffer, before)


async def test_a_source_closing_mid_stream_fails_retryably(pools):
    (dst,) = rank_pools(EIGHT_HEADS, 1, "cpu")
    pools.append(dst)
    streams = [Stream(0, 0, 0, 64, 1, 0), Stream(0, 1, 0, 64, 1, 0)]
    sent = [STREAM_HEADER.pack(1, 0, 0, 64), bytes(64), STREAM_HEADER.pack(1, 1, 0, 64), bytes(10)]
    async with scripted_source(sent) as url:
        with pytest.raises(TransferFailed, match="went away after 64 of 128 bytes") as err:
            await fetch(url, TOKEN, streams, dst)
    assert err.value.retryable


BIG = ModelSpec(kda_heads=8, kda_head_k_dim=128, kda_head_v_dim=128, layers_per_group=4,
                mla_latent_dim=16)
BIG_CACHE = CacheSpec(hash_block_tokens=16, page_tokens=64, num_pages=48)
SOURCE_SCRIPT = f"""
import asyncio, sys
from cachetier.config import CacheSpec, ModelSpec
from gpu_pool import PagedPool
from gpu_pool.transfer import PageServer

async def main():
    pool = PagedPool.create({BIG!r}, {BIG_CACHE!r})
    pool.buffer.fill_(7)
    server = PageServer(lambda: pool, lambda: {TOKEN!r})
    print(await server.start(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_chaos_killing_the_source_mid_stream_fails_the_pull_retryably():
    """96 MiB from a page server in another process, SIGKILLed once the first bytes landed."""
    proc = subprocess.Popen([sys.executable, "-c", SOURCE_SCRIPT], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        url = (await asyncio.to_thread(proc.stdout.readline)).strip()
        with PagedPool.create(BIG, BIG_CACHE) as dst:
            pages = [PageMove(p, p, PageKind.KDA) for p in range(BIG_CACHE.num_pages)]
            src = dst.layout
            first = dst.buffer[0, 0, :64]
            transfer = asyncio.create_task(pull(dst, 0, src, [url], pages, TOKEN))
            while not bool(first.any()) and not transfer.done():
                await asyncio.sleep(0)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(TransferFailed) as err:
                await transfer
            assert err.value.retryable and "went away" in str(err.value)
            assert not bool((dst.buffer[-1, -1] == 7).all())   # it stopped before the end
    finally:
        proc.kill()
        proc.wait()
