"""Eviction policies as weights of one score formula that the Lua scripts evaluate.

score(entry) = recency * last_used + clock * clock_stamp
             + bonus                            (the entry's tier, see below)
             + depth * prefix_tokens / pages    (prefill tokens the entry saves per page it holds)
             + sum(value[class] * gain) / freed (prefill tokens lost per page freed, Marconi)

The lowest score is evicted first. Evicting an entry removes a set of checkpoints with it: a
checkpoint removes itself; an MLA page removes every checkpoint anchored on it. So `bonus` is the
highest tier among the page itself (`mla`) and those checkpoints' classes, `gain` sums over them
(each checkpoint's gain: the tokens it saves over the checkpoint its request resumed from or
registered before it), and `freed` counts the pages of the entry and of those checkpoints.
`clock_stamp` is the pool's GreedyDual clock when the entry was last used; evicting an entry
raises the clock to its stamp plus its value term, so entries that stay unused age against the
value of what is evicted (GreedyDual-Size). `score` here is the same formula, term for term and in
the same order of operations, as `score()` in index/lua/lib.lua, so the in-memory reference
orders entries exactly as Redis.

Checkpoint classes: `intermediate` (a chunk end, recycled when its request registers the next),
`turn` (a prompt's end), `branch` (an MLA match end past the hit), `rung` (a page end), `spec` (a
page end that is not the deepest one its request crossed), `superseded` (a turn end that a later
request resumed from and went past: the index demotes it, and an exact repeat promotes it back).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args, get_type_hints

# The one place the classes are written: index.scripts hands them to the Lua scripts, and
# index.records, the reference model and the tests import them from here.
CheckpointKind = Literal["intermediate", "turn", "branch", "rung", "spec"]  # what a commit names
CheckpointClass = Literal[CheckpointKind, "superseded"]  # and what only the index demotes to
CLASSES: tuple[CheckpointClass, ...] = get_args(CheckpointClass)
COMMIT_KINDS: tuple[CheckpointKind, ...] = get_args(CheckpointKind)

# Larger than any reachable logical tick, so a bonus tier always dominates recency.
TIER = float(2**40)


@dataclass(frozen=True)
class PerClass:
    """One weight per checkpoint class."""

    intermediate: float = 0.0
    turn: float = 0.0
    branch: float = 0.0
    rung: float = 0.0
    spec: float = 0.0
    superseded: float = 0.0

    def __getitem__(self, cls: CheckpointClass) -> float:
        return float(getattr(self, cls))

    @classmethod
    def kept(cls, intermediate: float, kept: float) -> PerClass:
        """`intermediate` for intermediate checkpoints, `kept` for every other class."""
        return cls(intermediate, *(kept for _ in CLASSES[1:]))


@dataclass(frozen=True)
class Entry:
    """What the score reads of one eviction-set member: `counts` and `gains` are per class (in
    `CLASSES` order) over the checkpoints its eviction removes; `pages` is its own page set."""

    is_mla: bool
    last_used: int
    clock_stamp: float
    prefix_tokens: int
    pages: int
    counts: tuple[int, ...]
    gains: tuple[int, ...]


@dataclass(frozen=True)
class EvictionWeights:
    recency: float = 0.0
    clock: float = 0.0
    mla: float = 0.0  # the bonus of an MLA page
    depth: float = 0.0
    bonus: PerClass = PerClass()
    value: PerClass = PerClass()

    @classmethod
    def tiers(cls, recency: float, mla: float, intermediate: float, durable: float,
              depth: float = 0.0) -> EvictionWeights:
        """Bonus tiers only: intermediate checkpoints, MLA pages, and every kept class."""
        return cls(recency=recency, mla=mla, depth=depth,
                   bonus=PerClass.kept(intermediate, durable))

    def terms(self, entry: Entry, kda_groups: int) -> tuple[float, float]:
        """(bonus, value term): the class-dependent parts of the score. A checkpoint counts once
        in its own class, so its bonus is its class's."""
        bonus, value, freed = (self.mla if entry.is_mla else -math.inf), 0.0, entry.pages
        for cls, n, gain in zip(CLASSES, entry.counts, entry.gains):
            if n > 0:
                bonus = max(bonus, self.bonus[cls])
                value = value + self.value[cls] * gain
                if entry.is_mla:
                    freed = freed + n * kda_groups
        return bonus, value / freed

    def score(self, entry: Entry, kda_groups: int) -> float:
        bonus, value = self.terms(entry, kda_groups)
        return (self.recency * entry.last_used + self.clock * entry.clock_stamp + bonus
                + self.depth * entry.prefix_tokens / entry.pages + value)

    def as_pool_fields(self) -> dict[str, float]:
        """The weights as the pool's meta hash holds them, where the scripts read them."""
        scalars, per_class = weight_names()
        fields = {pool_field(name): getattr(self, name) for name in scalars}
        for cls in CLASSES:
            for name in per_class:
                fields[pool_field(name, cls)] = getattr(self, name)[cls]
        return fields


def weight_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The `EvictionWeights` fields that are one number, and those that are a `PerClass`: with
    `CLASSES` and `pool_field`, all that the scripts are told of the weights' names."""
    hints = get_type_hints(EvictionWeights)
    names = [f.name for f in dataclasses.fields(EvictionWeights)]
    return (tuple(n for n in names if hints[n] is not PerClass),
            tuple(n for n in names if hints[n] is PerClass))


def pool_field(weight: str, cls: str | None = None) -> str:
    """The meta hash field of one weight (`cls`: of one class, for a per-class weight)."""
    return f"w_{weight}" if cls is None else f"w_{weight}_{cls}"


def lru() -> EvictionWeights:
    """Least recently used first, in three tiers: intermediate checkpoints are recycled before MLA
    pages, and kept checkpoints (turn ends, branch points, rungs), with the pages that anchor
    them, outlive both."""
    return EvictionWeights.tiers(recency=1.0, mla=TIER, intermediate=0.0, durable=2 * TIER)


def recency() -> EvictionWeights:
    """`lru`, with speculative rungs and superseded turn ends in the intermediate tier: the
    weights of the adaptive replay runner's recency mode (deep sessions under a tight budget)."""
    tiers = lru()
    return dataclasses.replace(tiers, bonus=dataclasses.replace(tiers.bonus, spec=0.0,
                                                                superseded=0.0))


def value() -> EvictionWeights:
    """GreedyDual on prefill tokens saved per page id (Marconi-like): a kimi-k3 checkpoint takes
    three page ids, the room of 18,432 tokens of MLA pages, so it stays only where it saves more.
    Branch points are worth double (every later sibling resumes there); speculative rungs and
    superseded turn ends are worth little but not nothing."""
    return EvictionWeights(clock=1.0, value=PerClass(intermediate=0.0, turn=1.0, branch=2.0,
                                                     rung=1.0, spec=0.02, superseded=0.2))


EVICTION_POLICIES = {"lru": lru, "recency": recency, "value": value}


def eviction_weights(name: str) -> EvictionWeights:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"expected one of {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name]()
