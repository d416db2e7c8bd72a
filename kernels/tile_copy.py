"""Batched strided tile copy: one launch moves, for every job of a batch and every part of a table,
one 2-D tile between two strided views, whatever their strides (transposes included).

A part is a pair of 4-D views `[i0, i1, A, B]` (source, destination) of one dtype and one tile
shape `(A, B)`; a job `(src_i0, src_i1, dst_i0, dst_i1)` does `dst[dst_i0, dst_i1] =
src[src_i0, src_i1]` in every part. The connector's copies between vLLM's KV cache and the pool's
pages (`cachetier.vllm.kv_copy`) are this one operation on different views: token rows (`i0` a
block or page, `i1` a token row, the tile `[heads, head_dim]`, K and V each a part, vLLM's K
dim-major or not) and states (`i1` unused, the tile a transposed conv block or the recurrent
`[heads x V, K]` rows). Their reference, and the fallback where Triton cannot run, is the torch
indexed copy those views define there (`dst[i0, i1] = src[i0, i1]`, one per part).

Why a table of parts read by the kernel, not one launch per tensor: a cache group's layers are
separate tensors with equal strides and a step copies the same rows in each, so one table row per
(layer, part) makes a step's copy of a group one launch (one per word width) whatever its layer
count, where a launch per layer and part pays a launch's host cost 2 x layers times (Qwen3-Next-80B,
12 attention and 36 GDN layers in four groups: 96 launches per direction, against 7 here with
the flash layout). What it costs: addresses and strides are loaded at run
time, so the compiler cannot specialise unit strides or known alignments into vector accesses;
parts are widened instead to the widest integer word that every address, stride and tile row of
the part allows (an int64 word per four bf16 dims where dims are contiguous on both sides), which
also moves bits as integers, so no dtype's payload is ever rounded.

Grid: axis 0 runs of `BLOCK_R` consecutive (job, tile row) pairs, axis 1 the parts. Pairs, not
jobs, because tiles differ by orders of magnitude: a token row is a few hundred bytes (a program
each would leave most lanes idle, and the interpreter's cost is per program), a recurrent state
hundreds of rows (a program each would leave a GPU idle with a few requests); numbering pairs
gives every program `MAX_BLOCK_BYTES` of tiles (`block_rule`) whatever their shape. Job indices are
checked on the host against every part's sizes before the launch: the kernel trusts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton.language as tl

from kernels._launch import (MAX_BLOCK_BYTES, MAX_GRID_X, MAX_GRID_YZ, LazyJit, as_batch, block_rule,
                             shown, word_width)

_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def _tile_copy_kernel(
    parts_ptr,  # [parts, 12] int64: src and dst byte addresses; in words: src strides (i0, i1, a, b),
                # dst strides (i0, i1, a, b), tile rows A, tile row words B
    jobs_ptr,  # [jobs, 4] int64: src_i0, src_i1, dst_i0, dst_i1
    jobs,  # rows of jobs_ptr
    WORD: tl.constexpr,  # the integer type every part of the launch moves
    BLOCK_R: tl.constexpr,  # (job, tile row) pairs per program
    BLOCK_B: tl.constexpr,  # words of a row per iteration
):
    # program_id(0): BLOCK_R consecutive (job, tile row) pairs, job-major; program_id(1): the part
    part = parts_ptr + tl.program_id(1).to(tl.int64) * 12
    rows, words = tl.load(part + 10), tl.load(part + 11)
    pair = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    job, a = pair // rows, pair % rows
    live = job < jobs
    at = jobs_ptr + job * 4
    src = tl.load(part).to(tl.pointer_type(WORD)) + (
        tl.load(at, mask=live, other=0) * tl.load(part + 2)
        + tl.load(at + 1, mask=live, other=0) * tl.load(part + 3) + a * tl.load(part + 4))
    dst = tl.load(part + 1).to(tl.pointer_type(WORD)) + (
        tl.load(at + 2, mask=live, other=0) * tl.load(part + 6)
        + tl.load(at + 3, mask=live, other=0) * tl.load(part + 7) + a * tl.load(part + 8))
    src_b, dst_b = tl.load(part + 5), tl.load(part + 9)
    lanes = tl.arange(0, BLOCK_B).to(tl.int64)
    for b0 in range(0, words, BLOCK_B):
        b = b0 + lanes
        mask = live[:, None] & (b < words)[None, :]
        tile = tl.load(src[:, None] + b[None, :] * src_b, mask=mask)
        tl.store(dst[:, None] + b[None, :] * dst_b, tile, mask=mask)


_KERNEL = LazyJit(_tile_copy_kernel)


@dataclass(frozen=True)
class PartRow:
    """One part of a launch, in the words it moves: its table row and its tile in words."""

    width: int
    row: list[int]


def part_row(src: torch.Tensor, dst: torch.Tensor) -> PartRow:
    """The table row of one (src, dst) pair of `[i0, i1, A, B]` views, widened to the widest word
    that divides both addresses, every stride but B's (in bytes) and a tile row, when B is
    contiguous on both sides (otherwise one element is one word)."""
    item = src.element_size()
    rows, cols = src.shape[2], src.shape[3]
    width = item
    if src.stride(3) == 1 and dst.stride(3) == 1:
        width = max(item, word_width((src.data_ptr(), dst.data_ptr(), cols * item,
                                      *(s * item for t in (src, dst) for s in t.stride()[:3]))))
    if width == item:
        return PartRow(width, [src.data_ptr(), dst.data_ptr(), *src.stride(), *dst.stride(),
                               rows, cols])
    ratio = width // item
    return PartRow(width, [src.data_ptr(), dst.data_ptr(), *(s // ratio for s in src.stride()[:3]), 1,
                           *(s // ratio for s in dst.stride()[:3]), 1, rows, cols // ratio])


def check_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every part a pair of 4-D views of one dtype and tile shape, all on one device."""
    device = parts[0][0].device
    for i, (src, dst) in enumerate(parts):
        if src.dim() != 4 or dst.dim() != 4:
            raise ValueError(f"part {i}: views must be [i0, i1, A, B], got {tuple(src.shape)} and "
                             f"{tuple(dst.shape)}")
        if src.dtype != dst.dtype or src.shape[2:] != dst.shape[2:]:
            raise ValueError(f"part {i}: {src.dtype} {tuple(src.shape[2:])} tiles into "
                             f"{dst.dtype} {tuple(dst.shape[2:])} tiles")
        if src.device != device or dst.device != device:
            raise ValueError(f"part {i}: on {src.device} and {dst.device}, the batch on {device}")


def check_jobs(parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
               jobs: torch.Tensor) -> torch.Tensor:
    """The `[n, 4]` host jobs, each index within every part's views (one pass over the jobs)."""
    batch = as_batch(jobs, 4, "jobs")
    limits = [min(pair[side].shape[dim] for pair in parts)
              for side, dim in ((0, 0), (0, 1), (1, 0), (1, 1))]
    for column, (limit, what) in enumerate(zip(limits, ("src_i0", "src_i1", "dst_i0", "dst_i1"))):
        if batch.size and (batch.low[column] < 0 or batch.high[column] >= limit):
            values = batch.array[:, column]
            bad = sorted(set(values[(values < 0) | (values >= limit)].tolist()))
            raise ValueError(f"{what} out of range [0, {limit}): {shown(bad)}")
    return batch.rows


def tile_copy(parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
              jobs: torch.Tensor | Sequence[Sequence[int]]) -> int:
    """For each `(src_i0, src_i1, dst_i0, dst_i1)` job and each `(src, dst)` part, copy
    `src[src_i0, src_i1]` into `dst[dst_i0, dst_i1]` with Triton (CUDA, or CPU under
    `TRITON_INTERPRET=1`); returns the number of launches (one per word width among the parts).

    The caller picks the backend (`kernels._launch.pick_backend`) and keeps the views alive until
    the copy ran (the table holds their addresses). Destinations must not overlap a source of the
    batch, nor each other unless they receive equal bytes.
    """
    if not parts:
        return 0
    check_parts(parts)
    rows = check_jobs(parts, jobs)
    by_width: dict[int, list[PartRow]] = {}
    for src, dst in parts:
        if src.shape[2] and src.shape[3]:  # an empty tile moves nothing
            row = part_row(src, dst)
            by_width.setdefault(row.width, []).append(row)
    if not len(rows) or not by_width:
        return 0
    if any(len(group) > MAX_GRID_YZ for group in by_width.values()):
        raise ValueError(f"more than {MAX_GRID_YZ} parts of one word width in one launch")
    device = parts[0][0].device
    jobs_on_device = rows.contiguous().to(device, non_blocking=True)
    for width, group in by_width.items():
        _launch(width, group, jobs_on_device, len(rows), device)
    return len(by_width)


def _launch(width: int, parts: list[PartRow], jobs: torch.Tensor, count: int,
            device: torch.device) -> None:
    """Programs of `MAX_BLOCK_BYTES` (`block_rule`): a tile row's words (up to the block) by as
    many (job, tile row) pairs as fill the rest. The block depends on the tiles, never on the job
    count, so a model's copies compile once per part kind, not once per batch size."""
    tile_rows = max(part.row[10] for part in parts)
    tile_words = max(part.row[11] for part in parts)
    block, num_warps = block_rule(MAX_BLOCK_BYTES, width)
    block_b = min(block, _pow2_at_least(tile_words))
    block_r = block // block_b
    programs = -(-count * tile_rows // block_r)
    if programs > MAX_GRID_X:
        raise ValueError(f"{count} jobs of {tile_rows} tile rows exceed one launch; split the batch")
    table = torch.tensor([part.row for part in parts], dtype=torch.int64).to(device,
                                                                             non_blocking=True)
    _KERNEL.kernel()[(programs, len(parts))](
        table, jobs, count, WORD=_WORDS[width], BLOCK_R=block_r, BLOCK_B=block_b,
        num_warps=num_warps, enable_fp_fusion=False)  # integers only: nothing to fuse


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
