"""`KdaState`: the two parts of a KDA layer's per-request state, which always travel together.

The recurrent matrix alone does not determine what a KDA layer computes next: its short causal
convolution also reads the last `conv_kernel - 1` inputs of every q/k/v channel. A checkpoint,
a restore and a resumed chunk carry both parts, so no path can restore one without the other.
The same record holds one layer (`[C, kernel - 1]`, `[H, K, V]`) or the layers of every slot of
a page (a leading `[slots]` dimension).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinymodel.weights import Dims


@dataclass(frozen=True)
class KdaState:
    """`conv`: the last inputs of the conv channels (all heads' q, then k, then v), oldest first;
    `recurrent`: the delta-rule state, per head `[K, V]`."""

    conv: torch.Tensor  # [..., C, kernel - 1]
    recurrent: torch.Tensor  # [..., H, K, V]

    @classmethod
    def zeros(cls, dims: Dims, *slots: int) -> KdaState:
        """The state before the first token: a causal convolution pads with zeros."""
        return cls(torch.zeros(*slots, dims.conv_channels, dims.conv_kernel - 1),
                   torch.zeros(*slots, dims.kda_heads, dims.kda_k, dims.kda_v))

    @classmethod
    def stack(cls, layers: Sequence[KdaState]) -> KdaState:
        return cls(torch.stack([s.conv for s in layers]),
                   torch.stack([s.recurrent for s in layers]))

    def layer(self, slot: int) -> KdaState:
        return KdaState(self.conv[slot], self.recurrent[slot])
