"""The observers that turn what the service and the agent report into MQTT traffic.

`EventsObserver` implements the service's `ServiceObserver` with cache events in numbered batches
(`cache_events`); `PresenceObserver` implements the agent's `AgentObserver` with the epoch of each
registration in its retained status (`liveness`). Both are called on the hot path and only queue
work: publishing happens on the links' own tasks.
"""

from __future__ import annotations

import asyncio

from cachetier.events.cache_events import (AllBlocksCleared, BlockStored, EventPublisher,
                                           removed_events)
from cachetier.events.liveness import AgentPresence
from cachetier.service.observer import ServiceObserver
from cachetier.wire.protocol import AgentIdentity
from gpu_pool.observer import AgentObserver
from index.records import CommitResult, ReleaseResult, StepPlan


class EventsObserver(ServiceObserver):
    """What each commit stored (`BlockStored`: the MLA chain it processed, the checkpoint it
    registered), what each step evicted and each release rolled back (`BlockRemoved`), and each
    new epoch (`AllBlocksCleared`)."""

    def __init__(self, publisher: EventPublisher, block_tokens: int) -> None:
        self.publisher = publisher
        self.block_tokens = block_tokens

    def step_planned(self, pool: str, plan: StepPlan) -> None:
        self.publisher.publish(pool, removed_events(plan.removed))

    def committed(self, pool: str, result: CommitResult) -> None:
        self.publisher.publish(pool, [*self._stored(result), *removed_events(result.removed)])

    def _stored(self, result: CommitResult) -> list[BlockStored]:
        events = []
        for r in result.requests:
            if r.block_hashes:
                events.append(BlockStored(r.block_hashes, r.parent_hash, self.block_tokens, "mla"))
            if r.checkpoint_hash is not None:
                events.append(BlockStored([r.checkpoint_hash], None, self.block_tokens, "kda"))
        return events

    def released(self, pool: str, result: ReleaseResult) -> None:
        self.publisher.publish(pool, removed_events(result.removed))

    def invalidated(self, pool: str, epoch: int) -> None:
        self.publisher.publish(pool, [AllBlocksCleared(epoch)])


class PresenceObserver(AgentObserver):
    """Announces each registration's epoch in the agent's retained status, off the hot path."""

    def __init__(self, presence: AgentPresence) -> None:
        self.presence = presence
        self._announcing: set[asyncio.Task[None]] = set()

    def registered(self, identity: AgentIdentity, service: str, epoch: int) -> None:
        task = asyncio.create_task(self.presence.set_epoch(epoch))
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)
