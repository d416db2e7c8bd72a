"""Where the service reports what happens, for cache events (MQTT) and tests.

The base class is the null implementation (STYLE 7); `cachetier.events.observers.EventsObserver`
turns these records into `cachetier.events.cache_events` batches. Methods are plain calls made on
the hot path and must not block: an implementation that talks to the network queues the work or
starts a task.
"""

from __future__ import annotations

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
