"""Per-span math shared by the pool forward and the cold recompute.

Every function takes the vectors of a whole span of consecutive tokens (`hidden [T, d]` at positions
`start..start + T - 1`) and computes all per-token projections with one matmul each; only the KDA
state recurrence runs token by token, with three small in-place ops per token. Both paths call
these same functions, so any difference the oracle sees comes from what was stored, not from the
math; the paths may still differ in the last bits because they cut the prompt into different spans
(a matmul or softmax over more rows may sum in another order), which `RTOL`/`ATOL` absorb.

The layer functions (`kda_span`, `mla_span`) take plain tensors: where state and latents come from
is the caller's job. They set no global torch state: every matrix here is tiny (at most a few
hundred rows of 16-64 columns), and the engine, not this library, decides how many threads torch
uses (a threaded BLAS only adds synchronisation at these sizes, and is much slower on a busy machine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinymodel.weights import Dims, KdaWeights, MlaWeights, Weights

ROPE_BASE = 10_000.0
# KDA states kept per block of tokens (memory: BLOCK * H * K * V floats), and MLA queries attended
# per block (memory: heads * BLOCK * positions floats); only a long cold recompute spans >1 block
KDA_BLOCK = 128
MLA_BLOCK = 256

_rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotation(half: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[stop - start, half]` of positions [start, stop), from one table per `half`
    grown by doubling and computed in float64: a position's angles never depend on the span."""
    table = _rope_tables.get(half)
    if table is None or table[0].shape[0] < stop:
        size = max(1024, 1 << (stop - 1).bit_length())
        inv_freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) / half)
        angle = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq
        table = (torch.cos(angle).float(), torch.sin(angle).float())
        _rope_tables[half] = table
    return table[0][start:stop], table[1][start:stop]


def rope(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate channel pairs of `x [T, ..., R]` (token `t` at position `start + t`) by the absolute
    position, so query-key scores depend on the distance: a latent row written at the wrong
    position changes the outputs."""
    cos, sin = _rotation(x.shape[-1] // 2, start, start + x.shape[0])
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def output(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """The output vectors `[T, out_dim]` of `hidden [T, d]`: what the oracle compares."""
    return rms_norm(hidden, w.final_norm) @ w.out


def kda_span(w: KdaWeights, dims: Dims, hidden: torch.Tensor, state: torch.Tensor,
             split: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run one KDA layer (gated delta rule) over `hidden [T, d]` from `state [H, K, V]`; returns
    (hidden out, final state, the state after the first `split` tokens or None when `split` is 0):
    a snapshot may fall strictly inside a chunk, so it is taken where the recurrence passes it.

    Per token: S <- diag(a) S, then S <- S + beta k (v - S^T k)^T per head, output S^T q. The state
    is the only memory of the past, so a resumed run is right exactly when the restored state is.
    """
    steps, heads, k_dim, v_dim = hidden.shape[0], dims.kda_heads, dims.kda_k, dims.kda_v
    hk = heads * k_dim
    qk, v, gate, strength = (rms_norm(hidden, w.norm) @ w.w_in).split(
        (2 * hk, heads * v_dim, hk, heads), dim=-1)
    q, k = F.normalize(qk.reshape(steps, 2, heads, 1, k_dim), dim=-1, eps=1e-6).unbind(1)
    decay = torch.sigmoid(gate.reshape(steps, heads, k_dim, 1) + w.a_bias)  # [T, H, K, 1]
    beta = torch.sigmoid(strength).reshape(steps, heads, 1, 1)
    k_row = k.contiguous()  # [T, H, 1, K]
    k_col = (beta * k).transpose(-1, -2).contiguous()  # beta k as a column, [T, H, K, 1]
    v = v.reshape(steps, heads, 1, v_dim)
    reads = torch.empty(steps, heads, 1, v_dim)
    snapshot = None
    for first in range(0, steps, KDA_BLOCK):
        last = min(steps, first + KDA_BLOCK)
        states = torch.empty(last - first, heads, k_dim, v_dim)  # the state after each token
        prev = state
        for s, a, k_t, bk_t, v_t in zip(states.unbind(0), decay[first:last].unbind(0),
                                        k_row[first:last].unbind(0),
                                        k_col[first:last].unbind(0), v[first:last].unbind(0)):
            torch.mul(prev, a, out=s)
            s.addcmul_(bk_t, torch.baddbmm(v_t, k_t, s, alpha=-1))  # error = v - S^T k
            prev = s
        torch.matmul(q[first:last], states, out=reads[first:last])
        if first < split <= last:
            snapshot = states[split - 1 - first].clone()
        state = states[-1].clone()
    return hidden + reads.view(steps, heads * v_dim) @ w.wo, state, snapshot


def mla_rows(w: MlaWeights, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """What `hidden [T, d]` (first token at position `start`) caches in one MLA layer: one row
    `[latent | rotated key]` of `mla_latent_dim` values per token, `[T, row]`."""
    x = rms_norm(hidden, w.norm)
    return torch.cat((x @ w.w_dkv, rope(x @ w.w_kr, start)), dim=-1)


def mla_span(w: MlaWeights, dims: Dims, hidden: torch.Tensor, start: int,
             rows: torch.Tensor) -> torch.Tensor:
    """Run one MLA layer over `hidden [T, d]` at positions `start..`, attending causally over `rows
    [start + T, row]`: every cached row of the sequence so far, this chunk's included. The key
    and value up-projections are absorbed into the query and the output, as MLA inference does, so
    attention reads nothing but the cached rows. Returns the new hidden `[T, d]`."""
    steps, heads, latent_dim = hidden.shape[0], dims.mla_heads, dims.mla_latent
    x = rms_norm(hidden, w.norm)
    q = (x @ w.wq).view(steps, heads, 1, dims.mla_head_dim)
    q_latent = (q @ w.w_uk.transpose(1, 2)).squeeze(2)  # [T, Hm, C]
    q_rope = rope((x @ w.wqr).view(steps, heads, dims.rope_dim), start)
    query = torch.cat((q_latent, q_rope), dim=-1).transpose(0, 1)  # [Hm, T, row]
    scale = (dims.mla_head_dim + dims.rope_dim) ** -0.5
    context = torch.empty(heads, steps, latent_dim)
    for first in range(0, steps, MLA_BLOCK):
        last = min(steps, first + MLA_BLOCK)
        seen = rows[:start + last]
        scores = (query[:, first:last] @ seen.T) * scale  # [Hm, block, positions]
        pos = torch.arange(start + first, start + last)
        future = torch.arange(start + last)[None, :] > pos[:, None]
        weights = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1)
        context[:, first:last] = weights @ seen[:, :latent_dim]
    values = context @ w.w_uv.transpose(1, 2)  # [Hm, T, Dv]
    return hidden + values.transpose(0, 1).reshape(steps, -1) @ w.wo
