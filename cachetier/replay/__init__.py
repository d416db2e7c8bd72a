"""Trace replay: request traces (Mooncake JSONL, synthetic agentic sessions) and a pure-Python model
of the checkpoint policies at hash-block level, used to pin down their conventions and to compare
them under a byte budget before replaying through the real index.

It owns no Redis access and no pool bytes: `policy_model` is an independent re-statement of the
index's lookup, registration and eviction rules, not a client of `index`.
"""
