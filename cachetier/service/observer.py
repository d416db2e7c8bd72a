"""Where the service reports what happens, for cache events (MQTT), metrics and tests.

The base class is the null implementation (STYLE 7); `cachetier.events.observers.EventsObserver`
turns these records into `cachetier.events.cache_events` batches, `cachetier.service.metrics`
into Prometheus series. Methods are plain calls made on the hot path and must not block: an
implementation that talks to the network queues the work or starts a task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachetier.errors import ErrorInfo
from index.records import CommitResult, ReleaseResult, StepPlan


class ServiceObserver:
    def step_planned(self, pool: str, plan: StepPlan) -> None:
        """A step was planned, copied on every rank and confirmed; `plan.removed` was evicted."""

    def committed(self, pool: str, result: CommitResult) -> None:
        """A forward pass's results were registered (pending until their ticket is confirmed)."""

    def released(self, pool: str, result: ReleaseResult) -> None:
        """Requests ended; `result.removed` holds what was rolled back."""

    def invalidated(self, pool: str, epoch: int) -> None:
        """The pool started `epoch`: everything cached before is gone."""

    def answered(self, request: Any, reply: Any, error: ErrorInfo | None, seconds: float) -> None:
        """A client's request (a `cachetier.wire.protocol` message) was answered with `reply`,
        or failed with `error`, `seconds` after it was dispatched."""

    def quota_rejected(self, pool: str | None, limit: str) -> None:
        """A request (or a connection, `pool` None) was refused because its client or its
        credential is at `limit` (a quota's or a share's name), before any work was done for
        it."""


class ObserverGroup(ServiceObserver):
    """Several observers seen as one: each call reaches every member, in order."""

    def __init__(self, members: Sequence[ServiceObserver]) -> None:
        self.members = list(members)

    def step_planned(self, pool: str, plan: StepPlan) -> None:
        for member in self.members:
            member.step_planned(pool, plan)

    def committed(self, pool: str, result: CommitResult) -> None:
        for member in self.members:
            member.committed(pool, result)

    def released(self, pool: str, result: ReleaseResult) -> None:
        for member in self.members:
            member.released(pool, result)

    def invalidated(self, pool: str, epoch: int) -> None:
        for member in self.members:
            member.invalidated(pool, epoch)

    def answered(self, request: Any, reply: Any, error: ErrorInfo | None, seconds: float) -> None:
        for member in self.members:
            member.answered(request, reply, error, seconds)

    def quota_rejected(self, pool: str | None, limit: str) -> None:
        for member in self.members:
            member.quota_rejected(pool, limit)
