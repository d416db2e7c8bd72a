"""Is an engine's output served through the tier a reference engine's output? The comparison.

Exact equality would be the strictest oracle, and it does not hold here for a reason that is not
the tier's: vLLM's CPU Gated DeltaNet kernel runs in bfloat16 only, and the recurrent state at a
boundary depends on where the prefill was cut into chunks (a cold engine with prefix caching off
cuts a prompt at other places than an engine that resumed from a hit, and scheduling moves the
cuts too). On the tiny random model, whose top tokens are often within a few hundredths of a nat
of each other, that rounding alone flips a greedy token now and then.

So outputs are compared position by position while their contexts are the same (every earlier
token equal): at each such position every token both engines rank in their top 5 (at least one
must be: bfloat16 logits tie often, so which of the tied tokens make a top 5 is arbitrary) must
have the same logprob within the position's tolerance; where the greedy tokens first differ, the
reference engine must have ranked the served token within that tolerance of its own (a tie the
rounding can flip), and the comparison stops there (the continuations differ from then on). The
tolerance is `TOLERANCE` at the first token, which depends on the prompt only (the restored
state and KV), and grows by `DRIFT_PER_TOKEN` per generated token after it, since decoding
compounds the rounding: vLLM itself, in align mode with no hit at all, drifts from the cold
engine by up to 0.17 nats by the 8th token (measured on the tiny model). A state or KV page that
is wrong moves the first token's distribution by far more (the tests corrupt conv rows,
recurrent rows and attention rows, and check that each is caught).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TOLERANCE = 0.06
DRIFT_PER_TOKEN = 0.04


@dataclass(frozen=True)
class Verdict:
    outcome: Literal["equal", "tie", "mismatch"]
    position: int  # where it parted or failed; the output length when equal
    max_delta: float  # the largest logprob difference over the compared positions
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome != "mismatch"


def compare(served: dict[str, Any], cold: dict[str, Any], tolerance: float = TOLERANCE,
            drift: float = DRIFT_PER_TOKEN) -> Verdict:
    """`served` and `cold` are `cachetier.vllm.engine_run` results of one request."""
    worst = 0.0
    positions = zip(served["token_ids"], cold["token_ids"], served["top"], cold["top"])
    for position, (token, cold_token, top, cold_top) in enumerate(positions):
        allowed = tolerance + drift * position
        ranked, cold_ranked = dict(map(tuple, top)), dict(map(tuple, cold_top))
        shared = ranked.keys() & cold_ranked.keys()
        if not shared:
            return Verdict("mismatch", position, worst, "no top token in common")
        delta = max(abs(ranked[t] - cold_ranked[t]) for t in shared)
        worst = max(worst, delta)
        if delta > allowed:
            return Verdict("mismatch", position, worst,
                           f"a logprob {delta:.4f} nats from the cold engine's")
        if token != cold_token:
            gap = cold_ranked[cold_token] - cold_ranked.get(token, float("-inf"))
            if gap <= allowed:
                return Verdict("tie", position, worst)
            return Verdict("mismatch", position, worst,
                           f"token {token} where the cold engine chose {cold_token} "
                           f"(ranked {gap:.3f} nats below it)")
    if len(served["token_ids"]) != len(cold["token_ids"]):
        return Verdict("mismatch", min(len(served["token_ids"]), len(cold["token_ids"])), worst,
                       "outputs of different lengths")
    return Verdict("equal", len(served["token_ids"]), worst)
