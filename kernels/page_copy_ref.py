"""References for `page_copy`: `page_copy_naive`, the plain torch definition row by row (the oracle
the tests hold both the kernel and the fallback to), and `page_copy_ref`, the CPU fallback the
launcher uses without Triton, which must move the same bytes fast.

Efficient enough to be the fallback: a batch moves in as few calls as its ranges allow, whatever
the number of rows (found in vectorised passes, never row by row):
- ranges of `LOOP_MIN_BYTES` or more: one strided `copy_` per pair (all layer slots at once), a
  single pass over the bytes whose per-call cost is small next to the bytes it moves;
- smaller ranges: one gather and one scatter over all (slot, page) ranges of the batch. On CPU they
  run on numpy record views of the same memory (one `V{bytes}` record per range, nothing copied to
  set them up); numpy moves each record with one memcpy, where torch's index ops take about twice
  as long on 1-4 KB ranges. Ranges of different sizes (copy-on-write prefixes of different lengths,
  restores next to them) are cut into records of their common granule, the gcd of every offset
  and count (hash blocks, in practice), unless odd sizes make that granule tiny: then each group of
  rows with one (offset, count) moves on its own. Records move in steps of `CHUNK_BYTES`, so that
  the gathered ones are still in cache when they are scattered. Elsewhere (the reference on a GPU)
  torch's index ops move them, group by group.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._launch import Buffer, Records, buffer, word_width

LOOP_MIN_BYTES = 256 * 1024  # per range and slot: from here on, one copy_ per pair
CHUNK_BYTES = 256 * 1024  # records gathered and scattered per step: a quarter of a core's L2
MAX_GRANULES_PER_ROW = 8  # beyond this, rows of mixed sizes move group by group instead


def page_copy_naive(src: torch.Tensor, dst: torch.Tensor, rows: list[tuple[int, int, int, int]]) -> None:
    """For each (src_page, dst_page, byte_offset, byte_count), one slice assignment over all slots."""
    for s, d, offset, count in rows:
        dst[:, d, offset:offset + count] = src[:, s, offset:offset + count]


def page_copy_ref(src: torch.Tensor, dst: torch.Tensor, batch: torch.Tensor) -> None:
    """For each row (src_page, dst_page, byte_offset, byte_count) of the `[n, 4]` int64 `batch`,
    copy those bytes of every layer slot of `src[:, src_page]` into `dst[:, dst_page]`."""
    rows = batch.numpy()
    if rows.size:
        copy_rows(buffer(src, "src"), buffer(dst, "dst"), rows, int(rows[:, 3].max()))


def copy_rows(src: Buffer, dst: Buffer, rows: np.ndarray, longest: int) -> None:
    """`page_copy_ref` on validated buffers and a non-empty host batch whose longest count is
    `longest`: one gather and one scatter of granules when every range is small (CPU), else one
    group per (offset, count)."""
    if longest < LOOP_MIN_BYTES and src.device_type == "cpu" and copy_granules(src, dst, rows):
        return
    ranges, inverse = np.unique(rows[:, 2:], axis=0, return_inverse=True)
    inverse = inverse.ravel()
    for group, (offset, count) in enumerate(ranges.tolist()):
        pages = rows[inverse == group] if len(ranges) > 1 else rows
        copy_group(src, dst, pages[:, 0], pages[:, 1], offset, count)


def copy_group(src: Buffer, dst: Buffer, src_pages: np.ndarray, dst_pages: np.ndarray,
               offset: int, nbytes: int) -> None:
    """Copy bytes `[offset, +nbytes)` of every slot of each src page (1-D int64 page ids) to the
    same bytes of the paired dst page."""
    if nbytes == 0 or src_pages.size == 0 or src.slots == 0:
        return
    if nbytes < LOOP_MIN_BYTES and src.device_type == "cpu":
        src_rec, dst_rec = src.records(offset, nbytes), dst.records(offset, nbytes)
        move_records(src_rec.array, dst_rec.array, src_rec.index(src_pages),
                     dst_rec.index(dst_pages), nbytes)
        return
    width = word_width((src.align, dst.align, offset, nbytes))
    src_rows = src.words(width, offset // width, nbytes // width)
    dst_rows = dst.words(width, offset // width, nbytes // width)
    if nbytes >= LOOP_MIN_BYTES:
        for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
            dst_rows.select(1, d).copy_(src_rows.select(1, s))
        return
    src_index = torch.from_numpy(src_pages).to(src_rows.device)
    dst_index = torch.from_numpy(dst_pages).to(dst_rows.device)
    dst_rows.index_copy_(1, dst_index, src_rows.index_select(1, src_index))


def copy_granules(src: Buffer, dst: Buffer, rows: np.ndarray) -> bool:
    """Rows of any offsets and counts (CPU, same offset on both sides) cut into records of their
    common granule and moved with one gather and one scatter; False, with nothing moved, when that
    would take more than `MAX_GRANULES_PER_ROW` records per row on average (odd sizes)."""
    granule = int(np.gcd.reduce(rows[:, 2:], axis=None))
    if granule == 0 or src.slots == 0:
        return True  # every count is zero
    units = rows[:, 3] // granule  # records per row
    total = int(units.sum())
    if total > MAX_GRANULES_PER_ROW * len(rows):
        return False
    first = np.cumsum(units) - units  # each row's first record among the batch's
    ramp = np.arange(total)  # each record's place among the batch's

    def index(records: Records, pages: np.ndarray) -> np.ndarray:
        """`[slots, total]`: a row's granules are `step` records apart from its first one, so one
        repeat of the rows' first records and one ramp over the batch place them all."""
        step = granule // records.unit
        starts = pages * records.page_step + rows[:, 2] // records.unit - first * step
        return np.repeat(starts, units) + ramp * step + records.slot_starts

    src_rec, dst_rec = src.records(0, granule), dst.records(0, granule)
    move_records(src_rec.array, dst_rec.array, index(src_rec, rows[:, 0]),
                 index(dst_rec, rows[:, 1]), granule)
    return True


def move_records(src: np.ndarray, dst: np.ndarray, src_index: np.ndarray, dst_index: np.ndarray,
                 nbytes: int) -> None:
    """`dst[dst_index] = src[src_index]` for records of `nbytes`, `CHUNK_BYTES` at a time."""
    step = max(1, CHUNK_BYTES // nbytes)
    if src_index.size <= step:
        dst[dst_index] = src[src_index]
        return
    src_index, dst_index = src_index.ravel(), dst_index.ravel()
    for start in range(0, src_index.size, step):
        dst[dst_index[start:start + step]] = src[src_index[start:start + step]]
