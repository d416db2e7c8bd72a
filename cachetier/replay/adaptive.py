"""The `adaptive` replay runner: the pool runs whichever of two modes has served more lately.

No one configuration of the index wins everywhere (`tests/policy_model.py` measures why): on
traces of many shared, branching prefixes (Mooncake) the best use of a tight budget is to keep
checkpoints at branch points and page ends and evict by prefill tokens saved per byte
(GreedyDual, Marconi);
on deep agentic sessions the same budget is better spent on one rung per prompt, evicted least
recently used first, since every turn extends a session that only its next turn will read. So:

- `value` mode: branch points, a rung at every page end (those above the prompt's deepest are
  `spec`), turn ends; `eviction.policy.value()` weights. The index demotes a turn end that a
  later turn resumed from and went past (`superseded`).
- `recency` mode: a rung at the prompt's deepest page end only, a turn end only for prompts
  within one page; `eviction.policy.recency()` weights (LRU tiers).

Both are configurations of the real index: a `CheckpointPlacement` (admission: where passes stop and
which checkpoints are kept, as what class) and `EvictionWeights` (one score formula). The runner
keeps the live pool plus one shadow pool per mode, each a metadata-only pool of the same index
and size fed the same requests (a replay has no bytes anyway; in a deployment a shadow is a pool
with no agent). Every `every` requests it compares the shadows' token hit ratios over the last
`window` requests and switches the live pool to the best mode when it beats the current one by
`margin`: the live pool's admission changes at once, its weights through `PrefixIndex.reweigh`
(bounded batches). At unlimited capacity nothing is evicted, the richest admission (value) is the
best, and no shadow is kept.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from redis.asyncio import Redis

from cachetier.engine.checkpoint_placement import CheckpointPlacement
from cachetier.replay.replayer import (UNLIMITED_PAGES, PolicyCounters, PoolRunner, ReplayContext,
                                       ServedRequest)
from cachetier.replay.traces import TraceRequest
from eviction.policy import EvictionWeights, recency, value


@dataclass(frozen=True)
class Mode:
    """Admission and eviction of one mode."""

    name: str
    policy: CheckpointPlacement
    weights: EvictionWeights


VALUE = Mode("value", CheckpointPlacement("adaptive/value", branch_points=True, page_ladder=True,
                                       spec_rungs=True), value())
RECENCY = Mode("recency", CheckpointPlacement("adaptive/recency", deepest_rung=True,
                                           short_turn_ends=True), recency())
MODES = (VALUE, RECENCY)


@dataclass(frozen=True)
class Switching:
    window: int = 1000  # requests over which the shadows are compared
    every: int = 100  # requests between decisions
    margin: float = 0.002  # token hit ratio a challenger must gain over the current mode


class AdaptiveRunner:
    """A `PolicyRunner`: the live pool and its shadows, all pools of the real index."""

    def __init__(self, name: str, live: PoolRunner, shadows: list[PoolRunner],
                 modes: tuple[Mode, ...] = MODES, switching: Switching = Switching()) -> None:
        """`shadows[i]` runs `modes[i]` throughout (none: the live pool stays in modes[0]); the
        live pool starts in modes[0]."""
        if shadows and len(shadows) != len(modes):
            raise ValueError("one shadow pool per mode, or none")
        self.name = name
        self.live, self.shadows, self.modes, self.switching = live, shadows, modes, switching
        self.current = 0
        # the last `window` requests: input tokens, and each shadow's hit tokens
        self.recent: collections.deque[tuple[int, tuple[int, ...]]] = collections.deque(
            maxlen=switching.window)
        self.seen = 0
        self.switches: list[tuple[int, str]] = []  # (requests seen, mode switched to)

    @classmethod
    def for_replay(cls, ctx: ReplayContext, switching: Switching = Switching()) -> AdaptiveRunner:
        live = ctx.pool("adaptive", ctx.config, MODES[0].policy, MODES[0].weights)
        shadows = [] if ctx.config.cache.num_pages >= UNLIMITED_PAGES else [
            ctx.pool(f"adaptive.{m.name}", ctx.config, m.policy, m.weights) for m in MODES]
        return cls("adaptive", live, shadows, switching=switching)

    @property
    def mode(self) -> Mode:
        return self.modes[self.current]

    async def setup(self, redis: Redis) -> None:
        for runner in (self.live, *self.shadows):
            await runner.setup(redis)

    async def serve(self, request: TraceRequest) -> ServedRequest:
        served, *shadowed = await asyncio.gather(
            self.live.serve(request), *(s.serve(request) for s in self.shadows))
        if shadowed:
            self.recent.append((request.input_length, tuple(s.hit_tokens for s in shadowed)))
            self.seen += 1
            if self.seen % self.switching.every == 0:
                await self._decide()
        return served

    async def _decide(self) -> None:
        total = sum(tokens for tokens, _ in self.recent)
        ratios = [sum(hits[i] for _, hits in self.recent) / total for i in range(len(self.modes))]
        best = max(range(len(ratios)), key=ratios.__getitem__)
        if best != self.current and ratios[best] > ratios[self.current] + self.switching.margin:
            self.current = best
            self.live.policy = self.mode.policy
            await self.live.index.reweigh(self.mode.weights)
            self.switches.append((self.seen, self.mode.name))

    async def counters(self) -> PolicyCounters:
        return await self.live.counters()
