"""How `cachetier serve` and `cachetier agent` run, with the MQTT broker when one is given.

With a broker the service publishes cache events (`EventsObserver` over `MqttEventPublisher`) and
follows the agents' liveness (`LivenessWatcher` calling `CacheTierService.agent_lost`); an agent
announces itself with a Last Will (`AgentPresence`) and the epoch of each registration
(`PresenceObserver`). Without one, both run alone: a dropped connection is then the only death
notice the service gets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachetier.events.cache_events import (AllBlocksCleared, BlockStored, EventPublisher,
                                           MqttEventPublisher, removed_events)
from cachetier.events.liveness import AgentPresence, LivenessWatcher
from cachetier.service.observer import ServiceObserver
from cachetier.service.server import CacheTierService, ServiceSettings
from cachetier.wire.protocol import AgentIdentity
from gpu_pool.observer import AgentObserver
from index.records import CommitResult, ReleaseResult, StepPlan

if TYPE_CHECKING:
    from gpu_pool.agent import AgentSettings


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


async def run_service(settings: ServiceSettings, ready: Callable[[str], None],
                      mqtt: str | None = None) -> None:
    """Serve until cancelled; `ready` gets the URL once the service answers."""
    async with contextlib.AsyncExitStack() as stack:
        observer = None
        if mqtt is not None:
            publisher = await stack.enter_async_context(MqttEventPublisher(mqtt))
            observer = EventsObserver(publisher, settings.config.cache.hash_block_tokens)
        service = await stack.enter_async_context(CacheTierService(settings, observer))
        if mqtt is not None:
            await stack.enter_async_context(LivenessWatcher(mqtt, service.agent_lost))
        ready(service.url)
        await asyncio.Event().wait()


async def run_agent(settings: AgentSettings, mqtt: str | None = None) -> None:
    """Serve the services until cancelled; with a broker, online while running, and a Will."""
    from gpu_pool.agent import Agent  # torch and the kernels: only an agent needs them
    async with contextlib.AsyncExitStack() as stack:
        observer = None
        if mqtt is not None:
            presence = AgentPresence(mqtt, settings.pool, settings.rank, device=settings.device,
                                     agent_id=settings.agent_id)
            observer = PresenceObserver(await stack.enter_async_context(presence))
        await Agent(settings, observer).run()
