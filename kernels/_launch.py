"""What every launcher shares: backend choice, lazy jit, batch validation, word width and block rules.

Kernels are jitted lazily, at first launch, because `triton.jit` reads `TRITON_INTERPRET` when it
decorates: jitting at launch lets one process run the CPU interpreter (tests) or compiled kernels
(CUDA) depending on the environment at that moment.

Validation costs one pass over the batch whatever its size: `as_batch` takes every column's min and
max with a single `torch.aminmax`, and the bound checks, the block rule and the fallback's grouping
read those few numbers. Rows are looked at again only to name the offenders of a failing batch, or
(one bitmap lookup) when a batch's source and destination page ranges interleave in one buffer.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import triton

Backend = Literal["triton", "torch"]

logger = logging.getLogger("kernels")
_fell_back: set[str] = set()

MAX_GRID_YZ = 65_535  # CUDA's limit on the 2nd and 3rd grid dimensions
MAX_GRID_X = 2**31 - 1
MAX_BLOCK_BYTES = 16_384  # bytes one program moves per loop iteration
SHOWN = 8  # offending rows or pages quoted in an error message
# Integer words for the kernels; the torch fallback may also move 16-byte words as complex128:
# index_select / index_copy_ only move elements, never compute on them, so every bit passes through.
_WORD_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
KERNEL_WORD = 8  # the widest word a Triton kernel moves


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_backend(device: torch.device, kernel: str) -> Backend:
    """Triton on CUDA, or on CPU under the interpreter; otherwise the torch reference (logged once)."""
    if device.type == "cuda" or interpreting():
        return "triton"
    if kernel not in _fell_back:
        _fell_back.add(kernel)
        logger.info("%s: tensors on %s and TRITON_INTERPRET!=1, using the torch reference",
                    kernel, device)
    return "torch"


class LazyJit:
    """`triton.jit(fn)`, built on first use for the current interpreter setting."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._built: dict[bool, object] = {}

    def kernel(self) -> object:
        mode = interpreting()
        if mode not in self._built:
            self._built[mode] = triton.jit(self.fn)
        return self._built[mode]


@dataclass(frozen=True)
class Batch:
    """A batch as a contiguous host `[n, columns]` int64 tensor, with each column's min and max."""

    rows: torch.Tensor
    low: tuple[int, ...]
    high: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.rows.size(0)

    def uniform(self, *columns: int) -> bool:
        """Whether every row holds the same value in each of `columns`."""
        return all(self.low[c] == self.high[c] for c in columns)


def as_batch(batch: torch.Tensor | Sequence[Sequence[int]], columns: int, what: str) -> Batch:
    """The batch on the host (validation happens there) with its column bounds, in one pass."""
    rows = torch.as_tensor(batch, dtype=torch.int64, device="cpu")
    if rows.numel() == 0:
        return Batch(rows.reshape(0, columns), (0,) * columns, (-1,) * columns)
    if rows.dim() != 2 or rows.size(1) != columns:
        raise ValueError(f"{what} must have shape [n, {columns}], got {tuple(rows.shape)}")
    rows = rows.contiguous()
    low, high = torch.aminmax(rows, dim=0)
    return Batch(rows, tuple(low.tolist()), tuple(high.tolist()))


def check_buffers(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Both are `[layer_slots, pages, page_bytes]` uint8 on one device with a contiguous last dim."""
    for name, t in (("src", src), ("dst", dst)):
        if t.dtype != torch.uint8 or t.dim() != 3 or (t.size(2) > 1 and t.stride(2) != 1):
            raise ValueError(f"{name} must be a [slots, pages, bytes] uint8 tensor with contiguous "
                             f"bytes, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if src.device != dst.device:
        raise ValueError(f"src on {src.device} but dst on {dst.device}")
    if src.size(0) != dst.size(0):
        raise ValueError(f"src has {src.size(0)} layer slots but dst has {dst.size(0)}")


def check_pages(batch: Batch, column: int, count: int, what: str) -> None:
    if batch.size == 0 or (batch.low[column] >= 0 and batch.high[column] < count):
        return
    pages = batch.rows[:, column]
    bad = pages[(pages < 0) | (pages >= count)]
    raise ValueError(f"{what} out of range [0, {count}): {shown(bad.unique().tolist())}")


def check_pairs(src: torch.Tensor, dst: torch.Tensor, batch: Batch) -> None:
    """Pages in range, one launch's worth of (pair, slot) programs, and within one buffer no page
    both read and written (programs run in no particular order)."""
    check_pages(batch, 0, src.size(1), "src_page")
    check_pages(batch, 1, dst.size(1), "dst_page")
    if src.data_ptr() == dst.data_ptr() and (both := pages_in_both_columns(batch)):
        raise ValueError(f"pages {shown(both)} are destination pages and also a source page of the "
                         "same batch")
    if batch.size * src.size(0) > MAX_GRID_X:
        raise ValueError(f"{batch.size} pairs x {src.size(0)} slots exceed one launch; "
                         "split the batch")


def pages_in_both_columns(batch: Batch) -> list[int]:
    """Pages listed as a source (column 0) and as a destination (column 1); columns validated."""
    if batch.size == 0 or max(batch.low[0], batch.low[1]) > min(batch.high[0], batch.high[1]):
        return []  # the two page ranges do not even interleave
    rows = batch.rows.numpy()
    is_src = np.zeros(max(batch.high[0], batch.high[1]) + 1, dtype=bool)
    is_src[rows[:, 0]] = True
    dst = rows[:, 1]
    return np.unique(dst[is_src[dst]]).tolist()


def shown(values: list[int]) -> str:
    """`values` for an error message, cut to the first `SHOWN`."""
    more = f" and {len(values) - SHOWN} more" if len(values) > SHOWN else ""
    return f"{values[:SHOWN]}{more}"


def alignment(batch: Batch, columns: Sequence[int]) -> int:
    """A number that a power of two divides iff it divides every value of `columns` (their OR)."""
    if batch.size == 0:
        return 0
    if batch.uniform(*columns):
        return math.gcd(*(batch.low[c] for c in columns))
    return int(np.bitwise_or.reduce(batch.rows.numpy()[:, list(columns)], axis=None))


def word_width(tensors: Sequence[torch.Tensor], quantities: Sequence[int],
               widest: int = KERNEL_WORD) -> int:
    """The widest word (up to `widest` bytes) that divides every address and length involved.

    Moving int64 words instead of bytes cuts the instructions per byte; reinterpreting bits as
    integers never rounds, whatever dtype the pages hold.
    """
    g = 0
    for t in tensors:
        g = math.gcd(g, t.data_ptr(), t.stride(0), t.stride(1), t.size(2))
    g = math.gcd(g, *quantities)
    return next(w for w in _WORD_DTYPES if w <= widest and g % w == 0)


def as_words(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.view(_WORD_DTYPES[width])


def block_rule(max_bytes: int, width: int) -> tuple[int, int]:
    """(words per program iteration, num_warps): the next power of two of the largest range, capped
    at `MAX_BLOCK_BYTES`, with about 8 words per thread."""
    block_bytes = min(MAX_BLOCK_BYTES, 1 << max(0, max_bytes - 1).bit_length())
    block = max(1, block_bytes // width)
    return block, min(8, max(1, block // 256))


def chunks(words: int, block: int) -> int:
    """Programs along one range: enough to cover it, capped; each program strides over the rest."""
    return max(1, min(MAX_GRID_YZ, -(-words // block)))
