"""Head-range gather/scatter between KDA pages laid out for different tensor-parallel degrees.

A rank of TP degree `s` stores heads `[r*H/s, (r+1)*H/s)` of each layer, head by head. Moving the
heads two ranks share from a source rank's pages into a destination rank's pages (or into or out of
a packed staging buffer for the network) re-shards on the transfer path: one launch per (source
rank, destination rank) pair for a whole batch of pages, no reshuffle afterwards.

Both sides store heads in ascending order, so the shared heads' streams are one contiguous run on
each side: the kernel moves that run, which puts every head's stream at its offset in the
destination layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from kernels._launch import (Backend, Buffer, LazyJit, as_batch, block_rule, check_buffers,
                             check_pairs, chunks, pick_backend, word_width)
from kernels.head_reshard_ref import head_reshard_ref


def _head_reshard_kernel(
    src_ptr,  # [slots, src_pages, src_page_words] words: pages laid out for the source rank
    dst_ptr,  # [slots, dst_pages, dst_page_words] words: pages laid out for the destination rank
    pages_ptr,  # [pairs, 2] int64: src_page, dst_page
    src_slot_stride, src_page_stride,  # words
    dst_slot_stride, dst_page_stride,  # words
    slots,  # layer slots per page
    src_first, dst_first,  # words: where the first moved head's stream starts in a src / dst slot
    count,  # words: the moved heads' streams, back to back on both sides
    BLOCK: tl.constexpr,  # words per loop iteration
):
    # program_id(0): one (pair, slot); program_id(1): a chunk of the streams, striding over the rest
    pair_slot = tl.program_id(0).to(tl.int64)
    pair = pair_slot // slots
    slot = pair_slot % slots
    src_page = tl.load(pages_ptr + pair * 2)
    dst_page = tl.load(pages_ptr + pair * 2 + 1)
    src = src_ptr + slot * src_slot_stride + src_page * src_page_stride + src_first
    dst = dst_ptr + slot * dst_slot_stride + dst_page * dst_page_stride + dst_first
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BLOCK
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(first, count, step):
        idx = start + lanes
        mask = idx < count
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


_KERNEL = LazyJit(_head_reshard_kernel)


def head_reshard(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor | Sequence[Sequence[int]],
                 *, head_bytes: int, src_heads: range, dst_heads: range,
                 heads: range | None = None) -> Backend:
    """Copy the streams of global `heads` (default: all heads both sides hold) of every layer slot
    from each `(src_page, dst_page)` pair; returns the backend that ran.

    `src_heads`/`dst_heads` are the global heads each src/dst page holds, in storage order (a pool
    rank's `PageLayout.rank_heads(rank)`, or the packed range of a staging buffer); head `h` sits at
    byte `(h - src_heads.start) * head_bytes` of a src slot and is written at
    `(h - dst_heads.start) * head_bytes` of the dst slot.
    """
    src_buf, dst_buf = check_buffers(src, dst)
    batch = as_batch(pages, 2, "pages")
    moved = _moved_heads(src_buf, dst_buf, head_bytes, src_heads, dst_heads, heads)
    backend = pick_backend(src_buf.device_type, "head_reshard")
    if batch.size == 0:
        return backend
    check_pairs(src_buf, dst_buf, batch)
    if not moved:
        return backend
    src_offset = (moved.start - src_heads.start) * head_bytes
    dst_offset = (moved.start - dst_heads.start) * head_bytes
    nbytes = len(moved) * head_bytes
    if backend == "torch":
        head_reshard_ref(src, dst, batch.rows, src_offset, dst_offset, nbytes)
    else:
        _launch(src, dst, src_buf, dst_buf, batch.rows, src_offset, dst_offset, nbytes)
    return backend


def _moved_heads(src: Buffer, dst: Buffer, head_bytes: int, src_heads: range, dst_heads: range,
                 heads: range | None) -> range:
    if head_bytes <= 0:
        raise ValueError(f"head_bytes must be positive, got {head_bytes}")
    for name, held, buf in (("src", src_heads, src), ("dst", dst_heads, dst)):
        if held.step != 1 or len(held) * head_bytes > buf.page_bytes:
            raise ValueError(f"{name}_heads {held} do not fit contiguously in {buf.page_bytes}-byte "
                             "pages")
    both = range(max(src_heads.start, dst_heads.start), min(src_heads.stop, dst_heads.stop))
    moved = both if heads is None else heads
    if len(moved) and (moved.step != 1 or moved.start < both.start or moved.stop > both.stop):
        raise ValueError(f"heads {moved} are not held by both sides (shared: {both})")
    return moved


def _launch(src: torch.Tensor, dst: torch.Tensor, src_buf: Buffer, dst_buf: Buffer,
            rows: torch.Tensor, src_offset: int, dst_offset: int, nbytes: int) -> None:
    width = word_width((src_buf.align, dst_buf.align, src_offset, dst_offset, nbytes))
    src_w, dst_w = src_buf.words(width), dst_buf.words(width)
    block, num_warps = block_rule(nbytes, width)
    grid = (rows.size(0) * src_buf.slots, chunks(nbytes // width, block))
    _KERNEL.kernel()[grid](
        src_w, dst_w, rows.contiguous().to(src.device, non_blocking=True),
        src_w.stride(0), src_w.stride(1), dst_w.stride(0), dst_w.stride(1), src_buf.slots,
        src_offset // width, dst_offset // width, nbytes // width,
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)  # integers only: no FP to fuse
