"""Reference for `head_reshard`, and its CPU fallback.

Heads are stored contiguously in both layouts, so the moved head range is one contiguous byte range
on each side: the reference moves it for all page pairs as one group (see `copy_group`).
"""

from __future__ import annotations

import torch

from kernels._launch import buffer
from kernels.page_copy_ref import copy_group


def head_reshard_ref(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, src_offset: int,
                     dst_offset: int, nbytes: int) -> None:
    """For each `(src_page, dst_page)` row of `pages`, copy bytes `[src_offset, +nbytes)` of every
    layer slot of the src page to `[dst_offset, +nbytes)` of the dst page."""
    if pages.numel() == 0:
        return
    pairs = pages.numpy()
    copy_group(buffer(src, "src"), buffer(dst, "dst"), pairs[:, 0], pairs[:, 1], src_offset,
               dst_offset, nbytes)
