"""Cache events and agent liveness against a real mosquitto: encoding, gaps, Wills, restarts."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

import aiomqtt
import msgpack
import paho.mqtt.client as paho
import pytest

from cachetier.events.cache_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                           EventSubscriber, MqttEventPublisher, NullEventPublisher,
                                           SequenceTracker, decode_batch, encode_batch,
                                           events_topic, removed_events)
from cachetier.events.liveness import (AgentPresence, AgentStatus, LivenessWatcher, agent_topic,
                                       agents_filter, parse_agent_topic)
from cachetier.events.mqtt import Backoff, BrokerAddress, MqttLink, with_login
from cachetier.run.servers import MosquittoServer, free_port
from index.records import Removal

TIMEOUT_S = 5.0
AGENT_SCRIPT = """
import asyncio, sys
from cachetier.events.liveness import AgentPresence

async def main() -> None:
    url, pool, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    async with AgentPresence(url, pool, rank, device="cpu") as presence:
        await presence.link.wait_connected(10)
        print(presence.status.agent_id, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[MosquittoServer]:
    with MosquittoServer() as server:
        yield server


@pytest.fixture
def pool() -> str:
    """A pool name of its own per test: retained statuses outlive a test on the shared broker."""
    return f"pool-{secrets.token_hex(4)}"


class Recorder:
    """Liveness callbacks queued as ("online" | "lost", pool, rank, agent_id)."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[tuple[object, ...]] = asyncio.Queue()

    async def lost(self, pool: str, rank: int, agent_id: str) -> None:
        self.calls.put_nowait(("lost", pool, rank, agent_id))

    async def online(self, pool: str, rank: int, status: AgentStatus) -> None:
        self.calls.put_nowait(("online", pool, rank, status.agent_id))

    async def next(self, timeout_s: float = TIMEOUT_S) -> tuple[object, ...]:
        return await asyncio.wait_for(self.calls.get(), timeout_s)


@asynccontextmanager
async def watching(url: str, pool: str,
                   rejoin_s: float = 5.0) -> AsyncIterator[tuple[LivenessWatcher, Recorder]]:
    recorder = Recorder()
    async with LivenessWatcher(url, recorder.lost, recorder.online, pool=pool,
                               rejoin_s=rejoin_s) as watcher:
        await watcher.link.wait_connected(TIMEOUT_S)
        yield watcher, recorder


@asynccontextmanager
async def agent_process(url: str, pool: str, rank: int) -> AsyncIterator[tuple[int, str]]:
    """A separate process holding an AgentPresence: yields (pid, agent_id) once it is online;
    killed and reaped on the way out whatever the test did to it."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT_SCRIPT, url, pool,
                                                str(rank), stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT_S * 2)
        assert line, "the agent process exited before announcing itself"
        yield proc.pid, line.decode().strip()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# --- addresses, topics, encoding ---------------------------------------------------------------

@pytest.mark.parametrize("url, expected", [
    ("mqtt://127.0.0.1:1884", ("127.0.0.1", 1884)), ("mqtt://mosquitto", ("mosquitto", 1883)),
    (with_login("mqtt://h:1", "agent/0/p%3Aq", "a/b.c:d@e"),
     ("h", 1, "agent/0/p%3Aq", "a/b.c:d@e")),
    ("mqtts://h?ca=/tls/ca.pem", ("h", 8883, None, None, True, "/tls/ca.pem"))])
def test_broker_url(url: str, expected: tuple[Any, ...]) -> None:
    assert BrokerAddress.parse(url) == BrokerAddress(*expected)


@pytest.mark.parametrize("url", ["tcp://h:1883", "mqtt://", "mqtt://h:99999", "mqtt://h/x", "h",
                                 "mqtt://h?ca=/x", "mqtts://h?cert=/x"])
def test_bad_broker_url(url: str) -> None:
    with pytest.raises(ValueError, match="bad MQTT URL"):
        BrokerAddress.parse(url)


def test_a_bad_broker_url_never_shows_its_password() -> None:
    with pytest.raises(ValueError) as err:
        BrokerAddress.parse(with_login("mqtt://h:99999", "u", "pw-123"))
    assert "pw-123" not in str(err.value) and "mqtt://h:99999" in str(err.value)


def test_agent_topics() -> None:
    assert agent_topic("pool0", 3) == "cachetier/pool0/agents/3"
    assert parse_agent_topic("cachetier/pool0/agents/3") == ("pool0", 3)
    assert agents_filter() == "cachetier/+/agents/+"
    for bad in ("cachetier/pool0/agents/x", "cachetier/pool0/events", "other/p/agents/1"):
        with pytest.raises(ValueError):
            parse_agent_topic(bad)
    for pool in ("", "a/b", "a+", "#"):
        with pytest.raises(ValueError, match="pool name"):
            agent_topic(pool, 0)
    with pytest.raises(ValueError, match="rank"):
        agent_topic("pool0", -1)


def test_agent_status_round_trip() -> None:
    status = AgentStatus("online", "a1", pid=7, device="cuda:0", epoch=3)
    assert AgentStatus.decode(status.encode()) == status
    assert AgentStatus.decode(b'{"state": "offline", "agent_id": "a1", "new": 1}') == \
        AgentStatus("offline", "a1")


@pytest.mark.parametrize("payload", [
    b"offline", b"\xff", b"[]", b'{"state": "gone", "agent_id": "a"}', b'{"state": "online"}',
    b'{"state": "online", "agent_id": "a", "pid": "7"}',
], ids=["bare-word", "not-utf8", "list", "state", "no-id", "pid-type"])
def test_bad_agent_statuses_are_value_errors(payload: bytes) -> None:
    with pytest.raises(ValueError):
        AgentStatus.decode(payload)


def test_batch_round_trip() -> None:
    events = [BlockStored([b"h1", b"h2"], None, 512, "mla", 0),
              BlockStored([b"h2"], b"h1", 512, "kda"),
              BlockRemoved([b"h0"], "mla"), AllBlocksCleared(epoch=7)]
    batch = EventBatch(ts=1.5, seq=3, pool="pool0", source="ab12", events=events)
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgpack.packb(5), msgpack.packb([2, 0.0, 0, "p", "s", []]),
    msgpack.packb([1, 0.0, -1, "p", "s", []]), msgpack.packb([1, 0.0, 0, "p", "s", [["Nope"]]]),
    msgpack.packb([1, 0.0, 0, "p", "s", [["BlockRemoved"]]]),
], ids=["empty", "invalid", "not-a-list", "version", "seq", "tag", "arity"])
def test_undecodable_batches_are_value_errors(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_removals_become_one_event_per_cache_kind() -> None:
    removals = [Removal("ep", b"a"), Removal("ck", b"c"), Removal("ep", b"b")]
    assert removed_events(removals) == [BlockRemoved([b"a", b"b"], "mla"),
                                        BlockRemoved([b"c"], "kda")]
    assert removed_events([]) == []


def test_sequence_tracker_counts_missed_batches_and_drops_duplicates() -> None:
    tracker = SequenceTracker()
    seen = [tracker.observe(EventBatch(0.0, seq, pool, source, []))
            for seq, pool, source in [(0, "p", "a"), (1, "p", "a"), (1, "p", "a"), (4, "p", "a"),
                                      (0, "q", "a"), (2, "p", "b"), (3, "p", "a")]]
    assert seen == [0, 0, None, 2, 0, 2, None]


def test_null_publisher_accepts_batches() -> None:
    NullEventPublisher().publish("pool0", [AllBlocksCleared(1)])


def test_backoff_grows_to_its_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(initial_s=0.1, max_s=0.4)
    delays = [backoff.next_delay() for _ in range(5)]
    for delay, nominal in zip(delays, [0.1, 0.2, 0.4, 0.4, 0.4]):
        assert nominal / 2 <= delay <= nominal
    backoff.reset()
    assert backoff.next_delay() <= 0.1


# --- events over the broker --------------------------------------------------------------------

async def test_batches_arrive_in_order_with_consecutive_seq(mosquitto: MosquittoServer,
                                                            pool: str) -> None:
    other = f"{pool}-other"
    async with EventSubscriber(mosquitto.url, pool) as mine, \
            EventSubscriber(mosquitto.url) as every, MqttEventPublisher(mosquitto.url) as publisher:
        await asyncio.gather(mine.link.wait_connected(TIMEOUT_S),
                             every.link.wait_connected(TIMEOUT_S))
        for n in range(10):
            publisher.publish(pool, [AllBlocksCleared(n)])
            publisher.publish(other, [BlockRemoved([bytes([n])], "kda")])
        publisher.publish(pool, [])  # nothing to say: no batch
        got = [await asyncio.wait_for(mine.get(), TIMEOUT_S) for _ in range(10)]
        assert [(r.batch.seq, r.missed, r.batch.events) for r in got] == \
            [(n, 0, [AllBlocksCleared(n)]) for n in range(10)]
        assert {r.batch.source for r in got} == {publisher.source}
        both = [await asyncio.wait_for(every.get(), TIMEOUT_S) for _ in range(20)]
        assert sorted((r.batch.pool, r.batch.seq) for r in both) == \
            sorted((p, n) for p in (pool, other) for n in range(10))
        assert mine.link.connected.is_set() and mine._received.empty()


async def test_batches_dropped_while_disconnected_show_up_as_a_gap(mosquitto: MosquittoServer,
                                                                  pool: str) -> None:
    publisher = MqttEventPublisher(mosquitto.url, max_queued=3)
    for n in range(5):  # before the link runs, as while the broker is away: 0 and 1 pushed out
        publisher.publish(pool, [AllBlocksCleared(n)])
    assert publisher.dropped == 2
    async with EventSubscriber(mosquitto.url, pool) as subscriber:
        await subscriber.link.wait_connected(TIMEOUT_S)
        async with publisher:
            got = [await asyncio.wait_for(subscriber.get(), TIMEOUT_S) for _ in range(3)]
            publisher.publish(pool, [AllBlocksCleared(5)])
            got.append(await asyncio.wait_for(subscriber.get(), TIMEOUT_S))
    assert [(r.batch.seq, r.missed) for r in got] == [(2, 2), (3, 0), (4, 0), (5, 0)]


def test_sequence_jumps_are_rejected_unless_a_run_confirms_them() -> None:
    tracker = SequenceTracker(max_gap=100, confirm=3, max_sources=2)

    def seen(seq: int, source: str = "real") -> int | None:
        return tracker.observe(EventBatch(0.0, seq, "p", source, []))

    assert [seen(0), seen(1), seen(2 ** 62), seen(2), seen(3)] == [0, 0, None, 0, 0]
    assert [seen(103), seen(104 + 100)] == [99, None]  # within max_gap; past it
    # a publisher that lost 1,000 batches goes on numbering: the third in a row is adopted
    assert [seen(1200), seen(1201), seen(1202), seen(1203)] == [None, None, 1098, 0]
    assert tracker.rejected == 4
    seen(0, "a")
    seen(0, "b")  # a third source: the least recently heard of ("real") is forgotten
    assert seen(5000) == 5000


async def test_a_forged_seq_does_not_hide_the_real_batches(mosquitto: MosquittoServer,
                                                           pool: str) -> None:
    async with EventSubscriber(mosquitto.url, pool) as subscriber, \
            MqttEventPublisher(mosquitto.url) as publisher, \
            aiomqtt.Client("127.0.0.1", mosquitto.port) as forger:
        await subscriber.link.wait_connected(TIMEOUT_S)
        publisher.publish(pool, [AllBlocksCleared(1)])
        assert (await asyncio.wait_for(subscriber.get(), TIMEOUT_S)).batch.seq == 0
        forged = EventBatch(time.time(), 2 ** 62, pool, publisher.source, [AllBlocksCleared(9)])
        await forger.publish(events_topic(pool), encode_batch(forged), qos=1)
        publisher.publish(pool, [AllBlocksCleared(2)])
        got = await asyncio.wait_for(subscriber.get(), TIMEOUT_S)
        assert (got.batch.seq, got.missed, got.batch.events) == (1, 0, [AllBlocksCleared(2)])
        assert subscriber.tracker.rejected == 1


@contextmanager
def forger(port: int) -> Iterator[paho.Client]:
    """A plain paho client with its own network thread: thousands of QoS 0 publishes in a
    fraction of a second (aiomqtt awaits each one)."""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        yield client
    finally:
        client.disconnect()
        client.loop_stop()


async def test_forged_statuses_are_ignored_and_grow_nothing(mosquitto: MosquittoServer,
                                                            pool: str) -> None:
    """10,000 statuses of made-up agents and ranks (online, then offline) change nothing: only
    the agent the service vouches for is followed."""
    recorder = Recorder()
    real = AgentStatus("online", "real-agent", 1, "cpu")
    known = lambda p, rank, agent_id: (p, rank, agent_id) == (pool, 0, real.agent_id)  # noqa: E731
    async with LivenessWatcher(mosquitto.url, recorder.lost, recorder.online, pool=pool,
                               known=known, settle_s=0.05) as watcher, \
            aiomqtt.Client("127.0.0.1", mosquitto.port) as agent:
        await watcher.link.wait_connected(TIMEOUT_S)
        await agent.publish(agent_topic(pool, 0), real.encode(), qos=1)
        assert await recorder.next() == ("online", pool, 0, real.agent_id)
        with forger(mosquitto.port) as forged:
            for n in range(5000):
                for state in ("online", "offline"):
                    forged.publish(agent_topic(pool, n % 50),
                                   AgentStatus(state, f"forged-{n}").encode())  # type: ignore
        await wait_until(lambda: watcher.ignored >= 10_000, timeout_s=20)
        await asyncio.sleep(0.2)  # past settle_s: a believed offline would have been reported
        assert recorder.calls.empty()
        assert watcher.online_agents() == {(pool, 0): real}
    # without a judge, the table is still bounded
    async with LivenessWatcher(mosquitto.url, recorder.lost, pool=pool, max_agents=5) as bounded:
        await bounded.link.wait_connected(TIMEOUT_S)
        with forger(mosquitto.port) as forged:
            for rank in range(20):
                forged.publish(agent_topic(pool, 100 + rank),
                               AgentStatus("online", f"a{rank}").encode())
            await wait_until(lambda: bounded.ignored >= 15)
            assert len(bounded.online_agents()) <= 5


# --- liveness ----------------------------------------------------------------------------------

async def test_sigkilled_agent_is_reported_lost_within_two_seconds(mosquitto: MosquittoServer,
                                                                   pool: str) -> None:
    async with watching(mosquitto.url, pool) as (watcher, recorder):
        async with agent_process(mosquitto.url, pool, 1) as (pid, agent_id):
            assert await recorder.next() == ("online", pool, 1, agent_id)
            assert watcher.online_agents()[(pool, 1)].pid == pid
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            assert await recorder.next(2.0) == ("lost", pool, 1, agent_id)
            assert time.monotonic() - killed_at < 2.0
        assert watcher.online_agents() == {}


async def test_clean_shutdown_reports_offline(mosquitto: MosquittoServer, pool: str) -> None:
    async with watching(mosquitto.url, pool) as (watcher, recorder):
        async with AgentPresence(mosquitto.url, pool, 0, device="cpu",
                                 agent_id="registered-id") as presence:
            await presence.link.wait_connected(TIMEOUT_S)
            assert await recorder.next() == ("online", pool, 0, "registered-id")
            await presence.set_epoch(4)
            assert await recorder.next() == ("online", pool, 0, presence.status.agent_id)
            assert watcher.online_agents()[(pool, 0)].epoch == 4
        assert await recorder.next() == ("lost", pool, 0, presence.status.agent_id)


async def test_a_new_process_replaces_the_old_one_and_its_late_will_is_ignored(
        mosquitto: MosquittoServer, pool: str) -> None:
    async with watching(mosquitto.url, pool) as (watcher, recorder), \
            AsyncExitStack() as old_life:
        old = await old_life.enter_async_context(AgentPresence(mosquitto.url, pool, 2, device="cpu"))
        await old.link.wait_connected(TIMEOUT_S)
        assert await recorder.next() == ("online", pool, 2, old.status.agent_id)
        async with AgentPresence(mosquitto.url, pool, 2, device="cpu") as new:
            await new.link.wait_connected(TIMEOUT_S)
            assert await recorder.next() == ("lost", pool, 2, old.status.agent_id)
            assert await recorder.next() == ("online", pool, 2, new.status.agent_id)
            await old_life.aclose()  # the old process's "offline" arrives late
            await asyncio.sleep(watcher.settle_s + 0.2)
            assert recorder.calls.empty()
            assert watcher.online_agents()[(pool, 2)] == new.status


async def test_a_late_watcher_learns_the_retained_statuses(mosquitto: MosquittoServer,
                                                           pool: str) -> None:
    async with AgentPresence(mosquitto.url, pool, 0, device="cpu") as presence:
        await presence.link.wait_connected(TIMEOUT_S)
        async with AgentPresence(mosquitto.url, pool, 1, device="cpu") as gone:
            await gone.link.wait_connected(TIMEOUT_S)
        async with watching(mosquitto.url, pool) as (watcher, recorder):
            assert await recorder.next() == ("online", pool, 0, presence.status.agent_id)
            await asyncio.sleep(0.2)  # rank 1's retained "offline": never seen online, no call
            assert recorder.calls.empty()
            assert list(watcher.online_agents()) == [(pool, 0)]


async def test_everything_recovers_from_a_broker_restart(pool: str) -> None:
    with MosquittoServer() as broker:
        url = broker.url
        async with watching(url, pool, rejoin_s=1.0) as (watcher, recorder), \
                EventSubscriber(url, pool) as subscriber, MqttEventPublisher(url) as publisher, \
                agent_process(url, pool, 0) as (pid, agent_id):
            await subscriber.link.wait_connected(TIMEOUT_S)
            assert await recorder.next() == ("online", pool, 0, agent_id)
            links = [watcher.link, subscriber.link]
            broker.stop()
            await wait_until(lambda: not any(link.connected.is_set() for link in links))
            broker.start()
            assert broker.url == url
            for link in links:
                await link.wait_connected(TIMEOUT_S)
            reconnected_at = time.monotonic()
            async with watching(url, pool) as (_, fresh):  # the agent announced itself again
                assert await fresh.next() == ("online", pool, 0, agent_id)
            publisher.publish(pool, [AllBlocksCleared(1)])
            received = await asyncio.wait_for(subscriber.get(), TIMEOUT_S)
            assert (received.batch.seq, received.missed) == (0, 0)
            await asyncio.sleep(reconnected_at + 1.2 - time.monotonic())  # past rejoin_s
            assert recorder.calls.empty()  # neither the Wills sent at shutdown nor the restart
            os.kill(pid, signal.SIGKILL)
            assert await recorder.next(2.0) == ("lost", pool, 0, agent_id)


async def test_an_agent_that_died_while_the_broker_was_down_is_lost_after_rejoin_s(
        pool: str) -> None:
    with MosquittoServer() as broker:
        async with watching(broker.url, pool, rejoin_s=0.5) as (watcher, recorder):
            async with agent_process(broker.url, pool, 3) as (pid, agent_id):
                assert await recorder.next() == ("online", pool, 3, agent_id)
                broker.stop()
                os.kill(pid, signal.SIGKILL)
                await wait_until(lambda: not watcher.link.connected.is_set())
                broker.start()
                await watcher.link.wait_connected(TIMEOUT_S)
                reconnected_at = time.monotonic()
                assert await recorder.next() == ("lost", pool, 3, agent_id)
                assert 0.4 <= time.monotonic() - reconnected_at < 2.0


async def test_a_link_waits_for_a_broker_that_is_not_up_yet(pool: str) -> None:
    broker = MosquittoServer(port=free_port())
    async with EventSubscriber(f"mqtt://127.0.0.1:{broker.port}", pool) as subscriber:
        await asyncio.sleep(0.2)
        assert not subscriber.link.connected.is_set()
        with broker:
            await subscriber.link.wait_connected(TIMEOUT_S)


async def test_link_rejects_a_second_start() -> None:
    async def nothing(client: object) -> None:
        return None

    async with MqttLink("mqtt://127.0.0.1:1", setup=nothing, serve=nothing) as link:
        with pytest.raises(RuntimeError, match="already started"):
            link.start()
