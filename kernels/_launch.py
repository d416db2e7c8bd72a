"""What every launcher shares: backend choice, lazy jit, batch validation, buffer views, block rules.

Kernels are jitted lazily, at first launch, because `triton.jit` reads `TRITON_INTERPRET` when it
decorates: jitting at launch lets one process run the CPU interpreter (tests) or compiled kernels
(CUDA) depending on the environment at that moment.

A launch's fixed cost is kept small because batches of small pages are common:
- validation is one pass over the host batch whatever its size: `torch.aminmax` gives each column's
  min and max, and the bound checks, the detection of the usual batch (one byte range for every
  pair), the block rule and the word width read those few numbers. Only two things look at rows
  again: a bitmap lookup for pages both read and written, when the source and destination page
  ranges interleave, and the naming of the offenders of a failing batch;
- what derives from a buffer's shape and address alone (its checks, the word width it allows, word
  and record views) is computed once per buffer tensor (`Buffer`) and dropped with the tensor.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

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
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_backend(device_type: str, kernel: str) -> Backend:
    """Triton on CUDA, or on CPU under the interpreter; otherwise the torch reference (logged once)."""
    if device_type == "cuda" or interpreting():
        return "triton"
    if kernel not in _fell_back:
        _fell_back.add(kernel)
        logger.info("%s: tensors on %s and TRITON_INTERPRET!=1, using the torch reference",
                    kernel, device_type)
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


class Batch(NamedTuple):
    """A batch as a host `[size, columns]` int64 tensor, a numpy view of the same memory, and each
    column's min and max."""

    rows: torch.Tensor
    array: np.ndarray
    size: int
    low: list[int]
    high: list[int]

    def uniform(self, *columns: int) -> bool:
        """Whether every row holds the same value in each of `columns`."""
        return all(self.low[c] == self.high[c] for c in columns)


def as_batch(batch: torch.Tensor | Sequence[Sequence[int]], columns: int, what: str) -> Batch:
    """The batch on the host, where validation happens, with its column bounds (one pass)."""
    rows = torch.as_tensor(batch, dtype=torch.int64, device="cpu")
    if rows.numel() == 0:
        rows = rows.reshape(0, columns)
        return Batch(rows, rows.numpy(), 0, [0] * columns, [-1] * columns)
    if rows.dim() != 2 or rows.size(1) != columns:
        raise ValueError(f"{what} must have shape [n, {columns}], got {tuple(rows.shape)}")
    low, high = torch.aminmax(rows, dim=0)
    return Batch(rows, rows.numpy(), rows.size(0), low.tolist(), high.tolist())


def check_pairs(src: Buffer, dst: Buffer, batch: Batch) -> None:
    """Pages in range, one launch's worth of (pair, slot) programs, and within one buffer no page
    both read and written (programs run in no particular order); a non-empty batch."""
    for column, pages, what in ((0, src.pages, "src_page"), (1, dst.pages, "dst_page")):
        if batch.low[column] < 0 or batch.high[column] >= pages:
            values = batch.array[:, column]
            bad = np.unique(values[(values < 0) | (values >= pages)]).tolist()
            raise ValueError(f"{what} out of range [0, {pages}): {shown(bad)}")
    if src.key[0] == dst.key[0] and (both := pages_in_both_columns(batch)):
        raise ValueError(f"pages {shown(both)} are destination pages and also a source page of the "
                         "same batch")
    if batch.size * src.slots > MAX_GRID_X:
        raise ValueError(f"{batch.size} pairs x {src.slots} slots exceed one launch; split the batch")


def pages_in_both_columns(batch: Batch) -> list[int]:
    """Pages listed as a source (column 0) and as a destination (column 1); both validated."""
    if max(batch.low[0], batch.low[1]) > min(batch.high[0], batch.high[1]):
        return []  # the two columns' page ranges do not even interleave
    is_src = np.zeros(max(batch.high[0], batch.high[1]) + 1, dtype=bool)
    is_src[batch.array[:, 0]] = True
    hits = is_src[batch.array[:, 1]]
    return np.unique(batch.array[hits, 1]).tolist() if hits.any() else []


def shown(values: list[int]) -> str:
    """`values` for an error message, cut to the first `SHOWN`."""
    more = f" and {len(values) - SHOWN} more" if len(values) > SHOWN else ""
    return f"{values[:SHOWN]}{more}"


class Records(NamedTuple):
    """Ranges of `size` bytes of a buffer as a 1-D numpy array of `V{size}` records over the same
    memory, one every `unit` bytes: the range at byte `b` of page `p` of slot `s` is record
    `s * slot_step + p * page_step + b // unit` (counting `b` from the view's first byte)."""

    array: np.ndarray
    slot_starts: np.ndarray  # [slots, 1] int64: slot * slot_step
    page_step: int
    unit: int

    def index(self, pages: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray:
        """`[slots, len(pages)]`: the records of `pages` (at `offsets`, multiples of `unit`) in
        every slot."""
        if self.page_step != 1:
            pages = pages * self.page_step
        if offsets is not None:
            pages = pages + offsets // self.unit
        return pages + self.slot_starts


class Buffer:
    """What the launchers derive from a buffer tensor's shape and address alone: its checks, the
    word alignment it allows, its word views and (CPU) record views. Built once per tensor object
    by `buffer()` (a pool's `buffer` is one object for the pool's life), dropped with the tensor.

    Views are taken from a detached alias, so the cache never keeps the tensor object alive.
    """

    MAX_VIEWS = 64  # distinct views kept per buffer

    def __init__(self, t: torch.Tensor, name: str) -> None:
        if t.dtype != torch.uint8 or t.dim() != 3 or (t.size(2) > 1 and t.stride(2) != 1):
            raise ValueError(f"{name} must be a [slots, pages, bytes] uint8 tensor with contiguous "
                             f"bytes, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        self.key = _buffer_key(t)
        self.device_type = t.device.type
        self.slots, self.pages, self.page_bytes = t.shape
        self.align = math.gcd(t.data_ptr(), t.stride(0), t.stride(1), t.size(2))
        self._alias = t.detach()
        self._views: dict[tuple[object, ...], object] = {}

    def words(self, width: int, offset: int = 0, count: int | None = None) -> torch.Tensor:
        """`[slots, pages, count]` words of `width` bytes from word `offset` of every page (default:
        the whole page)."""
        if count is None:
            count = self.page_bytes // width - offset
        view = self._views.get(("words", width, offset, count))
        if view is None:
            view = self._alias.view(_WORD_DTYPES[width]).narrow(2, offset, count)
            self._keep(("words", width, offset, count), view)
        return view  # type: ignore[return-value]

    def records(self, offset: int, count: int) -> Records:
        """Ranges of `count` bytes from byte `offset` of every (slot, page), and from any multiple
        of `count` after it, as numpy records (CPU buffers only)."""
        records = self._views.get(("records", offset, count))
        if records is None:
            records = self._records(offset, count)
            self._keep(("records", offset, count), records)
        return records  # type: ignore[return-value]

    def _records(self, offset: int, count: int) -> Records:
        slot_stride, page_stride = self._alias.stride(0), self._alias.stride(1)
        unit = math.gcd(slot_stride, page_stride, count)
        last = (self.slots - 1) * slot_stride + (self.pages - 1) * page_stride + self.page_bytes
        first = self._alias.numpy()[0, 0, offset:offset + count].view(f"V{count}")
        length = (last - offset - count) // unit + 1  # records that end inside the buffer
        array = np.lib.stride_tricks.as_strided(first, shape=(length,), strides=(unit,))
        slot_starts = (np.arange(self.slots, dtype=np.int64) * (slot_stride // unit))[:, None]
        return Records(array, slot_starts, page_stride // unit, unit)

    def _keep(self, key: tuple[object, ...], view: object) -> None:
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        self._views[key] = view


_buffers: dict[int, Buffer] = {}


def _buffer_key(t: torch.Tensor) -> tuple[int, torch.Size, tuple[int, ...]]:
    return t.data_ptr(), t.shape, t.stride()


def buffer(t: torch.Tensor, name: str = "buffer") -> Buffer:
    """The cached `Buffer` of `t`; rebuilt, checks included, if its address or shape changed."""
    info = _buffers.get(id(t))
    if info is not None and info.key == _buffer_key(t):
        return info
    info = Buffer(t, name)
    if id(t) not in _buffers:  # one finalizer per object: an id is reused only after it ran
        weakref.finalize(t, _buffers.pop, id(t), None)
    _buffers[id(t)] = info
    return info


def check_buffers(src: torch.Tensor, dst: torch.Tensor) -> tuple[Buffer, Buffer]:
    """Both are `[layer_slots, pages, page_bytes]` uint8 on one device with a contiguous last dim."""
    src_buf = buffer(src, "src")
    if dst is src:
        return src_buf, src_buf
    dst_buf = buffer(dst, "dst")
    if src.device != dst.device:
        raise ValueError(f"src on {src.device} but dst on {dst.device}")
    if src_buf.slots != dst_buf.slots:
        raise ValueError(f"src has {src_buf.slots} layer slots but dst has {dst_buf.slots}")
    return src_buf, dst_buf


def word_width(quantities: Sequence[int]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every quantity: addresses (pass each
    buffer's `Buffer.align`), offsets and lengths (or a value they all share a power of two with).

    Moving int64 words instead of bytes cuts the instructions per byte; reinterpreting bits as
    integers never rounds, whatever dtype the pages hold.
    """
    g = math.gcd(*quantities)
    return next(w for w in _WORD_DTYPES if g % w == 0)


def block_rule(max_bytes: int, width: int) -> tuple[int, int]:
    """(words per program iteration, num_warps): the next power of two of the largest range, capped
    at `MAX_BLOCK_BYTES`, with about 8 words per thread."""
    block_bytes = min(MAX_BLOCK_BYTES, 1 << max(0, max_bytes - 1).bit_length())
    block = max(1, block_bytes // width)
    return block, min(8, max(1, block // 256))


def chunks(words: int, block: int) -> int:
    """Programs along one range: enough to cover it, capped; each program strides over the rest."""
    return max(1, min(MAX_GRID_YZ, -(-words // block)))
