"""Batched page copy: one launch moves a byte range of many pages across all layer slots.

Used to restore checkpoints into private state pages, to copy the first B tokens of a partially
matched MLA page into a private page (copy-on-write), and to snapshot a private state into a fresh
checkpoint page. Bytes are moved as the widest integer word every address and length allows; no
arithmetic ever touches the payload, so bf16 or fp8 bits pass through unchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton.language as tl

from kernels._launch import (Backend, LazyJit, as_rows, as_words, block_rule, check_buffers,
                             check_pairs, chunks, pick_backend, word_width)
from kernels.page_copy_ref import page_copy_ref


def _page_copy_kernel(
    src_ptr,  # [slots, src_pages, src_page_words] words: the source buffer
    dst_ptr,  # [slots, dst_pages, dst_page_words] words: the destination buffer
    batch_ptr,  # [pairs, 4] int64: src_page, dst_page, word_offset, word_count
    src_slot_stride, src_page_stride,  # words
    dst_slot_stride, dst_page_stride,  # words
    slots,  # layer slots per page
    BLOCK: tl.constexpr,  # words per loop iteration
):
    # program_id(0): one (pair, slot); program_id(1): a chunk of the range, striding over the rest
    pair_slot = tl.program_id(0).to(tl.int64)
    pair = pair_slot // slots
    slot = pair_slot % slots
    row = batch_ptr + pair * 4
    src_page = tl.load(row)
    dst_page = tl.load(row + 1)
    offset = tl.load(row + 2)
    count = tl.load(row + 3)
    src = src_ptr + slot * src_slot_stride + src_page * src_page_stride + offset
    dst = dst_ptr + slot * dst_slot_stride + dst_page * dst_page_stride + offset
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BLOCK
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(first, count, step):
        idx = start + lanes
        mask = idx < count
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


_KERNEL = LazyJit(_page_copy_kernel)


def page_copy(src: torch.Tensor, dst: torch.Tensor,
              batch: torch.Tensor | Sequence[Sequence[int]]) -> Backend:
    """Copy, for each `(src_page, dst_page, byte_offset, byte_count)` row of `batch`, those bytes of
    every layer slot of `src[:, src_page]` into `dst[:, dst_page]`; returns the backend that ran.

    `src` and `dst` are `[layer_slots, pages, page_bytes]` uint8 buffers (the same pool buffer, or
    two pools/staging buffers with the same slot count). Destination ranges must not overlap each
    other or a source range of the batch. An empty batch is a no-op.
    """
    check_buffers(src, dst)
    rows = as_rows(batch, 4, "batch")
    _check_rows(src, dst, rows)
    backend = pick_backend(src.device, "page_copy")
    if rows.size(0) == 0:
        return backend
    if backend == "torch":
        page_copy_ref(src, dst, rows)
        return backend
    _launch(src, dst, rows)
    return backend


def _check_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    check_pairs(src, dst, rows)
    offset, count = rows[:, 2], rows[:, 3]
    limit = min(src.size(2), dst.size(2))
    bad = (offset < 0) | (count < 0) | (offset + count > limit)
    if bool(bad.any()):
        raise ValueError(f"byte ranges outside a {limit}-byte page: {rows[bad].tolist()}")


def _launch(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    width = word_width((src, dst), rows[:, 2:].flatten().tolist())
    src_w, dst_w = as_words(src, width), as_words(dst, width)
    words = rows.clone()
    words[:, 2:] //= width
    block, num_warps = block_rule(int(rows[:, 3].max()), width)
    grid = (rows.size(0) * src.size(0), chunks(int(words[:, 3].max()), block))
    _KERNEL.kernel()[grid](
        src_w, dst_w, words.to(src.device, non_blocking=True),
        src_w.stride(0), src_w.stride(1), dst_w.stride(0), dst_w.stride(1), src.size(0),
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)  # integers only: no FP to fuse
