"""What every launcher shares: backend choice, lazy jit, input checks, word width and block rules.

Kernels are jitted lazily, at first launch, because `triton.jit` reads `TRITON_INTERPRET` when it
decorates: jitting at launch lets one process run the CPU interpreter (tests) or compiled kernels
(CUDA) depending on the environment at that moment.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable, Literal, Sequence

import torch
import triton

Backend = Literal["triton", "torch"]

logger = logging.getLogger("kernels")
_fell_back: set[str] = set()

MAX_GRID_YZ = 65_535  # CUDA's limit on the 2nd and 3rd grid dimensions
MAX_GRID_X = 2**31 - 1
MAX_BLOCK_BYTES = 16_384  # bytes one program moves per loop iteration
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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


def as_rows(batch: torch.Tensor | Sequence[Sequence[int]], columns: int, what: str) -> torch.Tensor:
    """The batch as a CPU `[n, columns]` int64 tensor (validation happens on the host)."""
    rows = torch.as_tensor(batch, dtype=torch.int64, device="cpu")
    if rows.numel() == 0:
        return rows.reshape(0, columns)
    if rows.dim() != 2 or rows.size(1) != columns:
        raise ValueError(f"{what} must have shape [n, {columns}], got {tuple(rows.shape)}")
    return rows


def check_pages(pages: torch.Tensor, count: int, what: str) -> None:
    if pages.numel() == 0:
        return
    low, high = torch.aminmax(pages)
    if int(low) < 0 or int(high) >= count:
        raise ValueError(f"{what} out of range [0, {count}): {pages.tolist()}")


def check_pairs(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """Pages in range, one launch's worth of (pair, slot) programs, and within one buffer no page
    both read and written (programs run in no particular order)."""
    check_pages(rows[:, 0], src.size(1), "src_page")
    check_pages(rows[:, 1], dst.size(1), "dst_page")
    same_buffer = src.data_ptr() == dst.data_ptr()
    if same_buffer and not set(rows[:, 0].tolist()).isdisjoint(rows[:, 1].tolist()):
        raise ValueError("a destination page is also a source page of the same batch")
    if rows.size(0) * src.size(0) > MAX_GRID_X:
        raise ValueError(f"{rows.size(0)} pairs x {src.size(0)} slots exceed one launch; "
                         "split the batch")


def word_width(tensors: Sequence[torch.Tensor], quantities: Sequence[int]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every address and length involved.

    Moving int64 words instead of bytes cuts the instructions per byte; reinterpreting bits as
    integers never rounds, whatever dtype the pages hold.
    """
    g = 0
    for t in tensors:
        g = math.gcd(g, t.data_ptr(), t.stride(0), t.stride(1), t.size(2))
    for q in quantities:
        g = math.gcd(g, q)
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


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
