"""How `cachetier serve` and `cachetier agent` run, with the MQTT broker when one is given.

With a broker the service publishes cache events (`EventsObserver` over `MqttEventPublisher`) and
follows the agents' liveness (`LivenessWatcher` calling `CacheTierService.agent_lost`); with a
metrics listener it serves Prometheus series (`ServiceMetrics` on `MetricsEndpoint`); an agent
announces itself with a Last Will (`AgentPresence`) and the epoch of each registration
(`PresenceObserver`). Without one, both run alone: a dropped connection is then the only death
notice the service gets. Each logs in to the broker with its own credential (`MqttLogin`): the
service with the one of role service it derives from the cluster secret, an agent with its token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachetier.credentials import MqttLogin, Principal, Role, issue
from cachetier.events.cache_events import MqttEventPublisher
from cachetier.events.liveness import AgentPresence, LivenessWatcher
from cachetier.events.mqtt import with_login
from cachetier.events.observers import EventsObserver, PresenceObserver
from cachetier.service.metrics import ServiceMetrics
from cachetier.service.metrics_http import MetricsEndpoint
from cachetier.service.observer import ObserverGroup, ServiceObserver
from cachetier.service.server import CacheTierService, ServiceSettings

if TYPE_CHECKING:
    from gpu_pool.agent import AgentSettings


@dataclass(frozen=True)
class MetricsListen:
    """Where `serve` answers `GET /metrics` (port 0: any free port); `ready` gets its URL;
    `token`: the bearer token a scrape must carry (None: any scrape is answered)."""

    host: str
    port: int
    ready: Callable[[str], None]
    token: str | None = None


async def run_service(settings: ServiceSettings, ready: Callable[[str], None],
                      mqtt: str | None = None, metrics: MetricsListen | None = None) -> None:
    """Serve until cancelled; `ready` gets the URL once the service answers."""
    async with contextlib.AsyncExitStack() as stack:
        observers: list[ServiceObserver] = []
        if mqtt is not None:
            mqtt = logged_in(mqtt, issue(settings.secret, Principal(Role.SERVICE)))
            publisher = await stack.enter_async_context(MqttEventPublisher(mqtt))
            observers.append(EventsObserver(publisher, settings.config.cache.hash_block_tokens))
        series = ServiceMetrics() if metrics is not None else None
        if series is not None:
            observers.append(series)
        service = await stack.enter_async_context(CacheTierService(settings,
                                                                   ObserverGroup(observers)))
        if mqtt is not None:
            await stack.enter_async_context(LivenessWatcher(mqtt, service.agent_lost,
                                                            known=service.knows_agent))
        if series is not None and metrics is not None:
            series.watch(service.indexes)
            endpoint = MetricsEndpoint(series, metrics.host, metrics.port, metrics.token)
            metrics.ready((await stack.enter_async_context(endpoint)).url)
        ready(service.url)
        await asyncio.Event().wait()


async def run_agent(settings: AgentSettings, mqtt: str | None = None) -> None:
    """Serve the services until cancelled; with a broker, online while running, and a Will."""
    from gpu_pool.agent import Agent  # torch and the kernels: only an agent needs them
    async with contextlib.AsyncExitStack() as stack:
        observer = None
        if mqtt is not None:
            presence = AgentPresence(logged_in(mqtt, settings.token), settings.pool,
                                     settings.rank, device=settings.device,
                                     agent_id=settings.agent_id)
            observer = PresenceObserver(await stack.enter_async_context(presence))
        await Agent(settings, observer).run()


def logged_in(url: str, token: str) -> str:
    """The broker URL with the login of `token`'s principal."""
    login = MqttLogin.of(token)
    return with_login(url, login.username, login.password)
