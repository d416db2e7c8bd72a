"""The hand-made trace whose every hit is worked out below, per checkpoint placement: the shared
oracle of the policy model (test_replay_model) and of the replay through the real index
(test_replay)."""

from __future__ import annotations

from cachetier.replay.traces import TraceRequest

B = 512


def req(t: int, ids: list[int], length: int) -> TraceRequest:
    return TraceRequest(t, length, 1, tuple(ids))


# Hash blocks of 512 tokens, pages of 6,144 (12 blocks). Block k of r4/r5 past 13 has id k + 26.
R1 = req(0, [*range(1, 14), 100], 13 * B + 100)      # 13 complete blocks + a partial one
R2 = req(1, [1, 2, 3, 4, 5, 20, 21], 7 * B)           # shares 5 blocks with r1
R3 = req(2, [1, 2, 3, 4, 5, 30, 31, 32, 33], 8 * B + 10)  # shares the same 5 blocks
R4 = req(3, [*range(1, 14), *range(40, 53)], 26 * B)  # continues r1 (turn end at 13)
R5 = req(4, [*range(1, 14), *range(40, 52), 70, 71], 27 * B)  # follows r4 for 25 blocks
HAND = [R1, R2, R3, R4, R5]
TOTAL = 6756 + 3584 + 4106 + 13312 + 13824  # 41,582 input tokens
# usable blocks = min(complete, (L-1)//512): r1 13, r2 6, r3 8, r4 25, r5 26.
# oracle: r2, r3 match 5 blocks (2,560); r4 matches r1's 13 (6,656); r5 matches 25 (12,800).
# seed: checkpoints at turn ends (r1 @13, r2 @7, r3 @8, r4 @26, r5 @27) and, for the prompts
#   that end on a block boundary (r2, r4, r5), at their resend points one block earlier (@6, @25,
#   @26 of r5's own chain): r4 hits r1's @13, r5 (which leaves r4's chain after 25 blocks) hits
#   r4's resend point @25 = 12,800.
# branch: r2 finds MLA match 5 > hit 0 and writes a branch point @5, so r3 hits 2,560.
# ladder: r1 also writes a rung @12 and r4 (prefill from 13) a rung @24: r5 hits r4's @25 above it.
# coupled (6,144-token blocks): chains are the ids at blocks 12 and 24; r1 checkpoints page 1,
#   r4 hits it (6,144) and checkpoints page 2 (its floor(L/6144)); r5 hits page 2 (12,288).
# full-6144: the same pages without checkpoints: 6,144 + 12,288.
EXPECTED = {
    "oracle": 2560 + 2560 + 6656 + 12800,
    "seed": 6656 + 12800,
    "branch": 2560 + 6656 + 12800,
    "ladder": 2560 + 6656 + 12800,
    "coupled": 6144 + 12288,
    "full-6144": 6144 + 12288,
}
