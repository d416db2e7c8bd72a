"""`ChunkRequest`: one request's share of a forward pass, in the page-table terms of the index.

A chunk may start and stop anywhere (chunked prefill need not follow hash blocks); the only places
the model reads cached state are the state pages at `start` and the MLA pages of [0, start), and the
only places it writes are the MLA rows of [start, stop), the state pages, and the snapshot pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tinymodel.weights import Dims

if TYPE_CHECKING:
    from index.records import RequestPlan


class ChunkError(ValueError):
    """A chunk request is inconsistent with itself or with the model's groups."""


@dataclass(frozen=True)
class ChunkRequest:
    """Compute positions [start, stop) of `tokens` (the whole prompt so far).

    `mla_pages[group][slot]` covers [0, stop): slot `s` holds positions [s * page_tokens,
    (s + 1) * page_tokens). `state_pages` holds one private KDA state page per KDA group: read at
    `start` (zeroed instead when `start == 0`: a fresh page still holds its last owner's bytes) and
    written back at `stop`. When `snapshot_tokens > 0` (`start < snapshot_tokens <= stop`) the
    state after position `snapshot_tokens - 1` is also written to `snapshot_pages`.
    """

    tokens: Sequence[int] | np.ndarray
    start: int
    stop: int
    mla_pages: Sequence[Sequence[int]]
    state_pages: Sequence[int]
    snapshot_tokens: int = 0
    snapshot_pages: Sequence[int] = ()

    @classmethod
    def from_plan(cls, plan: RequestPlan, tokens: Sequence[int] | np.ndarray) -> ChunkRequest:
        """The chunk an index `RequestPlan` describes; the plan's `copies` must have been run first
        (they fill the state pages with the restored checkpoint and copy-on-write the MLA page)."""
        return cls(tokens, plan.start, plan.stop, plan.mla_pages, plan.state_pages,
                   plan.checkpoint_tokens, plan.checkpoint_pages)

    @property
    def fresh_state(self) -> bool:
        return self.start == 0

    def check(self, dims: Dims, page_tokens: int) -> None:
        if not 0 <= self.start < self.stop <= len(self.tokens):
            raise ChunkError(f"chunk [{self.start}, {self.stop}) is empty or outside a "
                             f"{len(self.tokens)}-token prompt")
        slots = math.ceil(self.stop / page_tokens)
        if len(self.mla_pages) != dims.mla_groups:
            raise ChunkError(f"mla_pages has {len(self.mla_pages)} groups, the model "
                             f"{dims.mla_groups}")
        for group, pages in enumerate(self.mla_pages):
            if len(pages) < slots:
                raise ChunkError(f"mla_pages[{group}] has {len(pages)} slots; positions "
                                 f"[0, {self.stop}) need {slots}")
        if len(self.state_pages) != dims.kda_groups:
            raise ChunkError(f"state_pages has {len(self.state_pages)} pages, the model has "
                             f"{dims.kda_groups} KDA groups")
        if not self.snapshot_tokens:
            return
        if not self.start < self.snapshot_tokens <= self.stop:
            raise ChunkError(f"snapshot_tokens={self.snapshot_tokens} outside "
                             f"({self.start}, {self.stop}]")
        if len(self.snapshot_pages) != dims.kda_groups:
            raise ChunkError(f"snapshot_pages has {len(self.snapshot_pages)} pages, the model has "
                             f"{dims.kda_groups} KDA groups")
        if set(self.snapshot_pages) & set(self.state_pages):
            raise ChunkError("snapshot_pages overlap state_pages: the snapshot would be "
                             "overwritten")
