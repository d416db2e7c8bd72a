"""Trace replay: request traces (Mooncake JSONL, synthetic agentic sessions) served through the
real index, one pool per replay runner (`runners.RUNNERS`: a pool configuration plus a checkpoint
placement, or the adaptive runner), under a byte budget or a sweep of them.

It reaches the index only through `PrefixIndex` (and the request lifecycle); it holds no pool
bytes: page payloads are elided. The independent pure-Python model of the same rules that pinned
the conventions down is a test oracle (`tests/policy_model.py`), not part of the package.
"""
