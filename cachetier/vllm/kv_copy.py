"""Bytes between vLLM's KV cache blocks and cachetier's pool pages, one batch per direction.

Both sides are seen through typed, strided views of their own buffers (no copy to make a view):

- vLLM's attention layer, as K and V `[blocks, block_tokens, kv_heads, head_dim]`. The CPU backend
  stores a block head-major, each head's K part then its V part (the tensor vLLM hands the
  connector is `[blocks, heads, block_tokens, 2 x head_dim]`), and its "vec" kernels keep K
  transposed, dim-major (`[head_dim, block_tokens]`: one dim of every token, then the next), V
  token-major (`[block_tokens, head_dim]`), as `cpu_attn_reshape_and_cache` writes them. A view
  that took K for token rows still moved whole blocks exactly (any consistent view does), but
  the rows of part of a block (a prompt tail at 128 tokens) were other bytes: a tail restore
  left K entries of the block unwritten, up to 0.03 nats off vLLM's own reuse on the first
  token. Its "amx" kernels (bfloat16 on a CPU with AMX tiles) pack both in tiles: K by groups of
  16 tokens, each `[head_dim / 2, 16, 2]` (pairs of dims side by side per token), V as
  `[head_dim / 16, block_tokens / 2, 16, 2]` (pairs of tokens side by side per dim), read off
  what `cpu_attn_reshape_and_cache` writes. A token row of those is no single stride, so a tiled
  part is addressed by `(block, row // tile, row % tile)` (`AttentionViews.key_tile`).
  The CUDA flash-attention layout is `[2, blocks, block_tokens, heads, head_dim]`. The pool's
  full-attention page is token-major, each token row this rank's heads one after the other, K
  then V (`gpu_pool.layout`).
- vLLM's MLA layer (DeepSeek-style full-attention models), one latent per token, token-major
  (`[blocks, 1, block_tokens, latent]`) on every backend, as the pool's MLA page: rows move as
  they are, a one-part `AttentionViews`.
- vLLM's GDN layer, one raw block per state: the conv part first (`[kernel - 1, channels]`, vLLM's
  default "SD" conv layout), then the recurrent part (`[heads, V, K]`), as its hybrid allocator
  packs them. The pool's state page has the same order, conv rows channel-major (`[channels,
  kernel - 1]`), so the conv part is transposed on the way and the recurrent part is copied as is.

A batch gathers every token row (and every state) of a step's jobs into index tensors; one call per
cache group (`load_rows`, `save_rows`, `load_states`, `save_states`) moves it for all the group's
layers, by the rule every kernel launcher follows (`kernels._launch.pick_backend`):
- Triton when both buffers are on one CUDA device (or under `TRITON_INTERPRET=1`, the tests' CPU
  interpreter): `kernels.tile_copy` takes every (layer, part) as a row of a table, so a group's
  copy is one launch per word width whatever its layer count (the flash layout's K and V: one;
  conv and recurrent parts: two, as they move different words). The page-copy kernel would not
  do: it moves byte ranges within one layout, and these copies gather rows and transpose;
- otherwise the torch path, one indexed copy per layer and part (`rows_to_engine`,
  `rows_to_pool`, `states_to_engine`, `states_to_pool`, on whatever devices the buffers are):
  the reference the kernel is tested against byte for byte, and the fallback.
On CUDA both only queue the copies: `finish_copies` waits for them before the worker vouches for
the bytes (a load's epoch check, a save's fence and commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachetier.config import ModelSpec
from gpu_pool.layout import PageLayout, torch_dtype
from kernels._launch import Backend, pick_backend
from kernels.tile_copy import tile_copy


@dataclass(frozen=True)
class AttentionViews:
    """K and V, each addressed by (block or page, token row). An untiled part (tile 1) is
    `[blocks, tokens, heads, head_dim]`; a tiled one `[blocks, tokens // tile, tile, heads, ...]`,
    its head dim split as its tile packs it, so a row is `[heads, ...]` in either. An MLA layer
    caches one latent per token and no V: it is `keys` alone, `[blocks, tokens, 1, latent]`."""

    keys: torch.Tensor
    values: torch.Tensor | None = None
    key_tile: int = 1
    value_tile: int = 1

    @property
    def parts(self) -> list[tuple[torch.Tensor, int]]:
        """Each cached part with its tile: K and V, or the latent."""
        parts = [(self.keys, self.key_tile)]
        return parts if self.values is None else [*parts, (self.values, self.value_tile)]

    @property
    def tiled(self) -> bool:
        return self.key_tile > 1 or self.value_tile > 1


@dataclass(frozen=True)
class StateViews:
    conv: torch.Tensor  # engine [blocks, kernel - 1, channels]; pool [pages, channels, kernel - 1]
    recurrent: torch.Tensor  # [blocks or pages, heads, V, K]


CPU_ATTENTION_ISAS = ("vec", "vec16", "amx")  # vLLM CPU kernels whose block layout is read here
AMX_KEY_TILE = 16  # tokens per K tile of vLLM's amx layout
AMX_VALUE_TILE = 2  # tokens side by side in its V tiles


def engine_attention_views(kv: torch.Tensor, block_tokens: int, model: ModelSpec,
                           isa: str | None = None) -> AttentionViews:
    """`isa` is the CPU attention kernel family vLLM picked (None off CPU): it decides the
    layout inside a CPU GQA block. An MLA block is token-major on every backend vLLM has for it
    (CUDA's and both CPU ones, `amx_mla_concat_and_cache` and the reference's): one latent per
    token, `kv_lora_rank` then the rope part, as the pool's. vLLM registers it as `[blocks, 1,
    block_tokens, latent]` (its logical `[B, H, N, C]` with one head; seen on the AMX backend)
    or `[blocks, block_tokens, latent]`: indexing the head away keeps whatever strides it has."""
    if model.attention_kind == "mla":
        latent = model.mla_latent_dim
        if kv.dim() == 4 and kv.shape[1:] == (1, block_tokens, latent):
            kv = kv[:, 0]
        if kv.dim() == 3 and kv.shape[1:] == (block_tokens, latent):
            return AttentionViews(kv.unsqueeze(2))
        raise ValueError(f"unknown vLLM MLA KV layout {tuple(kv.shape)} for a latent of "
                         f"{model.mla_latent_dim} and {block_tokens}-token blocks")
    heads, dim = model.attn_heads_per_rank, model.gqa_head_dim
    if kv.dim() == 4 and kv.shape[1:] == (heads, block_tokens, 2 * dim):  # CPU: head-major
        if isa not in CPU_ATTENTION_ISAS:
            raise ValueError(f"vLLM CPU attention kernel {isa!r}: its block layout is not read "
                             f"here (only {', '.join(CPU_ATTENTION_ISAS)})")
        parts = kv.view(kv.shape[0], heads, 2, block_tokens * dim)
        if isa == "amx":
            keys = parts[:, :, 0].unflatten(
                -1, (block_tokens // AMX_KEY_TILE, dim // 2, AMX_KEY_TILE, 2)
            ).permute(0, 2, 4, 1, 3, 5)
            values = parts[:, :, 1].unflatten(
                -1, (dim // 16, block_tokens // AMX_VALUE_TILE, 16, AMX_VALUE_TILE)
            ).permute(0, 3, 5, 1, 2, 4)
            return AttentionViews(keys, values, AMX_KEY_TILE, AMX_VALUE_TILE)
        keys = parts[:, :, 0].unflatten(-1, (dim, block_tokens)).permute(0, 3, 1, 2)
        values = parts[:, :, 1].unflatten(-1, (block_tokens, dim)).permute(0, 2, 1, 3)
        return AttentionViews(keys, values)
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[2:] == (block_tokens, heads, dim):
        return AttentionViews(kv[0], kv[1])  # flash attention (unverified: no GPU here)
    raise ValueError(f"unknown vLLM attention KV layout {tuple(kv.shape)} for {heads} heads of "
                     f"{dim} and {block_tokens}-token blocks")


def engine_state_views(raw: torch.Tensor, model: ModelSpec) -> StateViews:
    """`raw` is one GDN layer's cache as vLLM registers it: `[blocks, ...]` bytes, one block per
    state (the state packed at its start, the block padded to the unified page)."""
    conv_bytes, recurrent_bytes = model.kda_rank_conv_bytes, model.kda_rank_recurrent_bytes
    flat = raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw
    blocks = flat.as_strided((flat.shape[0], conv_bytes + recurrent_bytes), (flat.stride(0), 1))
    conv = blocks[:, :conv_bytes].view(torch_dtype(model.conv_dtype)).view(
        blocks.shape[0], model.conv_kernel - 1, model.conv_rank_channels)
    recurrent = blocks[:, conv_bytes:].view(torch_dtype(model.kda_state_dtype)).view(
        blocks.shape[0], model.heads_per_rank, model.kda_head_v_dim, model.kda_head_k_dim)
    return StateViews(conv, recurrent)


def pool_attention_views(buffer: torch.Tensor, layout: PageLayout, slot: int) -> AttentionViews:
    model = layout.model
    raw = buffer[slot, :, :layout.geometry.mla_page_bytes].view(layout.mla_dtype)
    if model.attention_kind == "mla":
        return AttentionViews(raw.view(layout.num_pages, layout.cache.page_tokens, 1,
                                       model.mla_latent_dim))
    heads, dim = model.attn_heads_per_rank, model.gqa_head_dim
    split = raw.view(layout.num_pages, layout.cache.page_tokens, heads, 2, dim)
    return AttentionViews(split[:, :, :, 0], split[:, :, :, 1])


def pool_state_views(buffer: torch.Tensor, layout: PageLayout, slot: int) -> StateViews:
    model = layout.model
    conv_bytes = model.kda_rank_conv_bytes
    conv = buffer[slot, :, :conv_bytes].view(layout.conv_dtype).view(
        layout.num_pages, model.conv_rank_channels, model.conv_kernel - 1)
    recurrent = buffer[slot, :, conv_bytes:conv_bytes + model.kda_rank_recurrent_bytes].view(
        layout.kda_dtype).view(layout.num_pages, model.heads_per_rank, model.kda_head_v_dim,
                               model.kda_head_k_dim)
    return StateViews(conv, recurrent)


@dataclass
class TokenRows:
    """Token rows to move, as index tensors: row `i` is token row `block_rows[i]` of vLLM block
    `blocks[i]` and row `page_rows[i]` of pool page `pages[i]`."""

    blocks: torch.Tensor
    block_rows: torch.Tensor
    pages: torch.Tensor
    page_rows: torch.Tensor

    @classmethod
    def of(cls, spans: list[tuple[int, int, list[int], list[int]]], block_tokens: int,
           page_tokens: int) -> TokenRows:
        """Every request's tokens `[start, stop)`, through its vLLM block table and its page
        table (`(start, stop, blocks, pages)` each), gathered with tensor ops, not per token."""
        parts = []
        for start, stop, block_table, page_table in spans:
            tokens = torch.arange(start, stop)
            parts.append((torch.tensor(block_table)[tokens // block_tokens],
                          tokens % block_tokens,
                          torch.tensor(page_table)[tokens // page_tokens],
                          tokens % page_tokens))
        if not parts:
            return cls(*(torch.empty(0, dtype=torch.long) for _ in range(4)))
        return cls(*(torch.cat(column) for column in zip(*parts)))

    def __len__(self) -> int:
        return len(self.blocks)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def rows_to_engine(pool: AttentionViews, engine: AttentionViews, rows: TokenRows) -> None:
    _copy_rows(engine, (rows.blocks, rows.block_rows), pool, (rows.pages, rows.page_rows))


def rows_to_pool(engine: AttentionViews, pool: AttentionViews, rows: TokenRows) -> None:
    _copy_rows(pool, (rows.pages, rows.page_rows), engine, (rows.blocks, rows.block_rows))


def _copy_rows(dst: AttentionViews, dst_at: tuple[torch.Tensor, torch.Tensor],
               src: AttentionViews, src_at: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`dst[dst_at[0][i], dst_at[1][i]] = src[src_at[0][i], src_at[1][i]]` for every row, of
    each part (K and V, or the latent): one indexed copy each, on the destination's device."""
    if not len(dst_at[0]):
        return
    into = tuple(v.to(dst.keys.device) for v in dst_at)
    out_of = tuple(v.to(src.keys.device) for v in src_at)
    for (d, d_tile), (s, s_tile) in zip(dst.parts, src.parts, strict=True):
        rows = s[_row_index(out_of, s_tile)]
        d[_row_index(into, d_tile)] = rows.reshape(-1, *d.shape[2 if d_tile == 1 else 3:]).to(
            d.device)


def _row_index(at: tuple[torch.Tensor, torch.Tensor], tile: int) -> tuple[torch.Tensor, ...]:
    """(blocks, rows) as the index of a part whose rows come `tile` to a tile."""
    if tile == 1:
        return at
    blocks, rows = at
    return blocks, rows // tile, rows % tile


def states_to_engine(pool: StateViews, engine: StateViews, pages: list[int],
                     blocks: list[int]) -> None:
    _copy_states(engine, blocks, pool, pages)


def states_to_pool(engine: StateViews, pool: StateViews, blocks: list[int],
                   pages: list[int]) -> None:
    _copy_states(pool, pages, engine, blocks)


def _copy_states(dst: StateViews, dst_at: list[int], src: StateViews, src_at: list[int]) -> None:
    """One indexed copy per part; the conv part is transposed, as the two layouts disagree on
    it (`[kernel - 1, channels]` against `[channels, kernel - 1]`) and only on it."""
    if not dst_at:
        return
    device = dst.conv.device
    into, out_of = _index(dst_at, device), _index(src_at, src.conv.device)
    dst.conv[into] = src.conv[out_of].transpose(1, 2).to(device)
    dst.recurrent[into] = src.recurrent[out_of].to(device)


# -- a group's layers at once: Triton where it runs, the torch path above otherwise ----------------

def load_rows(pool: Sequence[AttentionViews], engine: Sequence[AttentionViews],
              rows: TokenRows) -> Backend:
    """`rows_to_engine` for every layer of a group (pool slot `i` into engine layer `i`)."""
    return _move_rows(engine, (rows.blocks, rows.block_rows), pool, (rows.pages, rows.page_rows))


def save_rows(engine: Sequence[AttentionViews], pool: Sequence[AttentionViews],
              rows: TokenRows) -> Backend:
    """`rows_to_pool` for every layer of a group (engine layer `i` into pool slot `i`)."""
    return _move_rows(pool, (rows.pages, rows.page_rows), engine, (rows.blocks, rows.block_rows))


def load_states(pool: Sequence[StateViews], engine: Sequence[StateViews], pages: list[int],
                blocks: list[int]) -> Backend:
    """`states_to_engine` for every layer of a group."""
    return _move_states(engine, blocks, pool, pages)


def save_states(engine: Sequence[StateViews], pool: Sequence[StateViews], blocks: list[int],
                pages: list[int]) -> Backend:
    """`states_to_pool` for every layer of a group."""
    return _move_states(pool, pages, engine, blocks)


def finish_copies(device: torch.device) -> None:
    """Wait for the copies queued on `device`'s current stream. On CUDA both paths only queue
    them, and what follows needs them done: a load's epoch check vouches for bytes already read,
    a save's fence and commit for bytes already written."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _backend(src: torch.Tensor, dst: torch.Tensor) -> Backend:
    """`kernels._launch.pick_backend` on the buffers' device; torch when they are on two devices
    (a kernel reads and writes one device's memory)."""
    if src.device != dst.device:
        return "torch"
    return pick_backend(src.device.type, "kv_copy")


def _move_rows(dst: Sequence[AttentionViews], dst_at: tuple[torch.Tensor, torch.Tensor],
               src: Sequence[AttentionViews], src_at: tuple[torch.Tensor, torch.Tensor]) -> Backend:
    """K and V (or the latent) of every layer as parts of one `tile_copy` (a token row's
    `[heads, head_dim]` is a tile; K and V launch apart only when their strides allow different
    words, vLLM's CPU K)."""
    pairs = list(zip(src, dst))
    if not pairs:
        return "torch"
    backend = _backend(pairs[0][0].keys, pairs[0][1].keys)
    if any(view.tiled for pair in pairs for view in pair):
        backend = "torch"  # a tiled row is no tile of one stride (vLLM's amx: CPU only anyway)
    if backend == "torch":
        for s, d in pairs:
            _copy_rows(d, dst_at, s, src_at)
    else:
        jobs = torch.stack([*src_at, *dst_at], dim=1)
        tile_copy([(s_part, d_part) for s, d in pairs
                   for (s_part, _), (d_part, _) in zip(s.parts, d.parts, strict=True)], jobs)
    return backend


def _move_states(dst: Sequence[StateViews], dst_at: list[int], src: Sequence[StateViews],
                 src_at: list[int]) -> Backend:
    """Conv and recurrent parts of every layer through `tile_copy`: the conv part as the source
    transposed to the destination's shape (`[kernel - 1, channels]` or the reverse), the recurrent
    part as `[heads x V, K]` rows, so that a state is split among programs by rows."""
    pairs = list(zip(src, dst))
    if not pairs:
        return "torch"
    backend = _backend(pairs[0][0].conv, pairs[0][1].conv)
    if backend == "torch":
        for s, d in pairs:
            _copy_states(d, dst_at, s, src_at)
    else:
        zeros = [0] * len(dst_at)
        jobs = torch.tensor([src_at, zeros, dst_at, zeros], dtype=torch.long).T
        tile_copy([(s.conv.transpose(1, 2).unsqueeze(1), d.conv.unsqueeze(1)) for s, d in pairs]
                  + [(_state_rows(s.recurrent), _state_rows(d.recurrent)) for s, d in pairs], jobs)
    return backend


def _state_rows(recurrent: torch.Tensor) -> torch.Tensor:
    """`[n, heads, V, K]` as `[n, 1, heads x V, K]` (a view: each state's rows are contiguous)."""
    return recurrent.view(recurrent.shape[0], 1, -1, recurrent.shape[-1])
