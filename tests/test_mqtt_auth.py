"""The broker `cachetier up` runs admits its principals only, each to its own topics
(`cachetier.run.mqtt_auth`), checked on a real mosquitto with a real service and agent.

The red-team findings this guards: an anonymous client forged an agent's "offline" (10 epoch
bumps in 2 s, the cache wiped each time), read the retained statuses (agent ids, pids, epochs),
and published `BlockStored` events that subscribers believed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import aiomqtt
import pytest

from cachetier.client import CacheTierClient
from cachetier.credentials import MqttLogin, Principal, Role, issue
from cachetier.events.cache_events import (BlockStored, EventBatch, EventSubscriber,
                                           ReceivedBatch, encode_batch, events_topic)
from cachetier.events.liveness import AgentStatus, agent_topic
from cachetier.events.mqtt import BrokerAddress
from cachetier.run.mqtt_auth import BrokerAuth, password_hash
from cachetier.run.nodes import logged_in, run_agent, run_service
from cachetier.run.servers import MosquittoServer
from cachetier.service.server import ServiceSettings
from gpu_pool.agent import AgentSettings
from tests.cluster_harness import SECRET, TINY, TOKEN, agent_token, eventually

OBSERVER = issue(SECRET, Principal(Role.OBSERVER))
ADMIN = issue(SECRET, Principal(Role.ADMIN))
SERVICE = issue(SECRET, Principal(Role.SERVICE))


@pytest.fixture(scope="module")
def broker() -> Iterator[MosquittoServer]:
    auth = BrokerAuth.of([SERVICE, OBSERVER, ADMIN, agent_token("p", 0), agent_token("p", 1)])
    with MosquittoServer(auth=auth) as server:
        yield server


def client(broker: MosquittoServer, token: str | None = None,
           password: str | None = None) -> aiomqtt.Client:
    address = BrokerAddress.parse(broker.url)
    login = MqttLogin.of(token) if token else None
    return aiomqtt.Client(address.host, address.port,
                          username=login.username if login else None,
                          password=password or (login.password if login else None))


def test_passwords_are_stored_as_mosquitto_pbkdf2_hashes():
    stored = password_hash("pw", b"\0" * 12)
    assert stored.startswith("$7$101$AAAAAAAAAAAAAAAA$") and "pw" not in stored
    assert password_hash("pw") != password_hash("pw")  # salted


async def drained(events: EventSubscriber) -> list[ReceivedBatch]:
    """The batches received until none comes for 0.3 s."""
    batches = []
    with contextlib.suppress(TimeoutError):
        while True:
            batches.append(await asyncio.wait_for(events.get(), 0.3))
    return batches


@pytest.mark.parametrize("login", ["anonymous", "wrong password", "scheduler"])
async def test_unknown_logins_are_refused(broker, login):
    token = {"anonymous": None, "wrong password": agent_token("p", 0), "scheduler": TOKEN}[login]
    with pytest.raises(aiomqtt.MqttError, match="[Nn]ot authori[sz]ed|[Bb]ad user name"):
        async with client(broker, token, "nope" if login == "wrong password" else None):
            pass


async def test_forged_statuses_and_events_never_reach_the_service(broker, redis, redis_url):
    """The service and its agent on the broker; an observer and another rank's agent forge the
    agent's "offline", and an observer forges a `BlockStored`: the broker delivers none (no epoch
    bump, the agent still online), and the observer cannot read agent statuses. The same
    "offline" from the agent's own login then does reach the service (its service connection
    still up, so only MQTT can have told it): the channel the forgeries were refused on works."""
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    serve = asyncio.create_task(run_service(ServiceSettings(redis_url, SECRET, TINY),
                                            ready.set_result, broker.url))
    agent_settings = AgentSettings((await asyncio.wait_for(ready, 10),), "p", agent_token("p", 0))
    agent = asyncio.create_task(run_agent(agent_settings, broker.url))
    try:
        async with CacheTierClient(ready.result(), token=TOKEN, timeout=10) as tier, \
                EventSubscriber(logged_in(broker.url, ADMIN), "p") as events:
            await eventually(tier.health, lambda h: h.pools == {"p": [0]})
            await events.link.wait_connected(5)
            epoch = (await tier.stats("p")).epoch
            offline = AgentStatus("offline", agent_settings.agent_id).encode()
            forged = EventBatch(0.0, 2**62, "p", "forger", [BlockStored([b"h" * 16], None, 16,
                                                                        "mla")])
            for forger in (OBSERVER, agent_token("p", 1)):
                async with client(broker, forger) as mqtt:
                    await mqtt.publish(agent_topic("p", 0), offline, qos=1, retain=True)
                    await mqtt.publish(events_topic("p"), encode_batch(forged), qos=1)
            async with client(broker, OBSERVER) as mqtt:
                await mqtt.subscribe(agent_topic("p", 0), qos=1)
                with pytest.raises(TimeoutError):  # the agent's retained "online" is not shown
                    async with asyncio.timeout(1.0):
                        await anext(aiter(mqtt.messages))
            assert "forger" not in [batch.batch.source for batch in await drained(events)]
            assert (await tier.health()).pools == {"p": [0]}
            assert (await tier.stats("p")).epoch == epoch
            async with client(broker, agent_token("p", 0)) as mqtt:  # as its own Will would
                await mqtt.publish(agent_topic("p", 0), offline, qos=1, retain=True)
            await eventually(lambda: tier.stats("p"), lambda s: s.epoch > epoch)
    finally:
        for task in (agent, serve):
            task.cancel()
        await asyncio.gather(agent, serve, return_exceptions=True)
