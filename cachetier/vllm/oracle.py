"""Is an engine's output served through the tier the cold engine's output? The comparison.

Exact equality would be the strictest oracle, and it does not hold here for a reason that is not
the tier's: vLLM's CPU Gated DeltaNet kernel runs in bfloat16 only, and the recurrent state at a
boundary depends on where the prefill was cut into chunks (a cold engine with prefix caching off
cuts a prompt at other places than an engine that resumed from a hit). On the tiny random model,
whose top tokens are often within a few hundredths of a nat of each other, that rounding alone
flips a greedy token now and then (measured: up to 0.03 nat between runs that restore nothing).

So outputs are compared position by position while their contexts are the same (every earlier
token equal): at each such position the two engines' top tokens must mostly coincide (at least
`MIN_SHARED` of the `TOP_K` each reports) and every token both rank must have the same logprob
within `tolerance` nats; where the greedy tokens first differ, the cold engine must have ranked
the served token within `tolerance` of its own (a tie the rounding can flip), and the comparison
stops there (the continuations differ from then on). A state or KV page that is wrong moves the
distribution by more than that from the first token (the tests corrupt conv rows, recurrent rows
and attention rows, and check that each is caught).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TOLERANCE = 0.06
MIN_SHARED = 3


@dataclass(frozen=True)
class Verdict:
    outcome: Literal["equal", "tie", "mismatch"]
    position: int  # where it parted or failed; the output length when equal
    max_delta: float  # the largest logprob difference over the compared positions
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome != "mismatch"


def compare(served: dict[str, Any], cold: dict[str, Any],
            tolerance: float = TOLERANCE) -> Verdict:
    """`served` and `cold` are `cachetier.vllm.engine_run` results of one request."""
    worst = 0.0
    positions = zip(served["token_ids"], cold["token_ids"], served["top"], cold["top"])
    for position, (token, cold_token, top, cold_top) in enumerate(positions):
        ranked, cold_ranked = dict(map(tuple, top)), dict(map(tuple, cold_top))
        shared = ranked.keys() & cold_ranked.keys()
        if len(shared) < min(MIN_SHARED, len(cold_ranked)):
            return Verdict("mismatch", position, worst,
                           f"only {len(shared)} of the top {len(cold_ranked)} tokens in common")
        delta = max(abs(ranked[t] - cold_ranked[t]) for t in shared)
        worst = max(worst, delta)
        if delta > tolerance:
            return Verdict("mismatch", position, worst,
                           f"a logprob {delta:.4f} nats from the cold engine's")
        if token != cold_token:
            gap = cold_ranked[cold_token] - cold_ranked.get(token, float("-inf"))
            if gap <= tolerance:
                return Verdict("tie", position, worst)
            return Verdict("mismatch", position, worst,
                           f"token {token} where the cold engine chose {cold_token} "
                           f"(ranked {gap:.3f} nats below it)")
    if len(served["token_ids"]) != len(cold["token_ids"]):
        return Verdict("mismatch", min(len(served["token_ids"]), len(cold["token_ids"])), worst,
                       "outputs of different lengths")
    return Verdict("equal", len(served["token_ids"]), worst)
