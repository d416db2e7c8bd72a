"""The one face of the index: the verbs a scheduler step uses, whoever answers them.

`PrefixIndex` (the Lua scripts in Redis), `ReferenceIndex` (the in-memory model the property tests
compare it with) and a pool of the service seen through `CacheTierClient.pool` all implement
`Index`, so the request lifecycle, the engine, the replay and the tests drive any of them the same
way. Every call is one atomic operation on one pool; `epoch` is the pool epoch the caller last saw,
and a call made in a voided epoch raises `StaleEpoch` (the caller's pins are gone) and refreshes
it. `probe` and `stats` only read, and answer for whatever epoch the pool is in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from index.prefix import PrefixProbe
from index.records import (CommitItem, CommitResult, IndexStats, ReleaseResult, StepPlan,
                           StepRefusal, StepRequest)


@runtime_checkable
class Index(Protocol):
    @property
    def epoch(self) -> int:
        """The pool epoch this face last saw; calls carry it."""

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        """Lookup, pin and allocate for a whole scheduling step, or refuse it whole."""

    async def commit(self, items: Sequence[CommitItem]) -> CommitResult:
        """Register what a forward pass computed; pending until its ticket is confirmed."""

    async def confirm(self, ticket: int) -> int:
        """Settle a plan's copies or a commit's writes; returns the ticket's requests still active."""

    async def release(self, rids: Sequence[str]) -> ReleaseResult:
        """End requests: unpin, free private pages, roll back what was never confirmed."""

    async def probe(self, prompt_tokens: int, hashes: bytes) -> PrefixProbe:
        """What the pool could serve of a prompt now, read-only."""

    async def stats(self) -> IndexStats:
        """The pool's counters, from one bounded script (never a walk over its keys)."""
