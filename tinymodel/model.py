"""`TinyHybrid`: a tiny but real hybrid model whose only cache is the pool, of either family:
KDA + MLA (Kimi) or Gated DeltaNet + grouped-query attention (Qwen3-Next), as its `ModelSpec`
says.

Block `i` runs layer slot `i` of every linear-attention group, then layer slot `i` of every
full-attention group, the same
order in which `ModelSpec` assigns layers to page slots. `forward` reads and writes every reused
byte of state through the pool (`pool_io`), or through one pool per tensor-parallel rank: the
weights do not depend on the TP degree, so pages written at one degree and re-sharded on the
transfer path resume at another; `recompute` runs the same span math (`ops`) from scratch on plain
tensors. A run resumed from any cache hit is correct exactly when its outputs match
`recompute`: that comparison is the oracle of the end-to-end, concurrency and chaos tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cachetier.config import ModelSpec
from gpu_pool.pool import PagedPool
from tinymodel import ops, pool_io
from tinymodel.chunk import ChunkRequest
from tinymodel.state import KdaState
from tinymodel.weights import Dims, Weights, init_weights

# fp32 outputs of the two paths agree to ~1e-6 when the pool returns what was stored: both run the
# same span math (`ops`) but over different spans (the chunks vs the whole prompt), so sums may
# round in another order; a wrong or stale page moves the outputs by orders of magnitude more
RTOL = ATOL = 1e-5


def outputs_match(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """The oracle's verdict: same shape and equal within `RTOL`/`ATOL`."""
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=RTOL,
                                                             atol=ATOL)


class TinyHybrid:
    """Random fp32 weights on CPU, fixed by `seed`; `free` overrides the sizes `Dims` leaves free
    (`d_model`, `vocab`, `out_dim`, `rope_dim`, MLA attention heads). Token ids are taken modulo
    `vocab`, so any uint32 prompt is valid. Raises `UnsupportedModel` for a spec it cannot serve.
    The weights ignore `spec.tp_degree`: a model built for TP=s computes what one built for TP=d
    does, so either checks pages written by the other and re-sharded between them.

    A span costs a few hundred tiny torch ops (~0.1-0.2 ms per token for chunks of 16-64 tokens).
    The model changes no global torch setting: a process sharing a busy CPU should call
    `torch.set_num_threads(1)`, since multi-threaded BLAS on such small matrices mostly waits on
    thread barriers (2-30x slower under contention)."""

    def __init__(self, spec: ModelSpec, seed: int = 0, **free: int) -> None:
        self.spec = spec
        self.dims = Dims.from_spec(spec, **free)
        self.weights: Weights = init_weights(self.dims, seed)

    def check_pool(self, pools: PagedPool | Sequence[PagedPool]) -> None:
        """Raise `PoolMismatch` unless `pools` (one pool, or one per rank in rank order) are the
        ranks of one layout that holds exactly this model's caches."""
        pool_io.checked_ranks(self.dims, pools)

    def forward(self, pools: PagedPool | Sequence[PagedPool],
                batch: Sequence[ChunkRequest]) -> list[torch.Tensor]:
        """Run every chunk of `batch` through the pool, or through the pools of every rank (in rank
        order, one page table for all); returns per chunk `[stop - start, out_dim]`.

        Chunks run one after the other: within a step no request reads what another one writes
        (the index never matches pages pending in the same step), so the order does not matter.
        """
        ranks = pool_io.checked_ranks(self.dims, pools)
        page_tokens = ranks[0].layout.cache.page_tokens
        for request in batch:
            request.check(self.dims, page_tokens)
        with torch.inference_mode():  # thread-local: skips autograd bookkeeping on every tiny op
            outputs = [self._forward_one(ranks, request) for request in batch]
        return [out.clone() for out in outputs]  # normal tensors, free to modify in place

    def recompute(self, tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Cold full recompute, `[len(tokens), out_dim]`, with no pool: state starts at zero and the
        latent rows stay in a local tensor, so it shares no storage path with `forward`."""
        with torch.inference_mode():
            outputs = self._recompute(tokens)
        return outputs.clone()

    def _recompute(self, tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
        dims, w = self.dims, self.weights
        hidden = self._embed(tokens)
        for block in range(dims.blocks):
            for group in range(dims.kda_groups):
                hidden, _, _ = ops.kda_span(w.kda[group][block], dims, hidden,
                                            KdaState.zeros(dims))
            for group in range(dims.mla_groups):
                layer = w.mla[group][block]
                rows = ops.attention_rows(layer, dims, hidden, 0)
                hidden = ops.attention_span(layer, dims, hidden, 0, rows)
        return self._head(hidden)

    def _forward_one(self, ranks: list[PagedPool], r: ChunkRequest) -> torch.Tensor:
        dims, w = self.dims, self.weights
        hidden = self._embed(r.tokens[r.start:r.stop])
        split = r.snapshot_tokens - r.start if r.snapshot_tokens else 0
        states = [KdaState.zeros(dims, dims.blocks) if r.fresh_state
                  else pool_io.read_states(ranks, page)
                  for page in r.state_pages]  # per group, both parts of every slot
        finals: list[list[KdaState]] = [[] for _ in r.state_pages]
        snapshots: list[list[KdaState]] = [[] for _ in r.state_pages]
        for block in range(dims.blocks):
            for group in range(dims.kda_groups):
                hidden, state, snapshot = ops.kda_span(w.kda[group][block], dims, hidden,
                                                       states[group].layer(block), split)
                finals[group].append(state)
                if snapshot is not None:
                    snapshots[group].append(snapshot)
            for group in range(dims.mla_groups):
                layer, pages = w.mla[group][block], r.mla_pages[group]
                pool_io.write_rows(ranks, pages, block, r.start,
                                   ops.attention_rows(layer, dims, hidden, r.start))
                rows = pool_io.read_rows(ranks, pages, block, r.stop)
                hidden = ops.attention_span(layer, dims, hidden, r.start, rows)
        for group, page in enumerate(r.state_pages):
            pool_io.write_states(ranks, page, KdaState.stack(finals[group]))
            if r.snapshot_tokens:
                pool_io.write_states(ranks, r.snapshot_pages[group],
                                     KdaState.stack(snapshots[group]))
        return self._head(hidden)

    def _embed(self, tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
        ids = np.asarray(tokens, dtype=np.int64) % self.dims.vocab
        return self.weights.embed[torch.from_numpy(ids)]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.output(self.weights, hidden)
