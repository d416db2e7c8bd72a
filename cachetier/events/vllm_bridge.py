"""The bridge from cachetier's MQTT cache events to a vLLM KV-events stream over ZeroMQ.

It subscribes to one pool's batches (or every pool's) and republishes each, converted by
`vllm_events`, through vLLM's own `ZmqEventPublisher` (`vllm_publisher.GuardedZmqPublisher`):
vLLM numbers the batches, keeps the last `buffer_steps` of them for replay requests on its ROUTER
socket, and sends `(topic, seq, payload)` exactly as an engine does, so a router that follows vLLM
engines follows a cachetier pool the same way. Endpoints mean what they mean to vLLM, but for
where a wildcard binds: `tcp://*:PORT` binds the PUB socket on `bind_host` (default loopback;
`*`: every address), `ipc://` and `inproc://` bind, `tcp://HOST:PORT` connects it to a
subscriber that binds; the replay endpoint always binds, answers only CURVE peers holding the
bridge's credential (`replay_keys`, derived from it) and sends at most `replay_rate` batches a
second.

Gaps: the MQTT batches are numbered per pool and service replica; one lost on the way (a replica's
buffer overflowed while its broker was away, the bridge was disconnected, or the bridge joined a
replica's stream late) may have removed blocks the consumer still counts, so the next batch goes
out behind an `AllBlocksCleared`: the consumer drops its view and rebuilds it from what follows.
vLLM's `AllBlocksCleared` names no pool, so a stream of every pool clears the consumer's view of
all of them on any pool's gap or invalidation (`ownership` still tells their stores apart); one
bridge per pool (`pool=P`) keeps each stream whole, like one engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from vllm.config.kv_events import KVEventsConfig

from cachetier.events.cache_events import EventSubscriber
from cachetier.events.mqtt import Backoff
from cachetier.events.replay_keys import ReplayKeys
from cachetier.events.vllm_events import VllmEventMapping, vllm_batch
from cachetier.events.vllm_publisher import DEFAULT_REPLAY_RATE, LOOPBACK, GuardedZmqPublisher


@dataclass(frozen=True)
class BridgeSettings:
    """`pool="+"`: every pool in one stream. `endpoint`, `replay_endpoint`, `topic` and
    `buffer_steps` are vLLM's `KVEventsConfig`'s; the rest `GuardedZmqPublisher`'s (a replay
    endpoint needs `replay_keys`)."""

    mqtt_url: str
    endpoint: str
    replay_endpoint: str | None = None
    pool: str = "+"
    mapping: VllmEventMapping = field(default_factory=VllmEventMapping)
    topic: str = ""
    buffer_steps: int = 10_000
    bind_host: str = LOOPBACK
    replay_keys: ReplayKeys | None = None
    replay_rate: int = DEFAULT_REPLAY_RATE

    def publisher(self) -> GuardedZmqPublisher:
        return GuardedZmqPublisher(self.endpoint, self.replay_endpoint,
                                   buffer_steps=self.buffer_steps, topic=self.topic,
                                   bind_host=self.bind_host, replay_keys=self.replay_keys,
                                   replay_rate=self.replay_rate)


class VllmEventBridge:
    """Inside `async with` the sockets are bound (or connected) and the subscription runs; `run`
    forwards batches until cancelled."""

    def __init__(self, settings: BridgeSettings, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.subscriber = EventSubscriber(settings.mqtt_url, settings.pool, backoff=backoff)
        self._publisher: GuardedZmqPublisher | None = None

    @property
    def publisher(self) -> GuardedZmqPublisher:
        if self._publisher is None:
            raise RuntimeError("the bridge is not running")
        return self._publisher

    @property
    def config(self) -> KVEventsConfig:
        """The publisher's resolved configuration: each bound endpoint as bound (a port 0 made
        real, a `*` its host)."""
        return self.publisher.get_publisher_config()

    async def run(self) -> None:
        async for received in self.subscriber:
            self.publisher.publish(vllm_batch(received.batch, received.missed,
                                              self.settings.mapping))

    async def __aenter__(self) -> Self:
        self._publisher = self.settings.publisher()
        try:
            await self.subscriber.__aenter__()
        except BaseException:
            await self._shutdown_publisher()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.subscriber.__aexit__(*exc_info)
        finally:
            await self._shutdown_publisher()

    async def _shutdown_publisher(self) -> None:
        """vLLM's shutdown drains its queue for up to a second or two, blocking: off the loop."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await asyncio.to_thread(publisher.shutdown)


async def run_bridge(settings: BridgeSettings, *, backoff: Backoff | None = None,
                     ready: Callable[[VllmEventBridge], None] | None = None) -> None:
    """Bridge until cancelled; `ready` gets the bridge once its sockets are up and the broker has
    its subscription (it waits for a broker that is not up yet)."""
    async with VllmEventBridge(settings, backoff) as bridge:
        await bridge.subscriber.link.connected.wait()
        if ready is not None:
            ready(bridge)
        await bridge.run()
