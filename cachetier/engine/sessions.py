"""Agentic multi-turn sessions at token level: the traffic the demo and the oracle tests serve.

What makes prefix caching matter for agents is reproduced on purpose: a few system prompts and
tool-definition blocks shared by many sessions, conversations that grow turn by turn (each prompt
is the previous one plus the model's reply and a tool output or user message), and forks: a
session that branches off another one's conversation part-way through a turn (an edited message, a
retried tool call), so its prompt shares a prefix that ends where no checkpoint was ever taken.
Everything is drawn from one seed, so a run is reproducible and its hit ratio comparable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 32_000


@dataclass(frozen=True)
class SessionSpec:
    sessions: int = 8
    turns: int = 4
    system_prompts: int = 2
    tool_sets: int = 2
    system_tokens: tuple[int, int] = (60, 140)
    tool_tokens: tuple[int, int] = (30, 90)
    message_tokens: tuple[int, int] = (8, 40)
    tool_output_tokens: tuple[int, int] = (16, 100)
    reply_tokens: tuple[int, int] = (6, 30)
    fork_fraction: float = 0.25
    think_steps: tuple[int, int] = (0, 2)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be >= 1")
        if not 0.0 <= self.fork_fraction <= 1.0:
            raise ValueError("fork_fraction must lie in [0, 1]")


@dataclass(frozen=True)
class Session:
    """One conversation: the prompt of each turn (each one extends the previous), and how many
    scheduling steps the client thinks before sending each turn."""

    name: str
    prompts: list[list[int]]
    think_steps: list[int]
    forked_from: str | None = None


@dataclass
class _Drawer:
    rng: random.Random

    def words(self, bounds: tuple[int, int]) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(*bounds))]


def make_sessions(spec: SessionSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    draw = _Drawer(rng)
    systems = [draw.words(spec.system_tokens) for _ in range(spec.system_prompts)]
    tools = [draw.words(spec.tool_tokens) for _ in range(spec.tool_sets)]
    sessions: list[Session] = []
    for n in range(spec.sessions):
        forks = [s for s in sessions if s.forked_from is None]
        if forks and rng.random() < spec.fork_fraction:
            parent = rng.choice(forks)
            turn = rng.randrange(len(parent.prompts))
            base = parent.prompts[turn]
            cut = rng.randint(len(base) // 2, len(base) - 1)  # part-way through the turn
            first = base[:cut] + draw.words(spec.message_tokens)
            forked_from: str | None = parent.name
        else:
            first = (systems[rng.randrange(len(systems))] + tools[rng.randrange(len(tools))]
                     + draw.words(spec.message_tokens))
            forked_from = None
        prompts = [first]
        for _ in range(spec.turns - 1):
            prompts.append(prompts[-1] + draw.words(spec.reply_tokens)
                           + draw.words(rng.choice((spec.tool_output_tokens, spec.message_tokens))))
        thinks = [rng.randint(*spec.think_steps) for _ in prompts]
        sessions.append(Session(f"s{n}", prompts, thinks, forked_from))
    return sessions
