"""Agent liveness over MQTT: agents announce themselves, the broker reports their death.

An agent publishes its status, retained, on `cachetier/<pool>/agents/<rank>` and leaves a Last Will
saying "offline" on the same topic, so a SIGKILLed agent is reported by the broker as soon as its
socket closes (a half-open connection after keepalive x 1.5). The service watches every agent
topic and invalidates a pool whose agent went offline.

Every status carries the agent's `agent_id`, which names one process life (the id it registers
with the service): a restarted agent's "online" must not be undone by its predecessor's Will
arriving late, and a watcher that sees a new agent_id for a rank it knew learns that the old
process died even if its Will was lost. Retained
statuses do not survive a broker restart here; agents announce themselves again on reconnecting,
and `LivenessWatcher` counts an agent that does not as lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

import aiomqtt

from cachetier.events.mqtt import TOPIC_ROOT, Backoff, LinkOwner, MqttLink, check_pool_name, \
    payload_bytes, until_disconnected

log = logging.getLogger(__name__)

AgentLost = Callable[[str, int, str], Awaitable[None]]  # pool, rank, agent_id
KnownAgent = Callable[[str, int, str], bool]  # pool, rank, agent_id: registered where it matters
AgentOnline = Callable[[str, int, "AgentStatus"], Awaitable[None]]


def agent_topic(pool: str, rank: int) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    return f"{TOPIC_ROOT}/{check_pool_name(pool)}/agents/{rank}"


def agents_filter(pool: str = "+") -> str:
    """The filter for one pool's agents, or every pool's with `pool="+"`."""
    return f"{TOPIC_ROOT}/{pool if pool == '+' else check_pool_name(pool)}/agents/+"


def parse_agent_topic(topic: str) -> tuple[str, int]:
    """(pool, rank) of an agent status topic; ValueError for any other topic."""
    parts = topic.split("/")
    if len(parts) != 4 or parts[0] != TOPIC_ROOT or parts[2] != "agents" \
            or not parts[3].isascii() or not parts[3].isdigit():
        raise ValueError(f"not an agent topic: {topic!r}")
    return check_pool_name(parts[1]), int(parts[3])


@dataclass(frozen=True)
class AgentStatus:
    """What an agent says about itself, as one JSON object (readable with `mosquitto_sub`)."""

    state: Literal["online", "offline"]
    agent_id: str
    pid: int | None = None
    device: str | None = None
    epoch: int | None = None

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> AgentStatus:
        """ValueError for anything but a status object; unknown keys are ignored (newer agents)."""
        try:
            data = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"agent status is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("state") not in ("online", "offline") \
                or not isinstance(data.get("agent_id"), str):
            raise ValueError(f"not an agent status: {payload[:80]!r}")
        for key, kind in (("pid", int), ("device", str), ("epoch", int)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise ValueError(f"agent status field {key!r} must be {kind.__name__}")
        return cls(data["state"], data["agent_id"], data.get("pid"), data.get("device"),
                   data.get("epoch"))


class AgentPresence(LinkOwner):
    """The agent side: online (retained) while connected, a Will for a death, and an explicit
    "offline" on a clean exit, since a graceful disconnect makes the broker discard the Will.
    Entering does not wait for the broker (the agent serves copies without it); use
    `link.wait_connected` where the announcement must be out first.
    """

    def __init__(self, url: str, pool: str, rank: int, *, device: str, agent_id: str | None = None,
                 epoch: int | None = None, keepalive_s: int = 5,
                 backoff: Backoff | None = None) -> None:
        self.topic = agent_topic(pool, rank)
        agent_id = agent_id or secrets.token_hex(8)
        self.status = AgentStatus("online", agent_id, os.getpid(), device, epoch)
        offline = AgentStatus("offline", self.status.agent_id)
        self._offline = offline.encode()
        will = aiomqtt.Will(self.topic, self._offline, qos=1, retain=True)
        self.link = MqttLink(url, setup=self._announce, serve=until_disconnected, will=will,
                             keepalive_s=keepalive_s, backoff=backoff)

    async def set_epoch(self, epoch: int) -> None:
        """Announce the epoch the service registered this agent in (again at each reconnect)."""
        self.status = replace(self.status, epoch=epoch)
        if self.link.client is not None:
            try:
                await self._announce(self.link.client)
            except aiomqtt.MqttError as exc:  # the link reconnects and announces it then
                log.warning("could not announce epoch %d on %s: %s", epoch, self.topic, exc)

    async def _announce(self, client: aiomqtt.Client) -> None:
        await client.publish(self.topic, self.status.encode(), qos=1, retain=True)

    async def __aexit__(self, *exc_info: object) -> None:
        client = self.link.client
        try:
            if client is not None:
                await client.publish(self.topic, self._offline, qos=1, retain=True, timeout=1.0)
        except aiomqtt.MqttError as exc:
            log.warning("could not announce %s offline: %s", self.topic, exc)
        finally:
            await self.link.close()


class LivenessWatcher(LinkOwner):
    """The service side: follows every agent's status and calls back on changes.

    `on_agent_online(pool, rank, status)` when an agent appears or announces new information;
    `on_agent_lost(pool, rank, agent_id)` when an agent seen online goes offline (Will or clean exit) or is
    replaced by a new process (another agent_id). Callbacks run one at a time; one that raises is logged and the
    watcher goes on.

    A broker that shuts down publishes the Will of every client still connected, so an "offline"
    is believed only once this watcher's own connection has held for `settle_s` after it. After a
    reconnection every agent known online has `rejoin_s` to be seen online again (retained, or
    announced anew after a broker restart) before it counts as lost: that also reports an agent
    that died while the broker was down.

    Anyone who may publish on the agents' topics could otherwise make it forget or lose agents at
    will, and grow its tables with every made-up (pool, rank): with `known`, a status about an
    agent that `known(pool, rank, agent_id)` does not vouch for (the service: an agent registered
    with it under that id) is ignored, online or offline; the table of agents is bounded by
    `max_agents` in any case (statuses of further ones are ignored). An agent announces itself
    again after each registration (`observers.PresenceObserver`), so it is followed from then on.
    """

    def __init__(self, url: str, on_agent_lost: AgentLost,
                 on_agent_online: AgentOnline | None = None, *, pool: str = "+",
                 settle_s: float = 0.5, rejoin_s: float = 5.0, known: KnownAgent | None = None,
                 max_agents: int = 4096, backoff: Backoff | None = None) -> None:
        self.topic = agents_filter(pool)
        self._known, self.max_agents = known, max_agents
        self.ignored = 0  # statuses about agents not vouched for, or past `max_agents`
        self.settle_s, self.rejoin_s = settle_s, rejoin_s
        self._on_lost, self._on_online = on_agent_lost, on_agent_online
        self._online: dict[tuple[str, int], AgentStatus] = {}
        self._doubts: dict[tuple[str, int], asyncio.Task[None]] = {}  # losses to confirm
        self._tasks: set[asyncio.Task[None]] = set()  # those, and confirmed ones being reported
        self._callbacks = asyncio.Lock()
        self.link = MqttLink(url, setup=self._subscribe, serve=self._watch, backoff=backoff)

    def online_agents(self) -> dict[tuple[str, int], AgentStatus]:
        """The agents believed online now, by (pool, rank); one whose loss awaits confirmation
        still counts."""
        return dict(self._online)

    async def _subscribe(self, client: aiomqtt.Client) -> None:
        if self.link.connections:
            for key in self._online.keys() - self._doubts.keys():
                self._doubt(key, self.rejoin_s)
        await client.subscribe(self.topic, qos=1)

    async def _watch(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            if not message.payload:  # a cleared retained message
                continue
            try:
                pool, rank = parse_agent_topic(message.topic.value)
                status = AgentStatus.decode(payload_bytes(message))
            except ValueError as exc:
                log.warning("ignoring a message on %s: %s", message.topic, exc)
                continue
            if not self._followed((pool, rank), status):
                self.ignored += 1
                continue
            await self._update((pool, rank), status)

    def _followed(self, key: tuple[str, int], status: AgentStatus) -> bool:
        if self._known is not None and not self._known(*key, status.agent_id):
            return False
        return key in self._online or len(self._online) < self.max_agents

    async def _update(self, key: tuple[str, int], status: AgentStatus) -> None:
        known = self._online.get(key)
        if status.state == "offline":
            if known is not None and known.agent_id == status.agent_id \
                    and key not in self._doubts:
                self._doubt(key, self.settle_s)
            return
        doubt = self._doubts.pop(key, None)
        if doubt is not None:
            doubt.cancel()
        if known is not None and known.agent_id != status.agent_id:
            await self._lost(key)  # its successor is here: the process we knew is gone
        if status != known:
            self._online[key] = status
            if self._on_online is not None:
                on_online = self._on_online
                await self._call(key, lambda: on_online(*key, status))

    def _doubt(self, key: tuple[str, int], delay_s: float) -> None:
        task = asyncio.create_task(self._confirm_loss(key, delay_s))
        self._doubts[key] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _confirm_loss(self, key: tuple[str, int], delay_s: float) -> None:
        """Report the loss once the watcher's connection held for `delay_s` (then `rejoin_s` after
        each reconnection); an "online" of the agent cancels this task."""
        link = self.link
        while True:
            await link.connected.wait()
            seen = link.connections
            await asyncio.sleep(delay_s)
            if link.connected.is_set() and link.connections == seen:
                break
            delay_s = self.rejoin_s
        del self._doubts[key]
        await self._lost(key)

    async def _lost(self, key: tuple[str, int]) -> None:
        agent_id = self._online.pop(key).agent_id
        await self._call(key, lambda: self._on_lost(*key, agent_id))

    async def _call(self, key: tuple[str, int], callback: Callable[[], Awaitable[None]]) -> None:
        async with self._callbacks:
            try:
                await callback()
            except Exception:
                log.exception("liveness callback failed for pool %s rank %d", *key)

    async def __aexit__(self, *exc_info: object) -> None:
        """Drop unconfirmed losses; a confirmed one being reported completes first."""
        for task in self._doubts.values():
            task.cancel()
        self._doubts.clear()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()
