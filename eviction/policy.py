"""Eviction policies as weights of one score formula that the Lua scripts evaluate.

score(entry) = recency * last_used
             + bonus[class]                    (intermediate checkpoint | MLA page | durable)
             + depth * prefix_tokens / pages   (prefill tokens the entry saves per page it holds)

The lowest score is evicted first. An MLA page that anchors a durable checkpoint counts as durable,
since evicting it would take the checkpoint with it. `score` here is the same formula, term for
term, as `score()` in index/lua/lib.lua, so the in-memory reference orders entries exactly as Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EntryClass = Literal["intermediate", "mla", "durable"]

# Larger than any reachable logical tick, so a bonus tier always dominates recency.
TIER = float(2**40)


@dataclass(frozen=True)
class EvictionWeights:
    recency: float
    mla: float
    intermediate: float
    durable: float
    depth: float

    def score(self, entry_class: EntryClass, last_used: int, prefix_tokens: int, pages: int) -> float:
        bonus = {"intermediate": self.intermediate, "mla": self.mla, "durable": self.durable}[entry_class]
        return self.recency * last_used + bonus + self.depth * prefix_tokens / pages

    def as_pool_fields(self) -> dict[str, float]:
        return {"w_recency": self.recency, "w_mla": self.mla, "w_intermediate": self.intermediate,
                "w_durable": self.durable, "w_depth": self.depth}


def lru() -> EvictionWeights:
    """Least recently used first, in three tiers: intermediate checkpoints are recycled before MLA
    pages, and durable (turn-boundary) checkpoints, with the pages that anchor them, outlive both."""
    return EvictionWeights(recency=1.0, mla=TIER, intermediate=0.0, durable=2 * TIER, depth=0.0)


POLICIES = {"lru": lru}


def policy_weights(name: str) -> EvictionWeights:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name]()
