"""Reference for `page_copy` in plain torch and numpy, and the CPU fallback the launcher uses
without Triton.

Efficient enough to be the fallback: rows with the same byte range form one group (found in one
vectorised pass, never row by row), and a group moves in as few calls as its range size allows:
- ranges of `LOOP_MIN_BYTES` or more: one strided `copy_` per pair (all layer slots at once), a
  single pass over the bytes whose per-call cost is small next to the bytes it moves;
- smaller ranges: one gather and one scatter over all (slot, page) ranges of the group. On CPU they
  run on numpy record views of the same memory (one `V{bytes}` record per range, nothing copied to
  set them up), in steps of `CHUNK_BYTES` so that the gathered records are still in cache when they
  are scattered; numpy moves each record with one memcpy, where torch's index ops take about twice
  as long on 1-4 KB ranges. Elsewhere (the reference on a GPU) torch's index ops move them.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._launch import Buffer, buffer, word_width

LOOP_MIN_BYTES = 256 * 1024  # per range and slot: from here on, one copy_ per pair
CHUNK_BYTES = 256 * 1024  # records gathered and scattered per step: a quarter of a core's L2


def page_copy_ref(src: torch.Tensor, dst: torch.Tensor, batch: torch.Tensor) -> None:
    """For each row (src_page, dst_page, byte_offset, byte_count) of the `[n, 4]` int64 `batch`,
    copy those bytes of every layer slot of `src[:, src_page]` into `dst[:, dst_page]`."""
    if batch.numel() == 0:
        return
    ranges, inverse, sizes = torch.unique(batch[:, 2:], dim=0, return_inverse=True,
                                          return_counts=True)
    groups = [batch] if ranges.size(0) == 1 else batch[inverse.argsort(stable=True)].split(
        sizes.tolist())
    src_buf, dst_buf = buffer(src, "src"), buffer(dst, "dst")
    for (offset, count), rows in zip(ranges.tolist(), groups):
        pages = rows.numpy()
        copy_group(src_buf, dst_buf, pages[:, 0], pages[:, 1], offset, offset, count)


def copy_group(src: Buffer, dst: Buffer, src_pages: np.ndarray, dst_pages: np.ndarray,
               src_offset: int, dst_offset: int, nbytes: int) -> None:
    """Copy bytes `[src_offset, +nbytes)` of every slot of each src page (1-D int64 page ids) to
    `[dst_offset, +nbytes)` of the paired dst page."""
    if nbytes == 0 or src_pages.size == 0 or src.slots == 0:
        return
    if nbytes < LOOP_MIN_BYTES and src.device_type == "cpu":
        _copy_records(src, dst, src_pages, dst_pages, src_offset, dst_offset, nbytes)
        return
    width = word_width((src.align, dst.align, src_offset, dst_offset, nbytes))
    src_rows = src.words(width, src_offset // width, nbytes // width)
    dst_rows = dst.words(width, dst_offset // width, nbytes // width)
    if nbytes >= LOOP_MIN_BYTES:
        for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
            dst_rows.select(1, d).copy_(src_rows.select(1, s))
        return
    src_index = torch.from_numpy(src_pages).to(src_rows.device)
    dst_index = torch.from_numpy(dst_pages).to(dst_rows.device)
    dst_rows.index_copy_(1, dst_index, src_rows.index_select(1, src_index))


def _copy_records(src: Buffer, dst: Buffer, src_pages: np.ndarray, dst_pages: np.ndarray,
                  src_offset: int, dst_offset: int, nbytes: int) -> None:
    src_rec, dst_rec = src.records(src_offset, nbytes), dst.records(dst_offset, nbytes)
    src_index, dst_index = src_rec.index(src_pages), dst_rec.index(dst_pages)
    step = max(1, CHUNK_BYTES // nbytes)
    if src_index.size <= step:
        dst_rec.array[dst_index] = src_rec.array[src_index]
        return
    src_index, dst_index = src_index.ravel(), dst_index.ravel()
    for start in range(0, src_index.size, step):
        dst_rec.array[dst_index[start:start + step]] = src_rec.array[src_index[start:start + step]]
