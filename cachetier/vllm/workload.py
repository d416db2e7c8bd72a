"""An agentic multi-turn workload for several engines behind round-robin routing.

Sessions start from one of a few shared system prompts; each turn's prompt is the previous prompt,
the assistant's answer (synthetic tokens: the workload must not depend on what a random model says),
a tool's output where the spec asks for one (an agent reading a file or a search result:
`tool_tokens`: 1,000 to 2,500 tokens by default) and a new user message. Some sessions fork from another session's
turn (a retry or a parallel tool call): their first prompt is that turn's prompt plus a new message.
Requests are sent in rounds, round `t` carrying every session's turn `t`, and routed round-robin:
session `s` goes to engine `(s + t) % K` in round `t`, so a session's successive turns land on
different engines and each round spreads the sessions evenly; each engine gets its share of a round
as one batch. With `resends`, a last round sends every session's last turn again to the engine that
served it (a regenerate): each resend resumes from that engine's own cache at the prompt's tail,
inside a block unless the tail is a block end.

`oracle_hit_tokens` is the ideal reuse at the tier's hash-block granularity: every request reuses
its longest prefix shared with any request routed before it, at the deepest hash-block boundary
that leaves a token to compute (requests of one round run at once on different engines, so this
ideal is above what any cache reaches; an engine's batch does reuse within itself).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    engines: int = 2
    sessions: int = 5
    forks: int = 2
    turns: int = 4
    systems: int = 2
    system_tokens: int = 2350
    user_tokens: tuple[int, int] = (150, 500)
    answer_tokens: int = 64
    tool_tokens: tuple[int, int] = (1000, 2500)  # (0, 0): none
    vocab: int = 512
    seed: int = 0
    resends: bool = False


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: list[int]
    round: int
    engine: int


def build(spec: WorkloadSpec) -> list[list[Request]]:
    """The rounds, each a list of requests (with their engine), in routing order."""
    rng = random.Random(spec.seed)

    def draw(count: int) -> list[int]:
        return [rng.randrange(spec.vocab) for _ in range(count)]

    def message() -> list[int]:
        return draw(rng.randint(*spec.user_tokens))

    def answer() -> list[int]:
        tool = draw(rng.randint(*spec.tool_tokens)) if spec.tool_tokens[1] else []
        return draw(spec.answer_tokens) + tool

    systems = [draw(spec.system_tokens + 97 * i) for i in range(spec.systems)]
    sessions = [[systems[i % spec.systems] + message()] for i in range(spec.sessions)]
    for prompts in sessions:
        for _ in range(1, spec.turns):
            prompts.append(prompts[-1] + answer() + message())
    for f in range(spec.forks):  # another answer to a session's first turn, one round later
        fork = [sessions[f % spec.sessions][0] + answer() + message()]
        for _ in range(2, spec.turns):
            fork.append(fork[-1] + answer() + message())
        sessions.append(fork)
    rounds: list[list[Request]] = []
    for turn in range(spec.turns):
        batch = []
        for s, prompts in enumerate(sessions):
            forked = s >= spec.sessions
            index = turn - 1 if forked else turn  # a fork starts one round after its parent
            if 0 <= index < len(prompts):
                batch.append(Request(f"s{s}-t{turn}", prompts[index], turn,
                                     (s + turn) % spec.engines))
        rounds.append(batch)
    if spec.resends:
        rounds.append([Request(f"{r.rid}-resend", r.prompt, spec.turns, r.engine)
                       for r in rounds[-1]])
    return rounds


def oracle_hit_tokens(rounds: list[list[Request]], block_tokens: int) -> dict[str, int]:
    """Each request's ideal hit: its longest prefix shared with a request routed before it,
    floored to a hash-block boundary, at most `(P - 1) // B * B`."""
    earlier: list[list[int]] = []
    hits: dict[str, int] = {}
    for request in (r for batch in rounds for r in batch):
        shared = max((_common_prefix(request.prompt, other) for other in earlier), default=0)
        cap = (len(request.prompt) - 1) // block_tokens * block_tokens
        hits[request.rid] = min(shared // block_tokens * block_tokens, cap)
        earlier.append(request.prompt)
    return hits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
