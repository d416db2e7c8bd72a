"""Is an engine's output served through the tier the cold engine's output? The comparison.

Exact equality would be the strictest oracle, and it does not hold here for a reason that is not
the tier's: vLLM's CPU Gated DeltaNet kernel runs in bfloat16 only, and the recurrent state at a
boundary depends on where the prefill was cut into chunks (a cold engine with prefix caching off
cuts a prompt at other places than an engine that resumed from a hit). On the tiny random model,
whose top tokens are often within a few hundredths of a nat of each other, that rounding alone
flips a greedy token now and then (measured: up to 0.03 nat between runs that restore nothing).

So outputs are compared position by position until they part: each shared position must agree
within `tolerance` nats on the chosen token's logprob; where the tokens first differ, the cold
engine must have ranked both within `tolerance` of each other (a tie the rounding can flip),
and the comparison stops there (the continuations differ from then on). A state or KV page that
is wrong moves the logprobs by tenths of a nat or more from the first token (the tests corrupt
conv rows, recurrent rows and attention rows and check that each is caught).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TOLERANCE = 0.06


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
    """`served` and `cold` are `engine_run` results of one request."""
    worst = 0.0
    pairs = zip(served["token_ids"], cold["token_ids"], served["logprobs"], cold["logprobs"],
                cold["top"])
    for position, (token, cold_token, logprob, cold_logprob, cold_top) in enumerate(pairs):
        if token != cold_token:
            ranked = dict(cold_top)
            gap = cold_logprob - ranked[token] if token in ranked else float("inf")
            if gap <= tolerance:
                return Verdict("tie", position, worst)
            return Verdict("mismatch", position, worst,
                           f"token {token} where the cold engine chose {cold_token} "
                           f"(ranked {gap:.3f} nats below it)")
        delta = abs(logprob - cold_logprob)
        worst = max(worst, delta)
        if delta > tolerance:
            return Verdict("mismatch", position, worst,
                           f"logprob {logprob:.4f} where the cold engine had {cold_logprob:.4f}")
    if len(served["token_ids"]) != len(cold["token_ids"]):
        return Verdict("mismatch", min(len(served["token_ids"]), len(cold["token_ids"])), worst,
                       "outputs of different lengths")
    return Verdict("equal", len(served["token_ids"]), worst)
