"""Batched copy kernels (Triton), each with a plain torch reference that is also its fallback.

Kernels move bytes; they know layouts, never metadata. `page_copy` moves byte ranges between pool
pages of one layout: its launcher validates its batch on the host (a few vectorised passes,
whatever the batch size), runs Triton on CUDA (or under `TRITON_INTERPRET=1` on CPU) and otherwise
falls back to its reference beside it (torch, and numpy record views of the same memory on CPU),
returning which backend ran. `tile_copy` moves strided tiles between views of two layouts (vLLM's
KV cache and the pool's pages, transposes included); its caller, `cachetier.vllm.kv_copy`, picks
the backend with the same rule (`_launch.pick_backend`) and holds the reference and fallback, its
torch indexed copies over the same views.

Re-sharding between tensor-parallel degrees needs no kernel: heads are stored in ascending order in
every rank's layout, so the heads two ranks share are one run of recurrent bytes and three runs of
conv rows (q, k, v) on each side, and the transfer path (`gpu_pool.streams.plan_fetch`) reads each
at its source offset and writes it at its destination offset.
"""

from kernels._launch import Backend
from kernels.page_copy import page_copy
from kernels.tile_copy import tile_copy

__all__ = ["Backend", "page_copy", "tile_copy"]
