"""`PagedPool`: the one byte buffer that holds every page, and typed views into it.

The agent creates the pool; a co-located worker attaches through a picklable `PoolHandle` and sees
the same memory (no copy). The pool holds bytes and per-page type tags only: which page is free,
shared or owned by whom is decided by the control plane, never here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from cachetier.config import CacheSpec, ModelSpec
from gpu_pool.claims import CLAIM_BYTES, PageClaims
from gpu_pool.fence import FENCE_BYTES, WriterFence
from gpu_pool.layout import PageKind, PageLayout
from gpu_pool.sharing import CudaIpc, HostShm


class PageKindError(RuntimeError):
    """A page was viewed as a type it is not tagged with (debug mode): the page metadata is corrupt."""


@dataclass(frozen=True)
class PoolHandle:
    """Everything a worker needs to attach to a pool; picklable with plain `pickle`."""

    model: ModelSpec
    cache: CacheSpec
    debug: bool
    data: HostShm | CudaIpc
    tags: HostShm
    fence: HostShm  # the writers' epoch fence (`gpu_pool.fence.WriterFence`)
    claims: HostShm  # which step may write each page (`gpu_pool.claims.PageClaims`)


class PagedPool:
    """A `[layer_slots, num_pages, page_bytes]` uint8 buffer on CPU or one CUDA device.

    In debug mode every view checks the page's type tag (set by the owner with `tag`), so a page id
    that reaches the wrong cache group fails loudly instead of reading the other layout's bytes.
    """

    def __init__(self, handle: PoolHandle, flat: torch.Tensor, *, owner: bool) -> None:
        self.layout = PageLayout.from_specs(handle.model, handle.cache)
        self.buffer = flat.view(self.layout.buffer_shape)
        self.debug = handle.debug
        self._handle = handle
        self._tags = handle.tags.open()
        self.fence = WriterFence(handle.fence.path)
        self.claims = PageClaims(handle.claims.path)
        self._cleanup = weakref.finalize(self, _unlink, handle) if owner else None

    @classmethod
    def create(cls, model: ModelSpec, cache: CacheSpec, device: str | torch.device = "cpu", *,
               debug: bool = False) -> PagedPool:
        """Allocate a zeroed pool; the caller owns it and must keep it alive while workers use it."""
        layout = PageLayout.from_specs(model, cache)
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported pool device {device}; expected cpu or cuda")
        tags = HostShm.create(layout.num_pages, "cachetier-tags")
        fence = HostShm.create(FENCE_BYTES, "cachetier-fence")
        claims = HostShm.create(layout.num_pages * CLAIM_BYTES, "cachetier-claims")
        try:
            data, flat = _allocate(layout.buffer_bytes, device)
        except BaseException:
            for segment in (tags, fence, claims):
                segment.unlink()
            raise
        return cls(PoolHandle(model, cache, debug, data, tags, fence, claims), flat, owner=True)

    @classmethod
    def attach(cls, handle: PoolHandle) -> PagedPool:
        """Map an existing pool (from another process) without copying its bytes."""
        return cls(handle, handle.data.open(), owner=False)

    def handle(self) -> PoolHandle:
        return self._handle

    def close(self) -> None:
        """Owner: remove the shared names (existing mappings stay valid). Attached pools: no-op."""
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> PagedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def writing(self, epoch: int, stamp: int, pages: Sequence[int]) -> Iterator[None]:
        """Write `pages` for a step of `epoch` stamped `stamp` (`index.tickets.write_stamp` of
        its plan's ticket) in place: refused (`StaleOrder`) once the agent has fenced that epoch
        off (`gpu_pool.fence`), or once one of the pages was handed to a later step, its
        request being over (`gpu_pool.claims`); the fence and the claims wait for the section
        to end; on a GPU the section ends once the current stream has finished its writes.
        Hold it around the writes only, never across a call to the service."""
        with self.fence.writing(epoch), self.claims.writing(stamp, pages):
            yield
            if self.buffer.is_cuda:
                torch.cuda.current_stream(self.buffer.device).synchronize()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def tag(self, page: int, kind: PageKind) -> None:
        """Record what `page` now holds; the owner calls this when it assigns the page to a group."""
        self.layout.check_page(page)
        self._tags[page] = int(kind)

    def kind(self, page: int) -> PageKind:
        self.layout.check_page(page)
        return PageKind(int(self._tags[page]))

    def mla_view(self, page: int) -> torch.Tensor:
        """`[layer_slots, page_tokens, row]` of `mla_dtype`, a full-attention page: a view of the
        page, not a copy. A row is the MLA latent, or this rank's GQA KV heads, each K then V
        (`[kv_heads_per_rank, 2, head_dim]` flattened)."""
        self._check(page, PageKind.MLA)
        layout, model = self.layout, self.layout.model
        raw = self.buffer[:, page, :layout.geometry.mla_page_bytes]
        return raw.view(layout.mla_dtype).view(layout.layer_slots, layout.cache.page_tokens,
                                               model.attn_heads_per_rank * model.attn_head_elems)

    def kda_view(self, page: int, heads: slice | None = None) -> torch.Tensor:
        """`[layer_slots, heads, K, V]` of `kda_state_dtype`, the recurrent part of a KDA page
        (strided: storage is `[V, K]` per head).

        `heads` slices this rank's heads by local index (0 is the rank's first head).
        """
        self._check(page, PageKind.KDA)
        layout, model = self.layout, self.layout.model
        if not model.kda_groups:
            raise ValueError(f"model {model.name!r} has no KDA groups")
        start, stop = _head_bounds(heads, model.heads_per_rank)
        base = layout.recurrent_offset
        raw = self.buffer[:, page, base + start * layout.head_bytes:base + stop * layout.head_bytes]
        state = raw.view(layout.kda_dtype).view(layout.layer_slots, stop - start,
                                                model.kda_head_v_dim, model.kda_head_k_dim)
        return state.transpose(-1, -2)

    def conv_view(self, page: int) -> torch.Tensor:
        """`[layer_slots, conv_rank_channels, conv_kernel - 1]` of `conv_dtype`: the conv part of
        a KDA page (this rank's q, then k, then v channels), a view of the page, not a copy."""
        self._check(page, PageKind.KDA)
        layout, model = self.layout, self.layout.model
        if not model.kda_groups:
            raise ValueError(f"model {model.name!r} has no KDA groups")
        raw = self.buffer[:, page, :model.kda_rank_conv_bytes]
        return raw.view(layout.conv_dtype).view(layout.layer_slots, model.conv_rank_channels,
                                                model.conv_kernel - 1)

    def _check(self, page: int, expected: PageKind) -> None:
        self.layout.check_page(page)
        if self.debug and (actual := self.kind(page)) is not expected:
            raise PageKindError(f"page {page} is tagged {actual.name} "
                                f"but was viewed as {expected.name}")


def _allocate(nbytes: int, device: torch.device) -> tuple[HostShm | CudaIpc, torch.Tensor]:
    if device.type == "cpu":
        shm = HostShm.create(nbytes)
        return shm, shm.open()
    flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return CudaIpc.export(flat), flat


def _head_bounds(heads: slice | None, count: int) -> tuple[int, int]:
    if heads is None:
        return 0, count
    start, stop, step = heads.indices(count)
    if step != 1 or stop < start:
        raise ValueError(f"heads must be a contiguous forward slice, got {heads}")
    return start, stop


def _unlink(handle: PoolHandle) -> None:
    handle.tags.unlink()
    handle.fence.unlink()
    handle.claims.unlink()
    if isinstance(handle.data, HostShm):
        handle.data.unlink()
