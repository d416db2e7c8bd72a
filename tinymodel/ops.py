"""Per-span math shared by the pool forward and the cold recompute.

Every function takes a whole span of consecutive tokens (`hidden [T, d]`, first token at position
`start`) and computes every per-token projection with one matmul; the KDA recurrence runs in
blocks of `KDA_BLOCK` tokens in its exact chunkwise form. Both paths call these same functions on
plain tensors (where state and latent rows come from is the caller's job), so any difference the
oracle sees comes from what was stored, not from the math. The two paths cut a prompt into different
spans, so their sums may round in a different order: they agree to ~1e-6, inside RTOL/ATOL.

No global torch setting is changed here. All matrices are tiny (tens of rows by 16-64 columns), so a
span costs a fixed number of small torch ops; a caller sharing a busy CPU should run torch with one
thread (`torch.set_num_threads(1)`): with more, small BLAS calls wait on thread barriers, and a
forward pass runs 2-20x slower under contention.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tinymodel.state import KdaState
from tinymodel.weights import Dims, GqaWeights, KdaWeights, MlaWeights, Weights

ROPE_BASE = 10_000.0
KDA_BLOCK = 64  # tokens per KDA block: ~30 torch ops and O(BLOCK^2) work per block
MLA_BLOCK = 256  # queries attended at once: bounds the `[BLOCK, heads, positions]` scores
# a KDA block's factors 1/decay reach e^(this): far inside fp32, whose exp overflows past 88
MAX_BLOCK_LOG_DECAY = 60.0

_rope_tables: dict[int, torch.Tensor] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotation(half: int, start: int, stop: int) -> torch.Tensor:
    """`e^(i pos theta_j)` `[stop - start, half]` (complex64) for positions [start, stop), from one
    table per `half`, grown by doubling and computed in float64: a position's rotation does not
    depend on the span it is computed in."""
    table = _rope_tables.get(half)
    if table is None or table.shape[0] < stop:
        size = max(1024, 1 << (stop - 1).bit_length())
        inv_freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) / half)
        angle = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq
        table = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
        _rope_tables[half] = table
    return table[start:stop]


def rope(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate channel pairs of `x [T, ..., R]` (token `t` at position `start + t`) by the absolute
    position, so query-key scores depend on the distance: a latent row written at the wrong
    position changes the outputs."""
    steps, half = x.shape[0], x.shape[-1] // 2
    rotation = _rotation(half, start, start + steps).view(steps, *(1,) * (x.dim() - 2), half)
    pairs = torch.view_as_complex(x.contiguous().view(*x.shape[:-1], half, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2)


def output(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """The output vectors `[T, out_dim]` of `hidden [T, d]`: what the oracle compares."""
    return rms_norm(hidden, w.final_norm) @ w.out


# --- KDA ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=128)
def _kda_masks(n: int) -> torch.Tensor:
    """`[2, n, n]`: a read at t sees the writes i <= t; the write at t corrects for those i < t."""
    ones = torch.ones(n, n)
    return torch.stack((ones.tril(), ones.tril(-1)))


def kda_span(w: KdaWeights, dims: Dims, hidden: torch.Tensor, state: KdaState,
             split: int = 0) -> tuple[torch.Tensor, KdaState, KdaState | None]:
    """Run one linear-attention layer (short convolution, then gated delta rule) over `hidden
    [T, d]` from
    `state`; returns (hidden out, final state, the state after the first `split` tokens or None
    when `split` is 0): a snapshot may fall strictly inside a chunk, so it is taken where the
    recurrence passes it, and its conv rows may straddle the chunk's start.

    Per token t: the q, k, v projections pass through a causal depthwise convolution of kernel
    `conv_kernel` and SiLU (as Kimi Linear's `ShortConvolution`), q and k are L2-normalised per
    head; then S <- diag(a_t) S, S <- S + beta_t k_t (v_t - S^T k_t)^T per head, output S^T q_t.
    The conv rows and S are the only memory of the past, so a resumed run is right exactly when
    both restored parts are. KDA decays per key channel (`a_t` a vector); Gated DeltaNet decays
    per head (`a_t` a scalar, the same chunkwise form) and its q and k come in fewer key heads,
    each shared by a group of value heads (as Qwen3-Next's `repeat_interleave`).
    """
    steps, heads, k_dim, v_dim = hidden.shape[0], dims.kda_heads, dims.kda_k, dims.kda_v
    hk, gates = dims.key_heads * k_dim, dims.gate_width // heads
    qkv, gate, strength = (rms_norm(hidden, w.norm) @ w.w_in).split(
        (dims.conv_channels, dims.gate_width, heads), dim=-1)
    qkv, conv, conv_snapshot = short_conv(w.conv, qkv, state.conv, split)
    qk, v = qkv.split((2 * hk, heads * v_dim), dim=-1)
    qk = qk.reshape(steps, 2, dims.key_heads, k_dim)
    qk = (qk / qk.norm(dim=-1, keepdim=True).clamp_min(1e-6)).permute(2, 1, 0, 3)
    if dims.key_heads != heads:  # GDN: each key head serves a group of value heads
        qk = qk.repeat_interleave(heads // dims.key_heads, dim=0)
    qk = qk.contiguous()
    log_decay = F.logsigmoid(gate.view(steps, heads, gates) + w.a_bias.view(heads, gates))
    log_decay = log_decay.transpose(0, 1).expand(heads, steps, k_dim)  # [H, T, K]
    beta = torch.sigmoid(strength).T.unsqueeze(-1)  # [H, T, 1]
    v = v.view(steps, heads, v_dim).transpose(0, 1)  # [H, T, V]
    recurrent = state.recurrent
    reads, snapshot = [], None
    for first in range(0, steps, KDA_BLOCK):
        last = min(steps, first + KDA_BLOCK)
        part = slice(first, last) if steps > KDA_BLOCK else slice(None)
        at = split - 1 - first if first < split <= last else None
        recurrent, block_reads, taken = _kda_block(qk[:, :, part], v[:, part],
                                                   log_decay[:, part], beta[:, part], recurrent,
                                                   at)
        reads.append(block_reads)
        snapshot = taken if at is not None else snapshot
    reads = reads[0] if len(reads) == 1 else torch.cat(reads, dim=1)
    out = torch.addmm(hidden, reads.transpose(0, 1).reshape(steps, -1), w.wo)
    taken_state = None if snapshot is None else KdaState(conv_snapshot, snapshot)
    return out, KdaState(conv, recurrent), taken_state


def short_conv(weight: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, split: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution of `x [T, C]` with `weight [C, kernel]`, then SiLU, after
    the `rows [C, kernel - 1]` of earlier inputs (oldest first); returns (outputs `[T, C]`, the
    rows after the span, the rows after its first `split` tokens). Both row sets are the last
    `kernel - 1` inputs, so they straddle the span's start when it is shorter than the kernel."""
    window = weight.shape[1] - 1
    padded = torch.cat((rows.T, x))  # [kernel - 1 + T, C]: input t at index t + kernel - 1
    steps = x.shape[0]
    out = padded[window:] * weight[:, window]
    for j in range(window):
        out = out.addcmul_(padded[j:j + steps], weight[:, j])
    return (F.silu(out), padded[steps:].T.contiguous(),
            padded[split:split + window].T.contiguous())


def _kda_block(qk: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, at: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The recurrence over a block of n tokens at once, in the exact chunkwise form of the delta
    rule: returns (state after the block, reads `[H, n, V]`, the state after token `at` or None).

    With G_t = a_0 ... a_t (per key channel) and S the state before the block, unrolling gives
    S_t = G_t (S + sum_{i<=t} k_i u_i^T / G_i), where the corrections u_t = beta_t (v_t - k_t^T
    diag(a_t) S_{t-1}) solve the unit lower-triangular system (I + beta A) u = beta (v - (G k) S),
    A_ti = (G_t k_t)^T (k_i / G_i) for i < t; the reads S_t^T q_t = (G_t q_t)^T S + sum_{i<=t}
    ((G_t q_t)^T (k_i / G_i)) u_i. Every product G_t / G_i that is used has t >= i, so equals the
    decay between i and t; 1/G_i stays below e^MAX_BLOCK_LOG_DECAY (else the block is halved).
    """
    n = qk.shape[2]
    log_g = log_decay.cumsum(1)
    if n > 1 and log_g[:, -1].min() < -MAX_BLOCK_LOG_DECAY:
        half = n // 2
        early = at if at is not None and at < half else None
        late = at - half if at is not None and at >= half else None
        mid, first, taken = _kda_block(qk[:, :, :half], v[:, :half], log_decay[:, :half],
                                       beta[:, :half], state, early)
        end, second, later = _kda_block(qk[:, :, half:], v[:, half:], log_decay[:, half:],
                                        beta[:, half:], mid, late)
        return end, torch.cat((first, second), dim=1), taken if early is not None else later
    heads = qk.shape[0]
    g = torch.exp(log_g)  # [H, n, K]
    k_in = qk[:, 1] / g  # k_i / G_i
    decayed = (qk * g.unsqueeze(1)).reshape(heads, 2 * n, -1)  # G_t q_t, then G_t k_t
    scores, a = (torch.bmm(decayed, k_in.transpose(1, 2)).view(heads, 2, n, n)
                 * _kda_masks(n)).unbind(1)
    from_state = torch.bmm(decayed, state).view(heads, 2, n, -1)
    u = torch.linalg.solve_triangular(a.mul_(beta), beta * (v - from_state[:, 1]), upper=False,
                                      unitriangular=True)
    reads = torch.baddbmm(from_state[:, 0], scores, u)

    def state_after(t: int) -> torch.Tensor:
        k_t, u_t = (k_in, u) if t == n - 1 else (k_in[:, :t + 1], u[:, :t + 1])
        return torch.baddbmm(state, k_t.transpose(1, 2), u_t).mul_(g[:, t].unsqueeze(-1))

    return state_after(n - 1), reads, None if at is None else state_after(at)


# --- full attention: MLA or GQA -------------------------------------------------------------------

def attention_rows(w: MlaWeights | GqaWeights, dims: Dims, hidden: torch.Tensor,
                   start: int) -> torch.Tensor:
    """What a full-attention layer caches for `hidden`, `[T, units, elems]`: one unit (the
    latent row) for MLA, the KV heads for GQA; the shape the pool's rows are split by."""
    if isinstance(w, GqaWeights):
        return gqa_rows(w, dims, hidden, start)
    return mla_rows(w, hidden, start).unsqueeze(1)


def attention_span(w: MlaWeights | GqaWeights, dims: Dims, hidden: torch.Tensor, start: int,
                   rows: torch.Tensor) -> torch.Tensor:
    """One full-attention layer over `hidden` from `rows [start + T, units, elems]`."""
    if isinstance(w, GqaWeights):
        return gqa_span(w, dims, hidden, start, rows)
    return mla_span(w, dims, hidden, start, rows.squeeze(1))


def mla_rows(w: MlaWeights, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """What `hidden [T, d]` (first token at position `start`) caches in one MLA layer: one row
    `[latent | rotated key]` of `mla_latent_dim` values per token, `[T, row]`."""
    row = rms_norm(hidden, w.norm) @ w.w_row
    latent = w.w_dkv.shape[1]
    return torch.cat((row[:, :latent], rope(row[:, latent:], start)), dim=-1)


def mla_span(w: MlaWeights, dims: Dims, hidden: torch.Tensor, start: int,
             rows: torch.Tensor) -> torch.Tensor:
    """Run one MLA layer over `hidden [T, d]` at positions `start..`, attending causally over `rows
    [start + T, row]`: every cached row of the sequence so far, this chunk's included. The key
    and value up-projections are absorbed into the query and the output (`MlaWeights.w_query`,
    `w_out`), as MLA inference does, so attention reads nothing but the cached rows. Returns the
    new hidden `[T, d]`."""
    steps, heads, latent = hidden.shape[0], dims.mla_heads, dims.mla_latent
    query = (rms_norm(hidden, w.norm) @ w.w_query).view(steps, heads, dims.mla_row)
    query = torch.cat((query[..., :latent], rope(query[..., latent:], start)), dim=-1)
    context = []
    for first in range(0, steps, MLA_BLOCK):
        last = min(steps, first + MLA_BLOCK)
        seen = rows[:start + last]
        block = query[first:last].reshape(-1, dims.mla_row)  # [block * Hm, row]
        scores = (block @ seen.T).view(last - first, heads, -1)
        future = torch.ones(last - first, start + last, dtype=torch.bool).triu_(start + first + 1)
        weights = torch.softmax(scores.masked_fill_(future.unsqueeze(1), float("-inf")), dim=-1)
        context.append(weights.view(-1, start + last) @ seen[:, :latent])  # [block * Hm, C]
    context = context[0] if len(context) == 1 else torch.cat(context)
    return torch.addmm(hidden, context.view(steps, heads * latent), w.w_out)


# --- GQA ------------------------------------------------------------------------------------------

def gqa_rows(w: GqaWeights, dims: Dims, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """What `hidden [T, d]` (first token at position `start`) caches in one GQA layer: per token
    and KV head its rotated key, then its value, `[T, kv_heads, 2 * head_dim]`."""
    steps, heads, head_dim = hidden.shape[0], dims.kv_heads, dims.kv_head_dim
    kv = (rms_norm(hidden, w.norm) @ w.w_kv).view(steps, heads, 2, head_dim)
    return torch.stack((rope(kv[:, :, 0], start), kv[:, :, 1]), dim=2).view(steps, heads, -1)


def gqa_span(w: GqaWeights, dims: Dims, hidden: torch.Tensor, start: int,
             rows: torch.Tensor) -> torch.Tensor:
    """Run one grouped-query attention layer over `hidden [T, d]` at positions `start..`,
    attending causally over `rows [start + T, kv_heads, 2 * head_dim]` (every cached K and V of
    the sequence so far, this chunk's included); query heads `g * j .. g * (j + 1) - 1` read KV
    head `j`. Returns the new hidden `[T, d]`."""
    steps, kv_heads, head_dim = hidden.shape[0], dims.kv_heads, dims.kv_head_dim
    group = dims.gqa_query_heads_per_kv
    query = (rms_norm(hidden, w.norm) @ w.wq).view(steps, kv_heads * group, head_dim)
    query = (rope(query, start) * head_dim ** -0.5).view(steps, kv_heads, group, head_dim)
    keys, values = rows[..., :head_dim], rows[..., head_dim:]
    context = []
    for first in range(0, steps, MLA_BLOCK):
        last = min(steps, first + MLA_BLOCK)
        scores = torch.einsum("tjgd,sjd->tjgs", query[first:last], keys[:start + last])
        future = torch.ones(last - first, start + last, dtype=torch.bool).triu_(start + first + 1)
        weights = torch.softmax(scores.masked_fill_(future[:, None, None], float("-inf")), dim=-1)
        context.append(torch.einsum("tjgs,sjd->tjgd", weights, values[:start + last]))
    context = context[0] if len(context) == 1 else torch.cat(context)
    return torch.addmm(hidden, context.reshape(steps, -1), w.wo)
