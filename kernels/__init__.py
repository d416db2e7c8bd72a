"""Batched page-copy kernels (Triton) with a plain reference beside each one.

Kernels move bytes between pages of the pool; they know layouts, never metadata. Each launcher
validates its batch on the host (a few vectorised passes, whatever the batch size), runs Triton on
CUDA (or under `TRITON_INTERPRET=1` on CPU) and otherwise falls back to its reference (torch, and
numpy record views of the same memory on CPU), returning which backend ran.
"""

from kernels._launch import Backend
from kernels.head_reshard import head_reshard
from kernels.page_copy import page_copy

__all__ = ["Backend", "head_reshard", "page_copy"]
