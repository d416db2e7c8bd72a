"""`vllm serve` with the connector: vLLM's OpenAI server started from `up --vllm-model`'s info
file (`vllm_serve_args`), two servers in turn over one cluster, with the cluster's vLLM KV events
followed by a router-side subscriber.

Server A computes a prompt and saves its block-end state through the tier; server B, a new
process started after A stops, serves the same prompt from the tier: the completion reports the
load (`kv_transfer_params`, `usage.prompt_tokens_details.cached_tokens`) and gives A's outputs.
A's save reaches the subscriber of the cluster's `kv_events_endpoint` as vLLM `BlockStored`
events, decoded with vLLM's own classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from cachetier.run.cluster import POOL, Cluster
from cachetier.run.servers import free_port
from cachetier.vllm.geometry import FINE_HASH_UNIT
from cachetier.vllm.oracle import compare
from tests.vllm_harness import ApiServer, check_no_pins, tokens, vllm_cluster

PAGE = 1152  # the tiny model's vLLM attention block, the pool's page
UNIT = FINE_HASH_UNIT  # the pool's hash block (vLLM's prefix_match_unit)
PROMPT = tokens(40, 2 * PAGE + 200)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # vLLM's publisher binds a wildcard address (and connects to a concrete one, for a
    # subscriber that binds)
    endpoint = f"tcp://*:{free_port()}"
    with vllm_cluster(model_dir, tmp_path_factory.mktemp("cluster"), pool_pages=128,
                      kv_events_endpoint=endpoint) as running:
        yield running


@pytest.fixture
def events(cluster: Cluster) -> Iterator[zmq.Socket]:
    endpoint = json.loads((cluster.run_dir / "info.json").read_text())["kv_events_endpoint"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint.replace("*", "127.0.0.1"))
    try:
        yield sub
    finally:
        ctx.destroy(linger=0)


def test_a_second_openai_server_serves_the_first_ones_prefix(
        model_dir: Path, cluster: Cluster, events: zmq.Socket, tmp_path: Path) -> None:
    info = cluster.run_dir / "info.json"
    with ApiServer(model_dir, info, tmp_path / "a.log") as a:
        first = a.complete(PROMPT)
    assert first["connector"]["cachetier_saved_boundaries"] >= 1
    assert first["num_cached_tokens"] == 0
    stored = _stored(events, want=2)
    # the saved prefix as a router sees it: the attention chain, then the state checkpoint
    assert {(s.kv_cache_spec_kind, s.block_size, s.ownership) for s in stored} == {
        ("full_attention", UNIT, f"cachetier/{POOL}"), ("mamba", UNIT, f"cachetier/{POOL}")}
    with ApiServer(model_dir, info, tmp_path / "b.log") as b:
        again = b.complete(PROMPT)
    hit = (len(PROMPT) - 1) // UNIT * UNIT  # the prompt's tail, inside its third block
    assert again["connector"]["cachetier_loaded_tokens"] == hit
    assert again["num_cached_tokens"] == hit
    verdict = compare(again, first)
    assert verdict.ok, verdict
    check_no_pins(cluster)


def _stored(sub: zmq.Socket, want: int, timeout_ms: int = 20_000) -> list[Any]:
    """The first `want` `BlockStored` events the subscriber gets (vLLM's frames: topic, sequence
    number, the msgpack batch)."""
    stored: list[Any] = []
    while len(stored) < want:
        assert sub.poll(timeout_ms), f"no vLLM KV event within {timeout_ms} ms: {stored}"
        *_, payload = sub.recv_multipart()
        stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]
    return stored
