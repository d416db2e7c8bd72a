"""Request traces: Mooncake-format JSONL in and out, token synthesis, synthetic agentic sessions.

Format (the Mooncake FAST'25 release, ../shared/traces/README.md): one JSON object per line with
`timestamp` (ms from start), `input_length` and `output_length` (tokens) and `hash_ids`, one integer
per `block_tokens` (512) tokens of the input, the last block possibly partial, so
len(hash_ids) == ceil(input_length / block_tokens). Ids are prefix-chained: an id stands for its
whole prefix, so two requests share their first n blocks exactly when their first n ids are equal.
`synth_agentic` adds `session_id` and `turn`; both are optional on input.

Turn ends. The index keeps the KDA checkpoint at a turn end (the next turn resumes there). A trace
without session ids (Mooncake) says nothing about turns, so every request's input end is taken as
a turn end: its last hash-block-aligned position is the checkpoint a later request may resume
from. Traces with session ids use the same rule (the index prefills prompts only, so the reply's
tokens are never registered; the next turn's prompt re-enters them as new tokens): session ids
and turns are carried for analysis, they change no policy decision.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

BLOCK_TOKENS = 512
VOCAB = 32_000


class TraceError(ValueError):
    """A trace line is malformed; `line` is its 1-based line number (0 when not from a file)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int  # ms from the trace start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: int | None = None
    turn: int | None = None

    def complete_blocks(self, block_tokens: int = BLOCK_TOKENS) -> int:
        return self.input_length // block_tokens

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timestamp": self.timestamp, "input_length": self.input_length,
                               "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.session_id is not None:
            out["session_id"] = self.session_id
        if self.turn is not None:
            out["turn"] = self.turn
        return out


def _int_field(obj: dict[str, Any], key: str, line: int, low: int, optional: bool = False) -> Any:
    if key not in obj:
        if optional:
            return None
        raise TraceError(line, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(line, f"{key} must be an integer >= {low}, got {value!r}")
    return value


def parse_request(text: str, line: int = 0, block_tokens: int = BLOCK_TOKENS) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(line, f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(line, f"expected a JSON object, got {type(obj).__name__}")
    timestamp = _int_field(obj, "timestamp", line, 0)
    length = _int_field(obj, "input_length", line, 1)
    output = _int_field(obj, "output_length", line, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(line, "missing or non-list field 'hash_ids'")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(line, f"hash_ids[{i}] must be an integer >= 0, got {h!r}")
    want = -(-length // block_tokens)
    if len(ids) != want:
        raise TraceError(line, f"{len(ids)} hash_ids for input_length {length}: expected "
                         f"ceil({length} / {block_tokens}) = {want}")
    return TraceRequest(timestamp, length, output, tuple(ids),
                        _int_field(obj, "session_id", line, 0, optional=True),
                        _int_field(obj, "turn", line, 0, optional=True))


class _ChainCheck:
    """Prefix-chaining: an id stands for its whole prefix, so it always sits at the same position
    after the same parent id. A partial last block is a different prefix from the full one, so its
    id is checked the same way."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int]] = {}

    def check(self, req: TraceRequest, line: int) -> None:
        parent = -1
        for pos, h in enumerate(req.hash_ids):
            known = self.seen.setdefault(h, (pos, parent))
            if known != (pos, parent):
                raise TraceError(line, f"hash id {h} at block {pos} after {parent} was seen at block "
                                 f"{known[0]} after {known[1]}: ids are not prefix-chained")
            parent = h


def parse_lines(lines: Iterable[str], block_tokens: int = BLOCK_TOKENS,
                check_chaining: bool = True) -> Iterator[TraceRequest]:
    chain = _ChainCheck()
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        req = parse_request(text, n, block_tokens)
        if check_chaining:
            chain.check(req, n)
        yield req


def read_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS,
               check_chaining: bool = True) -> list[TraceRequest]:
    """Every request of a JSONL trace, in file order; a bad line raises `TraceError` naming it."""
    with open(path, encoding="utf-8") as f:
        return list(parse_lines(f, block_tokens, check_chaining))


def write_trace(out: str | Path | TextIO, requests: Iterable[TraceRequest]) -> None:
    if isinstance(out, (str, Path)):
        with open(out, "w", encoding="utf-8") as f:
            write_trace(f, requests)
        return
    for req in requests:
        out.write(json.dumps(req.to_json(), separators=(", ", ": ")) + "\n")


# -- token synthesis ------------------------------------------------------------------------------

def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_tokens_for(hash_ids: Sequence[int] | np.ndarray, block_tokens: int = BLOCK_TOKENS,
                     vocab: int = VOCAB) -> np.ndarray:
    """[len(hash_ids), block_tokens] uint32 token ids, a pure function of each hash id: equal ids
    give equal blocks, so equal id prefixes give equal token prefixes and equal chained hashes."""
    ids = np.asarray(hash_ids, dtype=np.uint64).reshape(-1, 1)
    pos = np.arange(block_tokens, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        mixed = _splitmix64(ids * np.uint64(1 << 20) + pos)
    return (mixed % np.uint64(vocab)).astype(np.uint32)


def synth_tokens(req: TraceRequest, block_tokens: int = BLOCK_TOKENS, vocab: int = VOCAB) -> np.ndarray:
    """The request's prompt as uint32 token ids; a partial last block is a prefix of its id's block."""
    return block_tokens_for(req.hash_ids, block_tokens, vocab).reshape(-1)[:req.input_length]


# -- synthetic agentic traces ---------------------------------------------------------------------

@dataclass(frozen=True)
class AgenticSpec:
    """Agentic multi-turn sessions. Each session opens with one of a few shared system prompts and
    one of a few shared tool-definition sets; every turn appends the model's reply and then either
    a tool output (most turns: log-normal sizes, some whole files) or a user message. Some sessions
    are short, `long_fraction` of them run until `max_context`. A turn may fork the session (a
    sub-agent, a retry or an edit starts from the context rewound by up to 5 segments, then
    diverges): a branch point mid-context, where no turn ended."""

    sessions: int = 200
    seed: int = 0
    block_tokens: int = BLOCK_TOKENS
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (1_500, 7_000)
    tool_sets: int = 5
    tool_tokens: tuple[int, int] = (1_000, 9_000)
    user_tokens: tuple[int, int] = (20, 600)
    tool_output_median: int = 700
    tool_output_sigma: float = 1.4
    tool_output_max: int = 40_000
    output_tokens: tuple[int, int] = (30, 800)
    turns_mean: float = 8.0
    long_fraction: float = 0.2
    max_context: int = 160_000
    fork_prob: float = 0.04
    fork_turns_mean: float = 3.0
    user_turn_prob: float = 0.25
    session_rate_per_s: float = 0.4
    tool_latency_s: float = 2.0
    user_think_s: float = 25.0
    decode_ms_per_token: float = 20.0


@dataclass
class _Session:
    sid: int
    t_ms: float
    turns_left: int
    segments: list[tuple[int, int]] = field(default_factory=list)  # (segment uid, tokens)
    starts: list[int] = field(default_factory=list)  # each segment's first token
    tokens: int = 0
    full_ids: list[int] = field(default_factory=list)  # ids of the complete blocks so far
    turn: int = 0

    def append(self, uid: int, n: int) -> None:
        self.segments.append((uid, n))
        self.starts.append(self.tokens)
        self.tokens += n

    def fork(self, sid: int, turns_left: int, keep_segments: int, block: int) -> _Session:
        """A new session from the context's first `keep_segments` segments (a rewind)."""
        tokens = self.starts[keep_segments] if keep_segments < len(self.segments) else self.tokens
        return _Session(sid, self.t_ms, turns_left, self.segments[:keep_segments],
                        self.starts[:keep_segments], tokens, self.full_ids[:tokens // block], 0)


class _Interner:
    """Prefix-chained ids: (parent id, block content) -> id, content being the segment spans the
    block covers, so an id stands for its whole prefix by construction."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def block_key(self, s: _Session, first: int, last: int) -> tuple[tuple[int, int, int], ...]:
        pieces = []
        k = bisect.bisect_right(s.starts, first) - 1
        pos = first
        while pos < last:
            uid, n = s.segments[k]
            end = min(last, s.starts[k] + n)
            pieces.append((uid, pos - s.starts[k], end - s.starts[k]))
            pos = end
            k += 1
        return tuple(pieces)

    def hash_ids(self, s: _Session, block: int) -> tuple[int, ...]:
        """Ids of the session's current context; complete blocks are remembered for the next turn
        (a prompt is a prefix of the next one)."""
        full = s.tokens // block
        parent = s.full_ids[-1] if s.full_ids else -1
        for b in range(len(s.full_ids), full):
            parent = self._intern(parent, self.block_key(s, b * block, (b + 1) * block))
            s.full_ids.append(parent)
        ids = list(s.full_ids)
        if s.tokens % block:
            ids.append(self._intern(parent, self.block_key(s, full * block, s.tokens)))
        return tuple(ids)

    def _intern(self, parent: int, key: tuple[tuple[int, int, int], ...]) -> int:
        return self.ids.setdefault((parent, key), len(self.ids))


def synth_agentic(spec: AgenticSpec = AgenticSpec()) -> list[TraceRequest]:
    """Deterministic for a given spec (seed included); requests sorted by timestamp (stable)."""
    rng = np.random.default_rng(spec.seed)
    uid = iter(range(1 << 62))
    systems = [(next(uid), int(rng.integers(*spec.system_tokens, endpoint=True)))
               for _ in range(spec.system_prompts)]
    tools = [(next(uid), int(rng.integers(*spec.tool_tokens, endpoint=True)))
             for _ in range(spec.tool_sets)]
    interner = _Interner()
    out: list[TraceRequest] = []
    pending: list[_Session] = []
    t_ms = 0.0
    for sid in range(spec.sessions):
        t_ms += rng.exponential(1000.0 / spec.session_rate_per_s)
        long_run = rng.random() < spec.long_fraction
        turns = 10**6 if long_run else int(rng.geometric(1.0 / spec.turns_mean))
        s = _Session(sid, t_ms, turns)
        # Zipf-like popularity: the first prompts and tool sets are the most shared.
        s.append(*systems[min(int(rng.zipf(1.6)) - 1, len(systems) - 1)])
        s.append(*tools[min(int(rng.zipf(1.6)) - 1, len(tools) - 1)])
        s.append(next(uid), int(rng.integers(*spec.user_tokens, endpoint=True)))
        pending.append(s)
    next_sid = spec.sessions
    while pending:
        s = pending.pop()
        while s.turns_left > 0 and s.tokens < spec.max_context:
            output = int(rng.integers(*spec.output_tokens, endpoint=True))
            out.append(TraceRequest(int(s.t_ms), s.tokens, output, interner.hash_ids(s, spec.block_tokens),
                                    s.sid, s.turn))
            s.turn += 1
            s.turns_left -= 1
            if rng.random() < spec.fork_prob:
                keep = max(3, len(s.segments) - int(rng.integers(0, 6)))
                child = s.fork(next_sid, int(rng.geometric(1.0 / spec.fork_turns_mean)), keep,
                               spec.block_tokens)
                next_sid += 1
                child.append(next(uid), int(rng.integers(*spec.user_tokens, endpoint=True)))
                child.t_ms += rng.exponential(1000.0 * spec.tool_latency_s)
                pending.append(child)
            s.append(next(uid), output)
            s.t_ms += output * spec.decode_ms_per_token
            if rng.random() < spec.user_turn_prob:
                s.append(next(uid), int(rng.integers(*spec.user_tokens, endpoint=True)))
                s.t_ms += rng.exponential(1000.0 * spec.user_think_s)
            else:
                n = rng.lognormal(math.log(spec.tool_output_median), spec.tool_output_sigma)
                s.append(next(uid), int(min(max(n, 1), spec.tool_output_max)))
                s.t_ms += rng.exponential(1000.0 * spec.tool_latency_s)
    out.sort(key=lambda r: r.timestamp)
    return out
