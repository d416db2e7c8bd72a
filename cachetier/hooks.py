"""Where the service and the agent report what happens, for cache events and liveness (MQTT).

Both base classes are the null implementation (STYLE 7); `cachetier.nodes` has the MQTT ones
(`EventsObserver` turns these records into `cachetier.events` batches, `PresenceObserver` calls
`AgentPresence.set_epoch`). Methods are plain calls made on the hot path and must not block: an
implementation that talks to the network queues the work or starts a task.
"""

from __future__ import annotations

from cachetier.protocol import AgentIdentity
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


class AgentObserver:
    def registered(self, identity: AgentIdentity, service: str, epoch: int) -> None:
        """The agent registered with `service` (it may serve several replicas) in `epoch`."""
