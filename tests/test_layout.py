"""Exact byte layout of pages: head streams, token ranges, page size, buffer addressing."""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.config import PRESETS, CacheSpec, ModelSpec
from gpu_pool.layout import ByteRange, PageLayout

TINY = PageLayout.from_specs(PRESETS["tiny"].model, PRESETS["tiny"].cache)
KIMI = PageLayout.from_specs(PRESETS["kimi-k3"].model, PRESETS["kimi-k3"].cache)
QWEN = PageLayout.from_specs(PRESETS["qwen3-next"].model, PRESETS["qwen3-next"].cache)
TINY_GQA = PageLayout.from_specs(PRESETS["tiny-gqa"].model, PRESETS["tiny-gqa"].cache)
# the real geometries of both families, at every degree that splits Qwen3-Next's 16 key heads
REAL = [pytest.param(name, tp, id=f"{name}-tp{tp}")
        for name, degrees in (("kimi-k3", (1, 2, 4, 8, 3)), ("qwen3-next", (1, 2, 4, 8, 16)))
        for tp in degrees]


def at(name: str, tp_degree: int) -> PageLayout:
    cfg = PRESETS[name]
    return PageLayout.from_specs(dataclasses.replace(cfg.model, tp_degree=tp_degree), cfg.cache)


def kimi_at(tp_degree: int) -> PageLayout:
    return at("kimi-k3", tp_degree)


@pytest.mark.parametrize("layout", [TINY, KIMI, TINY_GQA, QWEN],
                         ids=["tiny", "kimi-k3", "tiny-gqa", "qwen3-next"])
def test_one_page_size_holds_either_type(layout: PageLayout) -> None:
    geo = layout.geometry
    assert layout.page_bytes == geo.page_bytes >= max(geo.mla_page_bytes, geo.kda_page_bytes)
    assert layout.page_bytes % layout.cache.page_alignment == 0
    assert layout.buffer_shape == (layout.model.layers_per_group, layout.cache.num_pages,
                                   geo.page_bytes)


def test_a_tiny_kda_page_holds_the_conv_rows_then_the_recurrent_part() -> None:
    assert TINY.recurrent_offset == 4 * (16 + 16 + 16) * 3 * 4 == 2304  # 192 channels x 3 fp32
    assert TINY.geometry.kda_page_bytes == 2304 + 4 * 16 * 16 * 4
    assert TINY.geometry.mla_page_bytes == 64 * 16 * 4
    assert TINY.page_bytes == 6656  # 6,400 rounded up to the 512-byte alignment


def test_kimi_sizes_match_the_seed() -> None:
    assert KIMI.head_bytes == 128 * 128 * 2
    assert KIMI.recurrent_offset == 3 * 96 * 128 * 3 * 2  # kernel-4 bf16 conv over q, k, v
    assert KIMI.geometry.kda_page_bytes == KIMI.recurrent_offset + 96 * 128 * 128 * 2
    assert KIMI.geometry.mla_page_bytes == 6144 * 576 * 2 == KIMI.page_bytes


def test_qwen3_next_sizes_match_its_config() -> None:
    assert QWEN.head_bytes == 128 * 128 * 2
    assert QWEN.recurrent_offset == (2 * 16 * 128 + 32 * 128) * 3 * 2  # conv_dim 8,192
    assert QWEN.geometry.kda_page_bytes == QWEN.recurrent_offset + 32 * 128 * 128 * 2
    assert QWEN.geometry.mla_page_bytes == 512 * 2 * 2 * 256 * 2  # 2 KV heads, K and V
    assert QWEN.page_bytes == QWEN.geometry.kda_page_bytes == 1097728


@pytest.mark.parametrize("name, tp_degree", REAL)
def test_head_streams_tile_each_ranks_kda_page(name: str, tp_degree: int) -> None:
    layout = at(name, tp_degree)
    for rank in range(tp_degree):
        heads = layout.rank_heads(rank)
        streams = [layout.kda_head_range(h, rank) for h in heads]
        assert streams[0].offset == layout.recurrent_offset
        assert all(a.end == b.offset for a, b in zip(streams, streams[1:]))
        assert streams[-1].end == layout.geometry.kda_page_bytes
        assert not any(a.overlaps(b) for a, b in zip(streams, streams[1:]))


@pytest.mark.parametrize("name, tp_degree", REAL)
def test_conv_rows_of_each_head_tile_each_ranks_conv_block(name: str, tp_degree: int) -> None:
    """Per key-head group (one value head for KDA, two for Qwen3-Next's GDN)."""
    layout = at(name, tp_degree)
    group = layout.model.value_heads_per_key_head
    for rank in range(tp_degree):
        runs = [layout.conv_range(local) for h in layout.rank_heads(rank)[::group]
                for _, local in layout.conv_rows(range(h, h + group), rank)]
        runs.sort(key=lambda r: r.offset)
        assert runs[0].offset == 0 and runs[-1].end == layout.recurrent_offset
        assert all(a.end == b.offset for a, b in zip(runs, runs[1:]))


def test_head_stream_offsets_are_exact() -> None:
    layout = kimi_at(4)
    conv = 3 * 24 * 128 * 3 * 2
    assert layout.rank_heads(2) == range(48, 72)
    assert layout.recurrent_offset == conv
    assert layout.kda_head_range(48, rank=2) == ByteRange(conv, 32768)
    assert layout.kda_head_range(50, rank=2) == ByteRange(conv + 2 * 32768, 32768)
    assert TINY.kda_head_range(3) == ByteRange(2304 + 3 * 1024, 1024)


def test_conv_rows_of_a_head_run_are_its_q_k_and_v_channels() -> None:
    layout = kimi_at(4)  # rank 2 holds heads 48..71: 3,072 channels in each of q, k, v
    q, k, v = 96 * 128, 2 * 96 * 128, 3 * 96 * 128
    assert layout.conv_rows(range(50, 52), rank=2) == [
        (range(50 * 128, 52 * 128), range(2 * 128, 4 * 128)),
        (range(q + 50 * 128, q + 52 * 128), range(3072 + 2 * 128, 3072 + 4 * 128)),
        (range(k + 50 * 128, k + 52 * 128), range(6144 + 2 * 128, 6144 + 4 * 128))]
    assert v == layout.model.conv_channels
    assert layout.conv_range(range(3072, 3200)) == ByteRange(3072 * 6, 128 * 6)
    with pytest.raises(ValueError, match="not all on rank 2"):
        layout.conv_rows(range(70, 73), rank=2)
    with pytest.raises(ValueError, match="outside a 9216-channel conv block"):
        layout.conv_range(range(9000, 9217))


def test_gdn_conv_rows_split_q_k_by_key_heads_and_v_by_value_heads() -> None:
    layout = at("qwen3-next", 4)  # rank 1: value heads 8..15, key heads 4..7
    q, k = 16 * 128, 2 * 16 * 128  # where the k and v parts start in the unsharded layer
    assert layout.rank_key_heads(1) == range(4, 8)
    assert layout.conv_rows(range(10, 12), rank=1) == [
        (range(5 * 128, 6 * 128), range(128, 2 * 128)),
        (range(q + 5 * 128, q + 6 * 128), range(512 + 128, 512 + 2 * 128)),
        (range(k + 10 * 128, k + 12 * 128), range(1024 + 2 * 128, 1024 + 4 * 128))]
    assert layout.model.conv_rank_channels == 4 * 128 * 2 + 8 * 128
    with pytest.raises(ValueError, match="split a group of 2"):
        layout.conv_rows(range(9, 11), rank=1)


@pytest.mark.parametrize("name, tp_degree, expected", [
    ("qwen3-next", 1, [range(0, 2)]),
    ("qwen3-next", 2, [range(0, 1), range(1, 2)]),
    ("qwen3-next", 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
    ("kimi-k3", 3, [range(0, 1)] * 3),  # the MLA latent: one unit on every rank
])
def test_kv_heads_split_over_ranks_then_replicate(name: str, tp_degree: int,
                                                  expected: list[range]) -> None:
    layout = at(name, tp_degree)
    assert [layout.rank_attn_heads(r) for r in range(tp_degree)] == expected
    per_rank = len(expected[0]) * layout.model.attn_head_bytes
    assert layout.mla_token_range(0, 3) == ByteRange(0, 3 * per_rank)  # a prefix, per rank


@pytest.mark.parametrize("head, rank", [(0, 1), (24, 0), (96, 3)], ids=["below", "above", "past-end"])
def test_head_not_on_rank_is_rejected(head: int, rank: int) -> None:
    with pytest.raises(ValueError, match="not on rank"):
        kimi_at(4).kda_head_range(head, rank)


def test_rank_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank 4"):
        kimi_at(4).rank_heads(4)


@pytest.mark.parametrize("start, stop, expected", [
    (0, 64, ByteRange(0, 4096)),
    (0, 48, ByteRange(0, 48 * 64)),
    (16, 32, ByteRange(16 * 64, 16 * 64)),
    (5, 5, ByteRange(5 * 64, 0)),
], ids=["whole-page", "prefix-48", "middle-block", "empty"])
def test_mla_token_ranges_are_exact(start: int, stop: int, expected: ByteRange) -> None:
    assert TINY.mla_token_range(start, stop) == expected


def test_kimi_prefix_of_the_seed_example() -> None:
    assert KIMI.mla_token_range(0, 2560) == ByteRange(0, 2560 * 576 * 2)


@pytest.mark.parametrize("start, stop", [(-1, 3), (3, 2), (0, 65)],
                         ids=["negative", "reversed", "past-page"])
def test_bad_token_ranges_are_rejected(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="token range"):
        TINY.mla_token_range(start, stop)


def test_buffer_range_addresses_slot_then_page() -> None:
    within = TINY.kda_head_range(2)
    assert TINY.buffer_range(page=5, slot=1, within=within) == ByteRange(
        (256 + 5) * 6656 + 2304 + 2048, 1024)


@pytest.mark.parametrize("page, slot, within", [
    (256, 0, ByteRange(0, 1)), (0, 2, ByteRange(0, 1)), (0, 0, ByteRange(6600, 100)),
], ids=["page", "slot", "bytes"])
def test_buffer_range_rejects_out_of_range(page: int, slot: int, within: ByteRange) -> None:
    with pytest.raises(ValueError):
        TINY.buffer_range(page, slot, within)


def test_misaligned_page_size_is_rejected() -> None:
    model = ModelSpec(kda_heads=1, kda_head_k_dim=1, kda_head_v_dim=1, conv_kernel=1,
                      mla_latent_dim=3, mla_dtype="bfloat16")
    cache = CacheSpec(hash_block_tokens=1, page_tokens=3, page_alignment=1)
    with pytest.raises(ValueError, match="misaligned"):
        PageLayout.from_specs(model, cache)


def test_a_conv_block_that_would_misalign_the_recurrent_part_is_rejected() -> None:
    model = ModelSpec(kda_heads=1, kda_head_k_dim=1, kda_head_v_dim=1, conv_dtype="bfloat16")
    cache = CacheSpec(hash_block_tokens=1, page_tokens=1, page_alignment=64)
    with pytest.raises(ValueError, match="18-byte conv block"):  # 3 channels x 3 bf16
        PageLayout.from_specs(model, cache)
