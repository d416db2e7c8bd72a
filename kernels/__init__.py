"""Batched page-copy kernels (Triton) with a plain reference beside each one.

Kernels move bytes between pages of the pool; they know layouts, never metadata. Each launcher
validates its batch on the host (a few vectorised passes, whatever the batch size), runs Triton on
CUDA (or under `TRITON_INTERPRET=1` on CPU) and otherwise falls back to its reference (torch, and
numpy record views of the same memory on CPU), returning which backend ran.

Re-sharding between tensor-parallel degrees needs no kernel: heads are stored in ascending order in
every rank's layout, so the heads two ranks share are one run of recurrent bytes and three runs of
conv rows (q, k, v) on each side, and the transfer path (`gpu_pool.streams.plan_fetch`) reads each
at its source offset and writes it at its destination offset.
"""

from kernels._launch import Backend
from kernels.page_copy import page_copy

__all__ = ["Backend", "page_copy"]
