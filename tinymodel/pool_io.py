"""The model's only contact with cached state: typed reads and writes of pool pages.

Everything a chunk reuses from earlier chunks or from other requests passes through these functions,
so the oracle (`TinyHybrid.recompute`, which never calls them) checks exactly the bytes the cluster
stored, restored and copied. Reads go through `PagedPool`'s typed views, so a debug pool refuses a
page of the wrong kind, and a non-debug pool returns the other layout's bytes (visible garbage).

A model of tensor-parallel degree n runs over n pools, one per rank, sharing one page table (a page
id names the same page on every rank, as the index hands them out). A pool does not know its rank
(its agent does), so the caller's order is the rank order. Each rank's KDA pages hold both state
parts of its own heads, as `PageLayout.rank_heads` assigns them: their recurrent matrices and
their q, k and v conv rows (`PageLayout.conv_rows`). Full-attention rows follow
`PageLayout.rank_attn_heads`: an MLA latent is replicated (written to every rank, read from rank
0), GQA KV heads are split (each rank its heads, replicated past `kv_heads` ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_pool.pool import PagedPool
from tinymodel.state import KdaState
from tinymodel.weights import Dims


class PoolMismatch(ValueError):
    """The pool's page layout does not hold this model's caches."""


def checked_ranks(dims: Dims, pools: PagedPool | Sequence[PagedPool]) -> list[PagedPool]:
    """The ranks' pools in rank order (a lone pool is the only rank of TP=1), once they are
    checked to be ranks 0..n-1 of one layout that holds this model: a pool of another degree or
    model would otherwise be read at the wrong head offsets without any error."""
    ranks = [pools] if isinstance(pools, PagedPool) else list(pools)
    if not ranks:
        raise PoolMismatch("no pool given: a model runs over at least one rank")
    for pool in ranks:
        check_pool(dims, pool)
    layout = ranks[0].layout
    if layout.model.tp_degree != len(ranks):
        raise PoolMismatch(f"{len(ranks)} pools given for a layout of tp_degree="
                           f"{layout.model.tp_degree}: one pool per rank is needed")
    other = [rank for rank, pool in enumerate(ranks) if pool.layout != layout]
    if other:
        raise PoolMismatch(f"ranks {other} are laid out for another model or cache than rank 0")
    if len({id(pool) for pool in ranks}) != len(ranks):
        raise PoolMismatch("one pool is given for two ranks: their heads would overwrite each "
                           "other")
    return ranks


def check_pool(dims: Dims, pool: PagedPool) -> None:
    """Compare the model's cache sizes with the pool's layout, naming every difference: a pool laid
    out for another model would otherwise be read at the wrong offsets without any error."""
    spec = pool.layout.model
    expected = {
        "kda_groups": (dims.kda_groups, spec.kda_groups),
        "mla_groups": (dims.mla_groups, spec.mla_groups),
        "layer slots": (dims.blocks, pool.layout.layer_slots),
        "KDA heads": (dims.kda_heads, spec.kda_heads),
        "attention kind": (dims.attention_kind, spec.attention_kind),
        "attention units per token": (dims.attn_units, spec.attn_heads),
        "attention unit bytes": (dims.attn_unit_elems * 4, spec.attn_head_bytes),
        "MLA dtype": (torch.float32, pool.layout.mla_dtype),
    }
    if dims.kda_groups:
        expected["linear-attention kind"] = (dims.linear_kind, spec.linear_kind)
        expected["key heads"] = (dims.key_heads, spec.key_heads)
        expected["KDA head bytes"] = (dims.kda_k * dims.kda_v * 4, pool.layout.head_bytes)
        expected["KDA head [K, V]"] = ((dims.kda_k, dims.kda_v),
                                       (spec.kda_head_k_dim, spec.kda_head_v_dim))
        expected["KDA dtype"] = (torch.float32, pool.layout.kda_dtype)
        expected["conv kernel"] = (dims.conv_kernel, spec.conv_kernel)
        expected["conv channels"] = (dims.conv_channels, spec.conv_channels)
        expected["conv dtype"] = (torch.float32, pool.layout.conv_dtype)
    wrong = [f"{name}: model {ours}, pool {theirs}"
             for name, (ours, theirs) in expected.items() if ours != theirs]
    if wrong:
        raise PoolMismatch(f"pool layout of model {spec.name!r} does not fit the tiny model: "
                           + "; ".join(wrong))


def read_states(ranks: Sequence[PagedPool], page: int) -> KdaState:
    """A contiguous copy of both parts of every layer's state in one KDA page, `[layer_slots, C,
    kernel - 1]` and `[layer_slots, H, K, V]`, every rank contributing its heads' conv rows and
    recurrent matrices (stored value-major per head): one read per rank, page and chunk."""
    layout = ranks[0].layout
    model = layout.model
    state = KdaState(torch.empty(layout.layer_slots, model.conv_channels, model.conv_kernel - 1),
                     torch.empty(layout.layer_slots, model.kda_heads, model.kda_head_k_dim,
                                 model.kda_head_v_dim))
    for rank, pool in enumerate(ranks):
        heads = layout.rank_heads(rank)
        conv = pool.conv_view(page)
        for ours, theirs in layout.conv_rows(heads, rank):
            state.conv[:, ours.start:ours.stop].copy_(conv[:, theirs.start:theirs.stop])
        state.recurrent[:, heads.start:heads.stop].copy_(pool.kda_view(page))
    return state


def write_states(ranks: Sequence[PagedPool], page: int, state: KdaState) -> None:
    """Store both parts of every layer's state into one KDA page: each rank's heads' conv rows and
    recurrent matrices into that rank's pool."""
    for rank, pool in enumerate(ranks):
        heads = pool.layout.rank_heads(rank)
        conv = pool.conv_view(page)
        for ours, theirs in pool.layout.conv_rows(heads, rank):
            conv[:, theirs.start:theirs.stop].copy_(state.conv[:, ours.start:ours.stop])
        pool.kda_view(page).copy_(state.recurrent[:, heads.start:heads.stop])


def _spans(pages: Sequence[int], page_tokens: int, start: int,
           stop: int) -> list[tuple[int, int, int, int]]:
    """`(page, first, last, done)` pieces of positions [start, stop): tokens [first, last) of
    `page` hold positions [start + done, start + done + last - first)."""
    spans, pos = [], start
    while pos < stop:
        index, first = divmod(pos, page_tokens)
        last = min(page_tokens, first + stop - pos)
        spans.append((pages[index], first, last, pos - start))
        pos += last - first
    return spans


def write_rows(ranks: Sequence[PagedPool], pages: Sequence[int], slot: int, start: int,
               rows: torch.Tensor) -> None:
    """Store `rows [T, units, elems]` as positions [start, start + T) of one layer of a page
    table, each rank its own units (`PageLayout.rank_attn_heads`: the MLA latent on every rank,
    a GQA rank its KV heads)."""
    page_tokens = ranks[0].layout.cache.page_tokens
    for page, first, last, done in _spans(pages, page_tokens, start, start + rows.shape[0]):
        for rank, pool in enumerate(ranks):
            units = pool.layout.rank_attn_heads(rank)
            part = rows[done:done + last - first, units.start:units.stop]
            pool.mla_view(page)[slot, first:last].copy_(part.flatten(1))


def read_rows(ranks: Sequence[PagedPool], pages: Sequence[int], slot: int,
              stop: int) -> torch.Tensor:
    """Positions [0, stop) of one layer of a page table, as a new `[stop, units, elems]` tensor
    (stop>0), each unit read from the first rank that holds it."""
    layout = ranks[0].layout
    model = layout.model
    rows = torch.empty(stop, model.attn_heads, model.attn_head_elems)
    filled = 0
    for rank, pool in enumerate(ranks):
        units = layout.rank_attn_heads(rank)
        if units.stop <= filled:
            continue
        for page, first, last, done in _spans(pages, layout.cache.page_tokens, 0, stop):
            piece = pool.mla_view(page)[slot, first:last].view(last - first, len(units), -1)
            rows[done:done + last - first, units.start:units.stop].copy_(piece)
        filled = units.stop
    return rows
