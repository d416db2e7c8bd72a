"""The demo workload of `cachetier up --workload N`: multi-turn chats driven like a scheduler would.

Every session opens with the same system prompt, then each turn is a new request whose prompt is
the previous one plus the model's reply and the next user message. Turns are prefilled in chunks,
one `plan` per scheduling step for all the requests in flight, with a checkpoint committed at each
chunk end and `turn_end` at turn boundaries (the end of the system prompt and of the prompt), so
that what later requests can reuse is exactly what an engine would keep. Session `s` starts at
round `s`, so from the second session on even a first turn finds the shared system prompt cached.
There is no forward pass: the agents move bytes nobody reads; the point is the index's answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetier.client import CacheTierClient
from cachetier.config import Config
from index.hashing import chain_hashes, namespace_root
from index.records import CommitItem, RequestPlan, StepPlan, StepRequest

VOCAB = 32_000


class WorkloadError(RuntimeError):
    """The tier refused a step of the demo: the pool is too small for the sessions asked for."""


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int
    turns: int = 3
    system_tokens: int = 64  # one chunk: a cold first chunk ends exactly on the shared prefix
    chunk_tokens: int = 64
    user_tokens: tuple[int, int] = (20, 60)
    reply_tokens: tuple[int, int] = (16, 40)
    seed: int = 0


@dataclass
class Summary:
    requests: int = 0
    hit_requests: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    steps: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.requests += 1
        self.hit_requests += hit_tokens > 0
        self.tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def as_dict(self) -> dict[str, int | float]:
        return {"requests": self.requests, "hit_requests": self.hit_requests,
                "tokens": self.tokens, "hit_tokens": self.hit_tokens,
                "hit_ratio": round(self.hit_ratio, 4), "steps": self.steps}


@dataclass
class _Turn:
    """One request being prefilled: its prompt, where the prefill stands, what it hit."""

    rid: str
    tokens: list[int]
    boundaries: frozenset[int]  # turn boundaries: the checkpoints there are kept
    pos: int = 0
    hit: int = -1  # known after the first step
    steps: int = 0

    def next_stop(self, chunk: int) -> int:
        """A chunk end, cut short at the next turn boundary so a checkpoint lands on it."""
        ahead = [b for b in self.boundaries if b > self.pos]
        return min([self.pos + chunk, *ahead])


@dataclass
class _Session:
    system: list[int]
    rng: random.Random
    tokens: list[int] = field(default_factory=list)

    def next_prompt(self, spec: WorkloadSpec) -> list[int]:
        """The previous prompt, the reply to it (none before the first turn), a new message."""
        reply = self._words(*spec.reply_tokens) if self.tokens else []
        self.tokens = (self.tokens or self.system) + reply + self._words(*spec.user_tokens)
        return self.tokens

    def _words(self, low: int, high: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(low, high))]


class Workload:
    """See the module docstring; `progress` gets one line per finished request."""

    def __init__(self, tier: CacheTierClient, pool: str, config: Config, spec: WorkloadSpec,
                 progress: Callable[[str], None]) -> None:
        self.tier = tier
        self.pool = pool
        self.spec = spec
        self.progress = progress
        self.block = config.cache.hash_block_tokens
        self.algo = config.cache.hash_algo
        self.root = namespace_root(config.model.name, algo=self.algo)
        self.summary = Summary()

    async def run(self) -> Summary:
        rng = random.Random(self.spec.seed)
        system = [rng.randrange(VOCAB) for _ in range(self.spec.system_tokens)]
        sessions = [_Session(system, random.Random(rng.random())) for _ in range(self.spec.sessions)]
        for round_ in range(self.spec.sessions + self.spec.turns - 1):
            await self._prefill([self._turn(f"s{s}-t{round_ - s}", session.next_prompt(self.spec))
                                 for s, session in enumerate(sessions)
                                 if 0 <= round_ - s < self.spec.turns])
        return self.summary

    def _turn(self, rid: str, tokens: list[int]) -> _Turn:
        return _Turn(rid, tokens, frozenset({self.spec.system_tokens, len(tokens)}))

    async def _prefill(self, turns: list[_Turn]) -> None:
        """Scheduling steps until every turn is prefilled: plan, commit, confirm, release."""
        active = {turn.rid: turn for turn in turns}
        while active:
            plan = await self.tier.plan(self.pool, [self._step(t) for t in active.values()])
            if not isinstance(plan, StepPlan):
                raise WorkloadError(f"step refused: {plan.reason} ({plan.pages_needed} pages "
                                    f"needed, {plan.pages_available} available)")
            self.summary.steps += 1
            items = [self._advance(active[r.rid], r) for r in plan.requests]
            done = await self.tier.commit(self.pool, items)
            await self.tier.confirm(self.pool, done.ticket)
            finished = [rid for rid, turn in active.items() if turn.pos == len(turn.tokens)]
            if finished:
                await self.tier.release(self.pool, finished)
            for rid in finished:
                self._report(active.pop(rid))

    def _step(self, turn: _Turn) -> StepRequest:
        """A new request sends its hashes (the hit decides where it starts); a continuing one
        only how far to go."""
        if turn.hit < 0:
            hashes = chain_hashes(turn.tokens, self.root, self.block, self.algo)
            return StepRequest(turn.rid, self.spec.chunk_tokens, len(turn.tokens), hashes)
        return StepRequest(turn.rid, turn.next_stop(self.spec.chunk_tokens) - turn.pos)

    def _advance(self, turn: _Turn, plan: RequestPlan) -> CommitItem:
        """What the forward pass of this step would commit: the KDA state at the last hash-block
        boundary it crossed, kept if the chunk ends on a turn boundary."""
        if turn.hit < 0:
            turn.hit = plan.hit_tokens
        turn.pos = plan.stop
        turn.steps += 1
        checkpoint = plan.stop // self.block * self.block
        if not plan.checkpoint_pages or checkpoint <= plan.start:
            checkpoint = 0
        return CommitItem(turn.rid, plan.stop, checkpoint, plan.stop in turn.boundaries)

    def _report(self, turn: _Turn) -> None:
        self.summary.record(len(turn.tokens), turn.hit)
        self.progress(f"{turn.rid}: {len(turn.tokens)} tokens, hit {turn.hit} "
                      f"({turn.steps} steps)")
