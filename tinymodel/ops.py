"""Per-token math shared by the pool forward and the cold recompute.

Every function takes one token's vectors, so both paths run the same operations on tensors of the
same shapes and agree to the last bit when the pool hands back the bytes it was given; any
difference the oracle sees comes from what was stored, not from arithmetic order. The layer loops
(`kda_span`, `mla_span`) take plain tensors: where state and latents come from is the caller's job.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tinymodel.weights import Dims, KdaWeights, MlaWeights, Weights

ROPE_BASE = 10_000.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


@functools.lru_cache(maxsize=8192)
def _rotation(half: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = pos * ROPE_BASE ** (-torch.arange(half, dtype=torch.float32) / half)
    return torch.cos(angle), torch.sin(angle)


def rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate channel pairs of `x [..., R]` by the absolute position, so query-key scores depend on
    the distance: a latent row written at the wrong position changes the outputs."""
    cos, sin = _rotation(x.shape[-1] // 2, pos)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def kda_step(w: KdaWeights, dims: Dims, h: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: returns (residual update [d], new state [H, K, V]).

    S <- diag(a) S, then S <- S + beta k (v - S^T k)^T per head, output S^T q: the state is the only
    memory of the past, so a resumed run is right exactly when the restored state is.
    """
    heads, k_dim, v_dim = dims.kda_heads, dims.kda_k, dims.kda_v
    hk = heads * k_dim
    qk, v, gate, strength = (rms_norm(h, w.norm) @ w.w_in).split((2 * hk, heads * v_dim, hk, heads))
    q, k = F.normalize(qk.view(2, heads, 1, k_dim), dim=-1, eps=1e-6).unbind(0)  # [H, 1, K] each
    decay = torch.sigmoid(gate.view(heads, k_dim, 1) + w.a_bias)
    beta = torch.sigmoid(strength).view(heads, 1, 1)
    s = state * decay
    error = v.view(heads, 1, v_dim) - torch.bmm(k, s)
    s = torch.baddbmm(s, (beta * k).transpose(1, 2), error)
    return torch.bmm(q, s).reshape(-1) @ w.wo, s


def mla_row(w: MlaWeights, h: torch.Tensor, pos: int) -> torch.Tensor:
    """What one token caches in one MLA layer: `[latent | rotated key]`, `mla_latent_dim` values."""
    x = rms_norm(h, w.norm)
    return torch.cat((x @ w.w_dkv, rope(x @ w.w_kr, pos)))


def mla_attend(w: MlaWeights, dims: Dims, h: torch.Tensor, pos: int,
               rows: torch.Tensor) -> torch.Tensor:
    """Causal attention of the token at `pos` over `rows [pos + 1, row]` (positions 0..pos); the key
    and value up-projections are absorbed into the query and the output, as MLA inference does, so
    attention reads nothing but the cached rows. Returns the residual update [d].

    Matrix-vector products only: torch hands small matrix-matrix products to a threaded BLAS, whose
    synchronisation makes a per-token loop 10-30x slower on a busy machine.
    """
    x = rms_norm(h, w.norm)
    q = (x @ w.wq).view(dims.mla_heads, dims.mla_head_dim)
    q_rope = rope((x @ w.wqr).view(dims.mla_heads, dims.rope_dim), pos)
    latent = rows[:, :dims.mla_latent]
    scale = (dims.mla_head_dim + dims.rope_dim) ** -0.5
    heads = []
    for head in range(dims.mla_heads):
        query = torch.cat((torch.mv(w.w_uk[head], q[head]), q_rope[head]))
        weights = torch.softmax(torch.mv(rows, query) * scale, dim=0)
        heads.append(torch.mv(w.w_uv[head], torch.mv(latent.T, weights)))
    return torch.cat(heads) @ w.wo


def output(w: Weights, h: torch.Tensor) -> torch.Tensor:
    """One token's output vector `[out_dim]`: what the oracle compares."""
    return rms_norm(h, w.final_norm) @ w.out


def kda_span(w: KdaWeights, dims: Dims, hidden: torch.Tensor, state: torch.Tensor,
             split: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run one KDA layer over `hidden [T, d]` from `state`; returns (hidden out, final state, the
    state after the first `split` tokens or None when `split` is 0): a snapshot may fall strictly
    inside a chunk, so the loop hands it back where it passes, not only at the end."""
    out = torch.empty_like(hidden)
    snapshot = None
    for t in range(hidden.shape[0]):
        update, state = kda_step(w, dims, hidden[t], state)
        out[t] = hidden[t] + update
        if t + 1 == split:
            snapshot = state
    return out, state, snapshot


def mla_rows(w: MlaWeights, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """The rows `hidden [T, d]` caches when its first token sits at position `start`."""
    return torch.stack([mla_row(w, hidden[t], start + t) for t in range(hidden.shape[0])])


def mla_span(w: MlaWeights, dims: Dims, hidden: torch.Tensor, start: int,
             rows: torch.Tensor) -> torch.Tensor:
    """Run one MLA layer over `hidden [T, d]` at positions `start..`, attending over `rows
    [start + T, row]`: every cached row of the sequence so far, this chunk's included."""
    out = torch.empty_like(hidden)
    for t in range(hidden.shape[0]):
        pos = start + t
        out[t] = hidden[t] + mla_attend(w, dims, hidden[t], pos, rows[:pos + 1])
    return out
