"""cachetier's cache events as vLLM KV events: the mapping on its own, then the bridge between a
real mosquitto (the service publishing its commits) and real ZeroMQ sockets, decoded with vLLM's
own decoder the way vLLM's example subscriber does (`msgspec.msgpack.Decoder(KVEventBatch)`),
then the bridge's guards: loopback binds, CURVE replay peers only, the replay rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from cachetier.client import CacheTierClient
from cachetier.config import PRESETS
from cachetier.events.cache_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                           MqttEventPublisher)
from cachetier.events.mqtt import Backoff
from cachetier.events.observers import EventsObserver
from cachetier.events.replay_keys import ReplayKeys
from cachetier.events.vllm_bridge import BridgeSettings, VllmEventBridge, run_bridge
from cachetier.events.vllm_events import VllmEventMapping, to_vllm, vllm_batch
from cachetier.events.vllm_publisher import BatchRate
from cachetier.run.servers import MosquittoServer, free_port
from cachetier.service.server import CacheTierService
from index.lifecycle import RequestLifecycle
from index.records import CommittedRequest
from tests.cluster_harness import BLOCK, TOKEN, running_agent, running_service
from tests.index_harness import commit_item, new_request, only

TIMEOUT_S = 10.0
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ROOT = Path(__file__).resolve().parent.parent
CREDENTIAL = "observer.bridge-test"  # what the bridge logs in with and replay peers hold
KEYS = ReplayKeys.of(CREDENTIAL)


# --- the mapping -------------------------------------------------------------------------------

def test_each_cachetier_event_becomes_vllms_with_the_documented_fields() -> None:
    h = [bytes([i]) * 16 for i in range(4)]
    batch = EventBatch(ts=12.5, seq=7, pool="p0", source="ab", events=[
        BlockStored(h[:3], None, 512, "mla"), BlockStored([h[3]], h[2], 512, "mla"),
        BlockStored([h[2]], None, 512, "kda"), BlockRemoved([h[0], h[1]], "mla"),
        BlockRemoved([h[2]], "kda"), AllBlocksCleared(epoch=4)])
    wire = msgspec.msgpack.Encoder().encode(to_vllm(batch, VllmEventMapping()))
    stored = dict(token_ids=[], block_size=512, lora_id=None, medium="GPU", lora_name=None,
                  ownership="cachetier/p0")
    assert DECODER.decode(wire) == KVEventBatch(ts=12.5, events=[
        VllmBlockStored(block_hashes=h[:3], parent_block_hash=None, group_idx=0,
                        kv_cache_spec_kind="mla_attention", **stored),
        VllmBlockStored(block_hashes=[h[3]], parent_block_hash=h[2], group_idx=0,
                        kv_cache_spec_kind="mla_attention", **stored),
        VllmBlockStored(block_hashes=[h[2]], parent_block_hash=None, group_idx=1,
                        kv_cache_spec_kind="mamba", **stored),
        VllmBlockRemoved(block_hashes=[h[0], h[1]], medium="GPU", group_idx=0,
                         ownership="cachetier/p0"),
        VllmBlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=1, ownership="cachetier/p0"),
        VllmAllBlocksCleared()])


@pytest.mark.parametrize("preset, kind", [("tiny", "mla_attention"), ("kimi-k3", "mla_attention"),
                                          ("tiny-gqa", "full_attention"),
                                          ("qwen3-next", "full_attention")])
def test_the_full_attention_group_has_the_models_spec_kind(preset: str, kind: str) -> None:
    mapping = VllmEventMapping.for_model(PRESETS[preset].model)
    event = to_vllm(EventBatch(0.0, 0, "p", "s", [BlockStored([b"h"], None, 16, "mla")]),
                    mapping).events[0]
    assert isinstance(event, VllmBlockStored)
    assert (event.kv_cache_spec_kind, mapping.linear_kind) == (kind, "mamba")


def test_a_gap_or_an_inexpressible_batch_goes_out_behind_a_clear() -> None:
    mapping = VllmEventMapping()
    removed = EventBatch(3.0, 5, "p", "s", [BlockRemoved([b"h"], "mla")])
    plain = vllm_batch(removed, 0, mapping)
    assert plain == to_vllm(removed, mapping)
    assert vllm_batch(removed, 2, mapping).events == [VllmAllBlocksCleared(), *plain.events]
    one_group = EventBatch(3.0, 5, "p", "s", [BlockRemoved([b"h"], "kda", group_idx=1)])
    with pytest.raises(ValueError, match="no group"):
        to_vllm(one_group, mapping)
    assert vllm_batch(one_group, 0, mapping) == KVEventBatch(ts=3.0,
                                                             events=[VllmAllBlocksCleared()])


# --- a router's end of the stream --------------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    seq: int
    batch: KVEventBatch
    live: bool  # from the SUB socket, not from a replay


@dataclass
class VllmConsumer:
    """What a router does with a vLLM publisher, as vLLM's example subscriber: batches from the
    SUB socket in seq order, and whatever it missed (a jump in seq, or nothing arriving) asked
    for on the replay socket (a DEALER speaking to vLLM's ROUTER)."""

    sub: zmq.asyncio.Socket
    replay_socket: zmq.asyncio.Socket
    expected: int = 0
    ready: list[Seen] = field(default_factory=list)

    async def take(self, n: int) -> list[Seen]:
        async with asyncio.timeout(TIMEOUT_S):
            while len(self.ready) < n:
                try:
                    topic, seq_bytes, payload = await asyncio.wait_for(self.sub.recv_multipart(),
                                                                       0.5)
                except TimeoutError:
                    self._accept(await self.replay(self.expected))
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.expected:
                    self._accept(await self.replay(self.expected))
                self._accept([Seen(seq, DECODER.decode(payload), live=True)])
        taken, self.ready = self.ready[:n], self.ready[n:]
        return taken

    def _accept(self, seen: list[Seen]) -> None:
        for s in seen:
            if s.seq == self.expected:
                self.ready.append(s)
                self.expected += 1

    async def replay(self, start: int) -> list[Seen]:
        return await replay(self.replay_socket, start)


async def replay(socket: zmq.asyncio.Socket, start: int) -> list[Seen]:
    """The publisher's buffered batches from `start` on, up to its end marker."""
    await socket.send_multipart([b"", start.to_bytes(8, "big")])
    seen = []
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            _, topic, seq_bytes, payload = await socket.recv_multipart()
            if seq_bytes == ZmqEventPublisher.END_SEQ:
                return seen
            seen.append(Seen(int.from_bytes(seq_bytes, "big"), DECODER.decode(payload), False))


def replay_socket(ctx: zmq.asyncio.Context, replay_endpoint: str,
                  keys: ReplayKeys | None = KEYS) -> zmq.asyncio.Socket:
    """A DEALER for vLLM's replay protocol; `keys`: its CURVE client (None: a plain one, as
    vLLM's example subscriber's)."""
    socket = ctx.socket(zmq.DEALER)
    if keys is not None:
        keys.connect(socket)
    socket.connect(replay_endpoint)
    return socket


@contextlib.contextmanager
def consumer(endpoint: str, replay_endpoint: str, *, bind: bool = False) -> Iterator[VllmConsumer]:
    """`bind`: the subscriber binds `endpoint`, for a publisher that connects (tcp://HOST:PORT)."""
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(endpoint) if bind else sub.connect(endpoint)
        yield VllmConsumer(sub, replay_socket(ctx, replay_endpoint))
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def replay_peer(replay_endpoint: str, keys: ReplayKeys | None = KEYS
                ) -> Iterator[zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    try:
        yield replay_socket(ctx, replay_endpoint, keys)
    finally:
        ctx.destroy(linger=0)


# --- the bridge between the service and a consumer ---------------------------------------------

@pytest.fixture(scope="module")
def mosquitto() -> Iterator[MosquittoServer]:
    with MosquittoServer() as server:
        yield server


@dataclass
class Bridged:
    service: CacheTierService
    publisher: MqttEventPublisher
    bridge: VllmEventBridge
    consumer: VllmConsumer


@contextlib.asynccontextmanager
async def bridged(redis_url: str, broker: str, tmp_path: Path, pool: str = "p",
                  max_queued: int = 4096) -> AsyncIterator[Bridged]:
    """A service publishing its events on `broker`, the bridge (PUB bound on an ipc socket,
    replay on a loopback port) and a consumer connected to both; no agent yet."""
    endpoint = f"ipc://{tmp_path / 'events.ipc'}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with MqttEventPublisher(broker, max_queued=max_queued) as publisher, \
            running_service(redis_url, observer=EventsObserver(publisher, BLOCK)) as service:
        ready: asyncio.Future[VllmEventBridge] = asyncio.get_running_loop().create_future()
        settings = BridgeSettings(broker, endpoint, replay_endpoint, pool, replay_keys=KEYS)
        task = asyncio.create_task(run_bridge(settings, backoff=Backoff(0.01, 0.1),
                                              ready=ready.set_result))
        try:
            bridge = await asyncio.wait_for(asyncio.shield(ready), TIMEOUT_S)
            await publisher.link.wait_connected(TIMEOUT_S)
            with consumer(endpoint, replay_endpoint) as sub:
                yield Bridged(service, publisher, bridge, sub)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def commit_prompt(tier: CacheTierClient, rid: str, first_token: int,
                        pool: str = "p") -> CommittedRequest:
    """A 3-block prompt of its own tokens, planned, committed with its checkpoint and released."""
    tokens = list(range(first_token, first_token + 3 * BLOCK + 1))
    async with RequestLifecycle(tier.pool(pool)) as steps:
        step = only(await steps.plan([new_request(rid, tokens, len(tokens), BLOCK)]))
        result = await steps.finish([commit_item(step, step.stop, True, True, BLOCK)])
    (committed,) = result.requests
    return committed


def stored_of(committed: CommittedRequest, pool: str = "p") -> list[VllmBlockStored]:
    """The vLLM events a router must get for one commit: its chain, then its checkpoint."""
    common = dict(token_ids=[], block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                  ownership=f"cachetier/{pool}")
    assert committed.block_hashes and committed.checkpoint_hash is not None
    return [VllmBlockStored(block_hashes=committed.block_hashes,
                            parent_block_hash=committed.parent_hash, group_idx=0,
                            kv_cache_spec_kind="mla_attention", **common),
            VllmBlockStored(block_hashes=[committed.checkpoint_hash], parent_block_hash=None,
                            group_idx=1, kv_cache_spec_kind="mamba", **common)]


async def test_commits_reach_a_vllm_subscriber_as_block_stored_in_seq_order(
        redis, redis_url, mosquitto: MosquittoServer, tmp_path: Path) -> None:
    async with bridged(redis_url, mosquitto.url, tmp_path) as b, \
            running_agent(b.service.url), \
            CacheTierClient(b.service.url, token=TOKEN, timeout=10) as tier:
        [registered] = await b.consumer.take(1)  # the agent's fresh pool
        assert registered.batch.events == [VllmAllBlocksCleared()]
        first = await commit_prompt(tier, "r1", 1)
        second = await commit_prompt(tier, "r2", 5000)
        seen = await b.consumer.take(2)
    assert [s.seq for s in seen] == [registered.seq + 1, registered.seq + 2]
    assert [s.batch.events for s in seen] == [stored_of(first), stored_of(second)]
    assert all(s.live for s in seen)
    assert all(s.batch.data_parallel_rank == 0 and s.batch.ts > 0 for s in seen)


async def test_the_replay_socket_returns_the_batches_a_late_consumer_missed(
        redis, redis_url, mosquitto: MosquittoServer, tmp_path: Path) -> None:
    async with bridged(redis_url, mosquitto.url, tmp_path) as b, running_agent(b.service.url), \
            CacheTierClient(b.service.url, token=TOKEN, timeout=10) as tier:
        committed = [await commit_prompt(tier, f"r{i}", 1 + 5000 * i) for i in range(3)]
        seen = await b.consumer.take(4)  # the agent's clear, then the three commits
        config = b.bridge.config
        assert config.replay_endpoint is not None
        with consumer(config.endpoint, config.replay_endpoint) as late:
            everything = await late.replay(0)
            assert [(s.seq, s.batch) for s in everything] == [(s.seq, s.batch) for s in seen]
            tail = await late.replay(seen[2].seq)
    assert [s.batch.events for s in tail] == [stored_of(committed[1]), stored_of(committed[2])]
    assert [s.seq for s in tail] == [seen[2].seq, seen[3].seq]


async def test_a_cachetier_seq_gap_becomes_all_blocks_cleared(
        redis, redis_url, mosquitto: MosquittoServer, tmp_path: Path) -> None:
    async with bridged(redis_url, mosquitto.url, tmp_path, max_queued=1) as b, \
            running_agent(b.service.url), \
            CacheTierClient(b.service.url, token=TOKEN, timeout=10) as tier:
        await b.consumer.take(1)  # the agent's fresh pool
        before = await commit_prompt(tier, "before", 1)
        [seen_before] = await b.consumer.take(1)
        await b.publisher.link.close()  # the service loses its broker ...
        lost = await commit_prompt(tier, "lost", 5000)
        after = await commit_prompt(tier, "after", 10000)  # ... and its 1-batch buffer overflows
        assert b.publisher.dropped == 1
        b.publisher.link.start()
        [seen_after] = await b.consumer.take(1)
    assert seen_before.batch.events == stored_of(before)
    assert seen_after.seq == seen_before.seq + 1
    assert seen_after.batch.events == [VllmAllBlocksCleared(), *stored_of(after)]
    assert lost.block_hashes[0] not in {h for s in (seen_before, seen_after)
                                        for e in s.batch.events
                                        for h in getattr(e, "block_hashes", [])}


async def test_every_pool_in_one_stream_told_apart_by_ownership(
        redis, redis_url, mosquitto: MosquittoServer, tmp_path: Path) -> None:
    async with bridged(redis_url, mosquitto.url, tmp_path, pool="+") as b, \
            running_agent(b.service.url, pool="p"), \
            CacheTierClient(b.service.url, token=TOKEN, timeout=10) as tier:
        await b.consumer.take(1)  # p's fresh pool
        in_p = await commit_prompt(tier, "r", 1, pool="p")
        async with running_agent(b.service.url, pool="q"):
            seen = await b.consumer.take(2)  # p's commit, q's fresh pool
            in_q = await commit_prompt(tier, "r", 1, pool="q")  # the same prompt, the same hashes
            seen += await b.consumer.take(1)
    assert in_p.block_hashes == in_q.block_hashes
    assert [s.batch.events for s in seen] == [stored_of(in_p, "p"), [VllmAllBlocksCleared()],
                                              stored_of(in_q, "q")]


# --- the command -------------------------------------------------------------------------------

async def test_cli_bridges_until_sigterm(mosquitto: MosquittoServer) -> None:
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CACHETIER_TOKEN": CREDENTIAL}
    with consumer(endpoint, replay_endpoint, bind=True) as sub:  # vLLM: a tcp://HOST PUB connects
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachetier.cli", "events", "vllm", "--mqtt", mosquitto.url,
             "--pool", "cli", "--endpoint", endpoint, "--replay-endpoint", replay_endpoint,
             "--preset", "tiny-gqa"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.decode().strip() == (f"cachetier events vllm: pool cli of {mosquitto.url} "
                                             f"published on {endpoint}, replay on "
                                             f"{replay_endpoint}")
            async with MqttEventPublisher(mosquitto.url) as publisher:
                publisher.publish("cli", [BlockStored([b"h" * 16], None, 16, "mla")])
                publisher.publish("elsewhere", [AllBlocksCleared(1)])  # another pool: not bridged
                publisher.publish("cli", [BlockRemoved([b"h" * 16], "mla")])
                seen = await sub.take(2)
            assert [type(e) for s in seen for e in s.batch.events] == [VllmBlockStored,
                                                                       VllmBlockRemoved]
            assert seen[0].batch.events[0].kv_cache_spec_kind == "full_attention"
            assert [r.seq for r in await sub.replay(0)] == [s.seq for s in seen]  # its keys
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_refuses_a_replay_endpoint_without_a_credential(monkeypatch, capsys) -> None:
    from cachetier.cli import main
    monkeypatch.delenv("CACHETIER_TOKEN", raising=False)
    assert main(["events", "vllm", "--mqtt", "mqtt://127.0.0.1:1", "--endpoint", "tcp://*:0",
                 "--replay-endpoint", "tcp://*:0"]) == 2
    assert "--replay-endpoint: answers only peers holding the bridge's credential" in \
        capsys.readouterr().err


# --- the guards: loopback binds, CURVE replay peers, the replay rate ---------------------------

def listening_hosts(port: int) -> set[str]:
    """The local addresses this process listens on at `port` (the kernel's view)."""
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@contextlib.asynccontextmanager
async def publishing(broker: str, batches: int, replay_rate: int = 1000
                     ) -> AsyncIterator[tuple[VllmEventBridge, str]]:
    """A default bridge (wildcard endpoints) with `batches` published; its replay endpoint."""
    settings = BridgeSettings(broker, f"tcp://*:{free_port()}", f"tcp://*:{free_port()}",
                              replay_keys=KEYS, replay_rate=replay_rate)
    async with VllmEventBridge(settings) as bridge:
        for i in range(batches):
            bridge.publisher.publish(KVEventBatch(ts=float(i), events=[VllmAllBlocksCleared()]))
        replay_endpoint = bridge.config.replay_endpoint
        assert replay_endpoint is not None
        yield bridge, replay_endpoint


async def test_a_default_bridge_binds_its_wildcard_endpoints_on_loopback_only(
        mosquitto: MosquittoServer) -> None:
    async with publishing(mosquitto.url, 0) as (bridge, replay_endpoint):
        bound = [bridge.config.endpoint, replay_endpoint]
        assert all(e.startswith("tcp://127.0.0.1:") for e in bound), bound
        ports = [int(e.rpartition(":")[2]) for e in bound]
        assert [listening_hosts(port) for port in ports] == [{"127.0.0.1"}, {"127.0.0.1"}]


async def replay_request(replay_endpoint: str, keys: ReplayKeys | None,
                         wait_s: float = TIMEOUT_S) -> list[Seen] | None:
    """One replay from seq 0 on a fresh DEALER; None when nothing comes back within `wait_s`."""
    with replay_peer(replay_endpoint, keys) as socket:
        try:
            return await asyncio.wait_for(replay(socket, 0), wait_s)
        except TimeoutError:
            return None


async def test_the_replay_socket_answers_only_peers_holding_the_credential(
        mosquitto: MosquittoServer) -> None:
    async with publishing(mosquitto.url, 3) as (_, replay_endpoint):
        async with asyncio.timeout(TIMEOUT_S):
            answer: list[Seen] | None = []
            while answer is not None and len(answer) < 3:  # until the publisher sent all three
                answer = await replay_request(replay_endpoint, KEYS)
        assert answer is not None and [s.seq for s in answer] == [0, 1, 2]
        assert [s.batch.ts for s in answer] == [0.0, 1.0, 2.0]
        for stranger in (None, ReplayKeys.of("observer.another-cluster")):  # plain, wrong keys
            assert await replay_request(replay_endpoint, stranger, wait_s=1.0) is None


async def test_a_replay_flood_gets_at_most_the_rate_of_batches_a_second(
        mosquitto: MosquittoServer) -> None:
    rate, batches, requests = 4, 12, 12
    async with publishing(mosquitto.url, batches, replay_rate=rate) as (_, replay_endpoint):
        await asyncio.sleep(0.3)  # the publisher thread sends (and buffers) the batches
        with replay_peer(replay_endpoint) as socket:
            started = time.monotonic()
            for _ in range(requests):  # each asks for all twelve batches
                await socket.send_multipart([b"", (0).to_bytes(8, "big")])
            answers = await asyncio.wait_for(read_answers(socket, requests), TIMEOUT_S)
            elapsed = time.monotonic() - started
    sent = sum(answers)
    assert answers[0] == rate, answers  # one request gets at most the rate too
    assert max(answers) <= rate and sent <= rate * (int(elapsed) + 1), (answers, elapsed)


async def read_answers(socket: zmq.asyncio.Socket, requests: int) -> list[int]:
    """The batches in each of `requests` replay answers, in order (each ends at vLLM's marker)."""
    answers = [0]
    while len(answers) <= requests:
        _, _, seq, _ = await socket.recv_multipart()
        if seq == ZmqEventPublisher.END_SEQ:
            answers.append(0)
        else:
            answers[-1] += 1
    return answers[:-1]


def test_the_replay_rate_allows_n_batches_in_any_one_second_window() -> None:
    now = [0.0]
    rate = BatchRate(3, clock=lambda: now[0])
    taken = []
    for t in [0.0, 0.1, 0.2, 0.3, 0.99, 1.0, 1.05, 1.1, 1.2, 2.5]:
        now[0] = t
        if rate.take():
            taken.append(t)
    assert taken == [0.0, 0.1, 0.2, 1.0, 1.1, 1.2, 2.5]
    with pytest.raises(ValueError):
        BatchRate(0)
