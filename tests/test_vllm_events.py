"""cachetier's cache events as vLLM KV events: the mapping on its own, then the bridge between a
real mosquitto (the service publishing its commits) and real ZeroMQ sockets, decoded with vLLM's
own decoder the way vLLM's example subscriber does (`msgspec.msgpack.Decoder(KVEventBatch)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
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
from cachetier.events.vllm_bridge import VllmEventBridge, run_bridge
from cachetier.events.vllm_events import VllmEventMapping, to_vllm, vllm_batch
from cachetier.run.servers import MosquittoServer, free_port
from cachetier.service.server import CacheTierService
from index.lifecycle import RequestLifecycle
from index.records import CommittedRequest
from tests.cluster_harness import BLOCK, TOKEN, running_agent, running_service
from tests.index_harness import commit_item, new_request, only

TIMEOUT_S = 10.0
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ROOT = Path(__file__).resolve().parent.parent


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
        """The publisher's buffered batches from `start` on, up to its end marker."""
        await self.replay_socket.send_multipart([b"", start.to_bytes(8, "big")])
        seen = []
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                _, topic, seq_bytes, payload = await self.replay_socket.recv_multipart()
                if seq_bytes == ZmqEventPublisher.END_SEQ:
                    return seen
                seen.append(Seen(int.from_bytes(seq_bytes, "big"), DECODER.decode(payload), False))


@contextlib.contextmanager
def consumer(endpoint: str, replay_endpoint: str, *, bind: bool = False) -> Iterator[VllmConsumer]:
    """`bind`: the subscriber binds `endpoint`, for a publisher that connects (tcp://HOST:PORT)."""
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(endpoint) if bind else sub.connect(endpoint)
        replay = ctx.socket(zmq.DEALER)
        replay.connect(replay_endpoint)
        yield VllmConsumer(sub, replay)
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
        task = asyncio.create_task(run_bridge(broker, pool, endpoint, replay_endpoint,
                                              backoff=Backoff(0.01, 0.1), ready=ready.set_result))
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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
