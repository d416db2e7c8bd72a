"""Which byte streams one destination rank pulls from which source rank to receive a set of pages.

The unit of transfer is one byte stream within one (page, layer slot). A linear-attention (KDA or
GDN) page of a source rank of TP degree `s` holds value heads `[r*H/s, (r+1)*H/s)` and the key
heads they share; the value heads it shares with a destination rank of degree `d` are one
contiguous run on both sides, which owns one run of recurrent bytes and three runs of conv rows
(the q and k channels of its key heads, the v channels of its value heads: the conv block is
channel-major, q then k then v, as vLLM's `conv_dim`). Each run is read at its offset in the
source layout and written at its offset in the destination layout: the re-sharding is the choice
of offsets, nothing is reshuffled afterwards. Runs adjacent on both sides are merged, so a page
between equal degrees is still one stream per slot, and between different degrees at most four.

A full-attention page is token-major. An MLA page (the latent is replicated on every rank) and a
GQA page whose source and destination ranks hold the same KV heads are one stream per slot (the
filled token prefix); a GQA page re-sharded between degrees that split the KV heads differently
is one stream per token (the shared heads' K and V of that token). A destination rank pulls each
run of heads from one source rank holding it (spread over the replicas).

Both pools must hold the same model up to the TP degree: same heads, head shapes and dtypes, same
tokens per page. Everything is checked here, before a byte moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from gpu_pool.layout import ByteRange, PageKind, PageLayout


KIND_NAMES = {"kda": PageKind.KDA, "mla": PageKind.MLA}


@dataclass(frozen=True)
class PageMove:
    """Page `src` of the source pool lands in page `dst` of the destination pool. `nbytes` limits
    an MLA page to its first bytes (a filled token prefix); 0 means the whole page."""

    src: int
    dst: int
    kind: PageKind
    nbytes: int = 0

    @classmethod
    def parse(cls, src: int, dst: int, kind: str, nbytes: int) -> PageMove:
        """A move from its wire row (`protocol.Fetch.moves`)."""
        if kind not in KIND_NAMES:
            raise ValueError(f"page {src}: unknown page kind {kind!r}; expected one of "
                             f"{sorted(KIND_NAMES)}")
        return cls(src, dst, KIND_NAMES[kind], nbytes)

    def row(self) -> tuple[int, int, str, int]:
        return (self.src, self.dst, self.kind.name.lower(), self.nbytes)


@dataclass(frozen=True)
class Stream:
    """`nbytes` at `src_offset` of layer slot `slot` of source page `src_page`, to be written at
    `dst_offset` of the same slot of destination page `dst_page`."""

    src_page: int
    slot: int
    src_offset: int
    nbytes: int
    dst_page: int
    dst_offset: int

    def dst_range(self, layout: PageLayout) -> ByteRange:
        return layout.buffer_range(self.dst_page, self.slot, ByteRange(self.dst_offset, self.nbytes))

    def src_range(self, layout: PageLayout) -> ByteRange:
        return layout.buffer_range(self.src_page, self.slot, ByteRange(self.src_offset, self.nbytes))


def check_compatible(src: PageLayout, dst: PageLayout) -> None:
    """Refuse pools whose pages do not describe the same model state."""
    same_model = dataclasses.replace(src.model, tp_degree=dst.model.tp_degree) == dst.model
    if not same_model or src.cache.page_tokens != dst.cache.page_tokens:
        raise ValueError(f"pools of different models cannot exchange pages: {src.model} with "
                         f"{src.cache.page_tokens}-token pages vs {dst.model} with "
                         f"{dst.cache.page_tokens}-token pages")


def plan_fetch(src: PageLayout, dst: PageLayout, dst_rank: int,
               moves: Iterable[PageMove]) -> dict[int, list[Stream]]:
    """The streams destination rank `dst_rank` pulls, by source rank (ranks with none are left
    out). Raises `ValueError` naming the first move that does not fit either layout."""
    check_compatible(src, dst)
    dst_heads = dst.rank_heads(dst_rank)
    src_tp = src.model.tp_degree
    shared = [(rank, _overlap(src.rank_heads(rank), dst_heads)) for rank in range(src_tp)]
    attn_sources = _attention_sources(src, dst.rank_attn_heads(dst_rank), dst_rank)
    by_rank: dict[int, list[Stream]] = {}
    for move in moves:
        src.check_page(move.src)
        dst.check_page(move.dst)
        if move.kind is PageKind.KDA:
            for rank, heads in shared:
                if heads:
                    by_rank.setdefault(rank, []).extend(_kda_streams(src, rank, dst, dst_rank,
                                                                     move, heads))
        elif move.kind is PageKind.MLA:
            for rank, heads in attn_sources:
                by_rank.setdefault(rank, []).extend(_attention_streams(src, rank, dst, dst_rank,
                                                                       move, heads))
        else:
            raise ValueError(f"page {move.src}: cannot transfer a page of kind {move.kind!r}")
    return by_rank


def _attention_sources(src: PageLayout, wanted: range, dst_rank: int) -> list[tuple[int, range]]:
    """`(source rank, heads)` covering the full-attention heads `wanted` once: each distinct run
    of source heads that overlaps them, from the replica `dst_rank` picks (so destination ranks
    spread over the source ranks holding the same heads)."""
    replicas: dict[range, list[int]] = {}
    for rank in range(src.model.tp_degree):
        replicas.setdefault(src.rank_attn_heads(rank), []).append(rank)
    return [(ranks[dst_rank % len(ranks)], _overlap(held, wanted))
            for held, ranks in replicas.items() if _overlap(held, wanted)]


def _overlap(a: range, b: range) -> range:
    start = max(a.start, b.start)
    return range(start, max(start, min(a.stop, b.stop)))


def _kda_streams(src: PageLayout, src_rank: int, dst: PageLayout, dst_rank: int, move: PageMove,
                 heads: range) -> list[Stream]:
    if not src.model.kda_groups:
        raise ValueError(f"page {move.src}: model {src.model.name!r} has no KDA pages")
    if move.nbytes:
        raise ValueError(f"page {move.src}: a KDA page moves whole (nbytes must be 0)")
    runs = [(src.conv_range(ours), dst.conv_range(theirs))
            for (_, ours), (_, theirs) in zip(src.conv_rows(heads, src_rank),
                                              dst.conv_rows(heads, dst_rank))]
    recurrent = ByteRange(src.kda_head_range(heads.start, src_rank).offset,
                          len(heads) * src.head_bytes)
    runs.append((recurrent, ByteRange(dst.kda_head_range(heads.start, dst_rank).offset,
                                      recurrent.size)))
    merged = _merge_runs(runs)
    return [Stream(move.src, slot, a.offset, a.size, move.dst, b.offset)
            for slot in range(src.layer_slots) for a, b in merged]


def _merge_runs(runs: list[tuple[ByteRange, ByteRange]]) -> list[tuple[ByteRange, ByteRange]]:
    """Drop empty runs and join each run to the previous one where both sides continue it."""
    merged: list[tuple[ByteRange, ByteRange]] = []
    for a, b in runs:
        if not a.size:
            continue
        if merged and merged[-1][0].end == a.offset and merged[-1][1].end == b.offset:
            last_a, last_b = merged.pop()
            a = ByteRange(last_a.offset, last_a.size + a.size)
            b = ByteRange(last_b.offset, last_b.size + b.size)
        merged.append((a, b))
    return merged


def _attention_streams(src: PageLayout, src_rank: int, dst: PageLayout, dst_rank: int,
                       move: PageMove, heads: range) -> list[Stream]:
    """The heads `heads` of every token of the page's filled prefix (`move.nbytes` counts the
    source's token rows): one stream per slot when both sides hold exactly these heads, else one
    per token."""
    whole = src.geometry.mla_page_bytes
    nbytes = move.nbytes or whole
    token = src.model.mla_token_bytes
    if not 0 < nbytes <= whole or nbytes % token:
        raise ValueError(f"page {move.src}: an MLA prefix of {nbytes} bytes is not a whole number "
                         f"of {token}-byte tokens within the {whole}-byte page")
    src_held, dst_held = src.rank_attn_heads(src_rank), dst.rank_attn_heads(dst_rank)
    if heads == src_held == dst_held:
        runs = [(0, 0, nbytes)]
    else:
        head, dst_token = src.model.attn_head_bytes, dst.model.mla_token_bytes
        src_at = (heads.start - src_held.start) * head
        dst_at = (heads.start - dst_held.start) * head
        runs = [(t * token + src_at, t * dst_token + dst_at, len(heads) * head)
                for t in range(nbytes // token)]
    return [Stream(move.src, slot, a, size, move.dst, b)
            for slot in range(src.layer_slots) for a, b, size in runs]
