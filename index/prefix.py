"""What a pool holds of a prompt, for routing and for copying it to another pool.

`PrefixProbe` answers "how much could this pool serve" without touching the pool (a router asks
every pool); `PinnedPrefix` is the same hit with its pages pinned under a reader id until
`PrefixIndex.release([reader])`, so another pool can copy them (prefill/decode disaggregation).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixProbe:
    """`hit_tokens`: usable now (MLA and a checkpoint in every KDA group at that boundary);
    `mla_tokens`: what the MLA pages alone match (a hit a checkpoint away)."""

    pool: str
    epoch: int
    hit_tokens: int
    mla_tokens: int


@dataclass(frozen=True)
class PinnedPrefix:
    """A pinned hit: `mla_pages[group][slot]` cover tokens `[0, hit_tokens)`, full pages but the
    last, which holds `hit_tokens - (slots - 1) * page_tokens`; `checkpoint_pages` hold the KDA
    state at `hit_tokens`, one page per KDA group (empty without KDA groups or without a hit)."""

    reader: str
    epoch: int
    hit_tokens: int
    mla_pages: list[list[int]]
    checkpoint_pages: list[int]

    def last_slot_tokens(self, page_tokens: int) -> int:
        slots = len(self.mla_pages[0]) if self.mla_pages else 0
        return self.hit_tokens - (slots - 1) * page_tokens if slots else 0
