"""Where every byte of a page lives, derived from `ModelSpec` and `CacheSpec` only.

The pool buffer is `[layer_slots, num_pages, page_bytes]` bytes. A page id addresses one page per layer
slot; the page belongs to one cache group, whose layer `i` uses slot `i`. Inside one slot:

- a full-attention page (`PageKind.MLA`, MLA or GQA) is token-major `[page_tokens, token row]`, so
  the first `T` tokens are the byte prefix `[0, T * mla_token_bytes)`: a copy-on-write of a
  partially matched page is one prefix copy. An MLA token row is the latent (replicated on every
  rank); a GQA token row is this rank's KV heads one after the other, each head's K then V
  (`[kv_heads_per_rank, 2, head_dim]`), so a run of KV heads is one byte run per token;
- a linear-attention page (`PageKind.KDA`, KDA or GDN) holds both parts of one layer's state on
  this rank, conv first as vLLM packs its state page: the conv block `[conv_rank_channels,
  conv_kernel - 1]` (channel-major: this rank's key heads' q channels, then their k channels,
  then its value heads' v channels, each channel's last inputs contiguous), then the recurrent
  part, head-major: this rank's value heads one after the other, each head's `[K, V]` state
  stored value-major (`[V, K]`, the order vLLM's gated-delta-net state uses), so each head's
  recurrent stream is self-contained. A run of value heads (with the key heads they share, GDN
  has fewer) owns one run of recurrent bytes and three runs of conv rows (its q, k and v
  channels): the unit of transfer and re-sharding.

The two layouts deliberately disagree: a KDA state read as MLA tokens (or the reverse) comes out
transposed inside each head, not as a plausible reshape of the right data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from cachetier.config import DTYPE_BYTES, CacheSpec, ModelSpec, PageGeometry, page_geometry


class PageKind(enum.IntEnum):
    """What a page currently holds; stored as one byte per page in the pool's tag array. `MLA`
    tags any full-attention page (MLA or GQA), `KDA` any linear-attention state page (KDA or
    GDN): the names are the wire's ("mla", "kda")."""

    UNTAGGED = 0
    MLA = 1
    KDA = 2


@dataclass(frozen=True)
class ByteRange:
    """A half-open byte range `[offset, offset + size)`."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size

    def overlaps(self, other: ByteRange) -> bool:
        return self.offset < other.end and other.offset < self.end


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of `config.DTYPE_BYTES`'s names."""
    return getattr(torch, name)


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one tensor-parallel rank's pool (the rank only picks which heads it holds)."""

    model: ModelSpec
    cache: CacheSpec
    geometry: PageGeometry

    @classmethod
    def from_specs(cls, model: ModelSpec, cache: CacheSpec) -> PageLayout:
        layout = cls(model, cache, page_geometry(model, cache))
        for name in (model.mla_dtype, model.kda_state_dtype, model.conv_dtype):
            if layout.page_bytes % DTYPE_BYTES[name]:
                raise ValueError(f"page_bytes={layout.page_bytes} is not a multiple of the {name} "
                                 "element size: typed views of later pages would be misaligned")
        if model.kda_rank_conv_bytes % DTYPE_BYTES[model.kda_state_dtype]:
            raise ValueError(f"the {model.kda_rank_conv_bytes}-byte conv block is not a multiple "
                             f"of the {model.kda_state_dtype} element size: the recurrent part "
                             "after it would be misaligned")
        return layout

    @property
    def layer_slots(self) -> int:
        return self.geometry.layer_slots

    @property
    def num_pages(self) -> int:
        return self.cache.num_pages

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes

    @property
    def buffer_shape(self) -> tuple[int, int, int]:
        return (self.layer_slots, self.num_pages, self.page_bytes)

    @property
    def buffer_bytes(self) -> int:
        return self.layer_slots * self.num_pages * self.page_bytes

    @property
    def mla_dtype(self) -> torch.dtype:
        return torch_dtype(self.model.mla_dtype)

    @property
    def kda_dtype(self) -> torch.dtype:
        return torch_dtype(self.model.kda_state_dtype)

    @property
    def conv_dtype(self) -> torch.dtype:
        return torch_dtype(self.model.conv_dtype)

    @property
    def head_bytes(self) -> int:
        return self.model.kda_head_bytes

    @property
    def recurrent_offset(self) -> int:
        """Where the recurrent part starts in a KDA page slot: right after the conv block."""
        return self.model.kda_rank_conv_bytes

    def rank_heads(self, rank: int) -> range:
        """Global ids of the KDA heads that `rank` holds, in storage order."""
        if not 0 <= rank < self.model.tp_degree:
            raise ValueError(f"rank {rank} out of range for tp_degree={self.model.tp_degree}")
        per_rank = self.model.heads_per_rank
        return range(rank * per_rank, (rank + 1) * per_rank)

    def kda_head_range(self, head: int, rank: int = 0) -> ByteRange:
        """Bytes of global head `head`'s stream inside one layer slot of a KDA page of `rank`."""
        heads = self.rank_heads(rank)
        if head not in heads:
            raise ValueError(f"head {head} is not on rank {rank} (holds heads "
                             f"[{heads.start}, {heads.stop}))")
        return ByteRange(self.recurrent_offset + (head - heads.start) * self.head_bytes,
                         self.head_bytes)

    def rank_key_heads(self, rank: int) -> range:
        """Global ids of the key heads that `rank` holds (the value heads' shared keys)."""
        heads = self.rank_heads(rank)
        return self.key_heads_of(heads)

    def key_heads_of(self, heads: range) -> range:
        """The key heads value heads `heads` read: a run of whole key-head groups (GDN shares
        one key head among `value_heads_per_key_head` value heads; KDA: the same run)."""
        group = self.model.value_heads_per_key_head
        if heads.start % group or heads.stop % group:
            raise ValueError(f"value heads [{heads.start}, {heads.stop}) split a group of "
                             f"{group} sharing one key head")
        return range(heads.start // group, heads.stop // group)

    def conv_rows(self, heads: range, rank: int = 0) -> list[tuple[range, range]]:
        """The conv channels of global value heads `heads` (all on `rank`) and of the key heads
        they read: one `(global channels, channels in rank's conv block)` pair per part q, k
        (key heads), v (value heads), in that order. Global channels are numbered as in the
        unsharded layer, all key heads' q, then k, then all value heads' v (vLLM's `conv_dim`)."""
        held = self.rank_heads(rank)
        if heads.start < held.start or heads.stop > held.stop:
            raise ValueError(f"heads [{heads.start}, {heads.stop}) are not all on rank {rank} "
                             f"(holds heads [{held.start}, {held.stop}))")
        keys, held_keys = self.key_heads_of(heads), self.key_heads_of(held)
        rows, global_base, local_base = [], 0, 0
        for (total, width), part, part_held in zip(self.model.conv_parts, (keys, keys, heads),
                                                   (held_keys, held_keys, held)):
            first_global = global_base + part.start * width
            first_local = local_base + (part.start - part_held.start) * width
            rows.append((range(first_global, first_global + len(part) * width),
                         range(first_local, first_local + len(part) * width)))
            global_base += total * width
            local_base += len(part_held) * width
        return rows

    def conv_range(self, channels: range) -> ByteRange:
        """Bytes of the rows of local conv channels `channels` inside one layer slot of a KDA
        page."""
        if not 0 <= channels.start <= channels.stop <= self.model.conv_rank_channels:
            raise ValueError(f"conv channels [{channels.start}, {channels.stop}) outside a "
                             f"{self.model.conv_rank_channels}-channel conv block")
        row = self.model.conv_row_bytes
        return ByteRange(channels.start * row, len(channels) * row)

    def rank_attn_heads(self, rank: int) -> range:
        """The full-attention units `rank` holds: its KV heads (GQA; one replicated head per
        `tp_degree / kv_heads` ranks when the degree exceeds them), or the latent (MLA: unit 0,
        on every rank)."""
        model = self.model
        if not 0 <= rank < model.tp_degree:
            raise ValueError(f"rank {rank} out of range for tp_degree={model.tp_degree}")
        per_rank = model.attn_heads_per_rank
        first = rank * model.attn_heads // model.tp_degree // per_rank * per_rank
        return range(first, first + per_rank)

    def mla_token_range(self, start: int, stop: int) -> ByteRange:
        """Bytes of tokens `[start, stop)` inside one layer slot of an MLA page."""
        if not 0 <= start <= stop <= self.cache.page_tokens:
            raise ValueError(f"token range [{start}, {stop}) outside a "
                             f"{self.cache.page_tokens}-token page")
        token_bytes = self.model.mla_token_bytes
        return ByteRange(start * token_bytes, (stop - start) * token_bytes)

    def buffer_range(self, page: int, slot: int, within: ByteRange) -> ByteRange:
        """Where `within` (a range inside one slot of `page`) lies in the flat pool buffer."""
        self.check_page(page)
        if not 0 <= slot < self.layer_slots:
            raise ValueError(f"layer slot {slot} out of range [0, {self.layer_slots})")
        if within.offset < 0 or within.end > self.page_bytes:
            raise ValueError(f"{within} does not fit in a {self.page_bytes}-byte page")
        return ByteRange((slot * self.num_pages + page) * self.page_bytes + within.offset, within.size)

    def check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
