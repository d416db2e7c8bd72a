"""Plain torch reference for `head_reshard`, and its CPU fallback.

Heads are stored contiguously in both layouts, so the moved head range is one contiguous byte range
on each side: the reference copies it per page pair (or per group of pairs, see `copy_ranges`).
"""

from __future__ import annotations

import torch

from kernels._launch import as_words, word_width
from kernels.page_copy_ref import copy_ranges


def head_reshard_ref(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, src_offset: int,
                     dst_offset: int, nbytes: int) -> None:
    """For each `(src_page, dst_page)` row of `pages`, copy bytes `[src_offset, +nbytes)` of every
    layer slot of the src page to `[dst_offset, +nbytes)` of the dst page."""
    if pages.numel() == 0 or nbytes == 0:
        return
    width = word_width((src, dst), (src_offset, dst_offset, nbytes))
    copy_ranges(as_words(src, width), as_words(dst, width), pages[:, 0], pages[:, 1],
                src_offset // width, dst_offset // width, nbytes // width)
