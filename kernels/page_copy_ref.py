"""Plain torch reference for `page_copy`, and the CPU fallback the launcher uses without Triton.

Efficient enough to be the fallback: rows with the same byte range form one group, and a group is
moved either by one gather/scatter over all its pages (small ranges, where per-call overhead would
dominate) or by one strided copy per pair (large ranges, a single pass over the bytes).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kernels._launch import as_words, word_width

LOOP_MIN_BYTES = 64 * 1024  # per pair, all layer slots: above this a per-pair copy is cheaper


def page_copy_ref(src: torch.Tensor, dst: torch.Tensor, batch: torch.Tensor) -> None:
    """For each row (src_page, dst_page, byte_offset, byte_count) of the `[n, 4]` int64 `batch`,
    copy those bytes of every layer slot of `src[:, src_page]` into `dst[:, dst_page]`."""
    if batch.numel() == 0:
        return
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (offset, count) in enumerate(batch[:, 2:].tolist()):
        groups[offset, count].append(i)
    width = word_width((src, dst), [q for key in groups for q in key])
    src_w, dst_w = as_words(src, width), as_words(dst, width)
    for (offset, count), members in groups.items():
        rows = batch if len(members) == batch.size(0) else batch[members]
        copy_ranges(src_w, dst_w, rows[:, 0], rows[:, 1], offset // width, offset // width,
                    count // width)


def copy_ranges(src_w: torch.Tensor, dst_w: torch.Tensor, src_pages: torch.Tensor,
                dst_pages: torch.Tensor, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy words `[src_offset, +count)` of every slot of each src page to `[dst_offset, +count)` of
    the paired dst page (`*_w` are word views of `[slots, pages, page_words]` buffers)."""
    if count == 0:
        return
    src_rows = src_w.narrow(2, src_offset, count)
    dst_rows = dst_w.narrow(2, dst_offset, count)
    if count * src_w.element_size() * src_w.size(0) >= LOOP_MIN_BYTES:
        for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
            dst_rows.select(1, d).copy_(src_rows.select(1, s))
        return
    src_pages, dst_pages = src_pages.to(src_w.device), dst_pages.to(dst_w.device)
    dst_rows.index_copy_(1, dst_pages, src_rows.index_select(1, src_pages))
