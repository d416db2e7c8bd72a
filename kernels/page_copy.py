"""Batched page copy: one launch moves a byte range of many pages across all layer slots.

Used to restore checkpoints into private state pages, to copy the first B tokens of a partially
matched MLA page into a private page (copy-on-write), and to snapshot a private state into a fresh
checkpoint page. Bytes are moved as the widest integer word every address and length allows; no
arithmetic ever touches the payload, so bf16 or fp8 bits pass through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import triton.language as tl

from kernels._launch import (Backend, Batch, Buffer, LazyJit, as_batch, block_rule, check_buffers,
                             check_pairs, chunks, pick_backend, shown, word_width)
from kernels.page_copy_ref import copy_group, copy_rows


def _page_copy_kernel(
    src_ptr,  # [slots, src_pages, src_page_words] words: the source buffer
    dst_ptr,  # [slots, dst_pages, dst_page_words] words: the destination buffer
    batch_ptr,  # [pairs, 4] int64: src_page, dst_page, byte_offset, byte_count
    src_slot_stride, src_page_stride,  # words
    dst_slot_stride, dst_page_stride,  # words
    slots,  # layer slots per page
    word_bytes,  # bytes per word: divides every offset and count of the batch
    BLOCK: tl.constexpr,  # words per loop iteration
):
    # program_id(0): one (pair, slot); program_id(1): a chunk of the range, striding over the rest
    pair_slot = tl.program_id(0).to(tl.int64)
    pair = pair_slot // slots
    slot = pair_slot % slots
    row = batch_ptr + pair * 4
    src_page = tl.load(row)
    dst_page = tl.load(row + 1)
    offset = tl.load(row + 2) // word_bytes
    count = tl.load(row + 3) // word_bytes
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
    src_buf, dst_buf = check_buffers(src, dst)
    rows = as_batch(batch, 4, "batch")
    backend = pick_backend(src_buf.device_type, "page_copy")
    if rows.size == 0:
        return backend
    check_pairs(src_buf, dst_buf, rows)
    limit = min(src_buf.page_bytes, dst_buf.page_bytes)
    if min(rows.low[2], rows.low[3]) < 0 or rows.high[2] + rows.high[3] > limit:
        _check_ranges(rows, limit)  # the bounds alone do not prove that every range fits
    if backend == "triton":
        _launch(src, dst, src_buf, dst_buf, rows)
    elif rows.uniform(2, 3):  # the usual batch: one (offset, count) for every pair
        offset, count = rows.low[2], rows.low[3]
        copy_group(src_buf, dst_buf, rows.array[:, 0], rows.array[:, 1], offset, count)
    else:
        copy_rows(src_buf, dst_buf, rows.array, rows.high[3])
    return backend


def _check_ranges(batch: Batch, limit: int) -> None:
    offset, count = batch.array[:, 2], batch.array[:, 3]
    bad = (offset < 0) | (count < 0) | (offset + count > limit)
    if bad.any():
        raise ValueError(f"byte ranges outside a {limit}-byte page: "
                         f"{shown(batch.array[bad].tolist())}")


def _launch(src: torch.Tensor, dst: torch.Tensor, src_buf: Buffer, dst_buf: Buffer,
            batch: Batch) -> None:
    longest = batch.high[3]
    if longest == 0:
        return
    if batch.uniform(2, 3):
        shared = math.gcd(batch.low[2], longest)
    else:  # their OR: a power of two divides it iff it divides every offset and count
        shared = int(np.bitwise_or.reduce(batch.array[:, 2:], axis=None))
    width = word_width((src_buf.align, dst_buf.align, shared))
    src_w, dst_w = src_buf.words(width), dst_buf.words(width)
    block, num_warps = block_rule(longest, width)
    grid = (batch.size * src_buf.slots, chunks(longest // width, block))
    _KERNEL.kernel()[grid](
        src_w, dst_w, batch.rows.contiguous().to(src.device, non_blocking=True),
        src_w.stride(0), src_w.stride(1), dst_w.stride(0), dst_w.stride(1), src_buf.slots, width,
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)  # integers only: no FP to fuse
