"""The connector's worker side against a real cluster, with tensors laid out as vLLM's CPU engine
lays them (no engine: the layouts are what `tests/test_vllm_connector.py` proves end to end).

A save writes a request's prefix from vLLM blocks into the pool; the pool's own typed views must
then read the same values (so the pool holds cachetier's layout, not vLLM's bytes verbatim); a
load must restore them exactly into other blocks; a load pinned in an epoch the pool has left
must copy nothing and report the blocks it would have filled, for vLLM to recompute. Attention
K and V are written by vLLM's own CPU kernel (`cpu_attn_reshape_and_cache`), so the layout the
copies read is vLLM's, not this test's idea of it: its K is dim-major within a block, which a
token-row view only got right for whole blocks (a 128-token prompt tail came back wrong).
"""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import _custom_ops as vllm_ops

from cachetier.client import CacheTierClient
from cachetier.config import Config
from cachetier.run.cluster import POOL, Cluster
from cachetier.vllm.geometry import FINE_HASH_UNIT, config_for_model
from cachetier.vllm.jobs import CacheTierMetadata, LoadJob, SaveJob
from cachetier.vllm.kv_copy import (AttentionViews, TokenRows, engine_attention_views,
                                    rows_to_engine, rows_to_pool)
from cachetier.vllm.ranks import Ranks
from cachetier.vllm.settings import ConnectorSettings
from cachetier.vllm.tier_thread import TierThread
from cachetier.vllm.worker_side import ConnectorWorker, state_blocks
from gpu_pool import PagedPool
from index.hashing import chain_hashes, namespace_root
from kernels.tile_copy import _KERNEL as tile_copy_kernel
from tests.vllm_harness import tokens, vllm_cluster

GROUPS = ["linear", "linear", "linear", "full"]  # the tiny Qwen3-Next's groups, as vLLM orders them
BLOCKS = 16
PROMPT = tokens(50, 3000)
BOUNDARY = 2304  # the prompt's last block end, where vLLM keeps a state the pool saves


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with vllm_cluster(model_dir, tmp_path_factory.mktemp("cluster"), pool_pages=64) as running:
        yield running


def _engine_caches(config: Config) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: GDN layers as raw int8 blocks (conv then recurrent, padded to the
    page), the attention layer as bf16 `[blocks, kv heads, block tokens, 2 x head dim]`."""
    page, state = 294912, config.model.kda_rank_conv_bytes + config.model.kda_rank_recurrent_bytes
    caches = {f"layers.{i}.linear_attn": torch.zeros(BLOCKS, page, dtype=torch.int8).as_strided(
        (BLOCKS, 1, 1, state), (page, state, state, 1)) for i in range(3)}
    caches["layers.3.self_attn.attn"] = torch.zeros(BLOCKS, 2, 1152, 64, dtype=torch.bfloat16)
    return caches


def _worker(cluster: Cluster,
            model_dir: Path) -> tuple[ConnectorWorker, dict[str, torch.Tensor], dict[str, Any]]:
    info = json.loads((cluster.run_dir / "info.json").read_text())
    settings = ConnectorSettings.from_extra_config(info["kv_transfer_config"]
                                                   ["kv_connector_extra_config"])
    tier = TierThread(settings.service, settings.token)
    names = [[f"layers.{i}.linear_attn"] for i in range(3)] + [["layers.3.self_attn.attn"]]
    worker = ConnectorWorker(settings, cluster.settings.config, GROUPS, names, tier, Ranks(0, 1),
                             "vec")
    caches = _engine_caches(cluster.settings.config)
    worker.register_kv_caches(caches)
    return worker, caches, info


def _state(caches: dict[str, torch.Tensor], layer: int, block: int,
           config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """One GDN state as vLLM's model sees it: conv `[kernel - 1, channels]`, recurrent
    `[H, V, K]`."""
    raw = caches[f"layers.{layer}.linear_attn"][block].reshape(-1).view(torch.uint8)
    conv_bytes = config.model.kda_rank_conv_bytes
    return (raw[:conv_bytes].view(torch.bfloat16).view(3, 1024),
            raw[conv_bytes:].view(torch.float32).view(4, 128, 128))


def _write_kv(kv: torch.Tensor, slots: torch.Tensor, noise: torch.Generator,
              isa: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V `[tokens, heads, dim]` for vLLM slots (`block * 1152 + row`), written into
    the attention cache by vLLM's CPU kernel of that family, as a forward pass does."""
    blocks, heads, block_tokens, _ = kv.shape
    keys = torch.randn(len(slots), heads, 32, generator=noise).to(torch.bfloat16)
    values = torch.randn(len(slots), heads, 32, generator=noise).to(torch.bfloat16)
    key_cache, value_cache = kv.view(blocks, heads, 2 * block_tokens, 32).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    return keys, values


def _fill(caches: dict[str, torch.Tensor], state_blocks: list[int], kv_blocks: list[int],
          config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Random states and every row of `kv_blocks`; returns K and V by token of those blocks."""
    noise = torch.Generator().manual_seed(3)
    for i, block in enumerate(state_blocks):
        for part in _state(caches, i, block, config):
            part.copy_(torch.randn(part.shape, generator=noise).to(part.dtype))
    slots = torch.cat([block * 1152 + torch.arange(1152) for block in kv_blocks])
    return _write_kv(caches["layers.3.self_attn.attn"], slots, noise)


def _pin(info: dict[str, Any], reader: str, prompt: list[int] = PROMPT) -> Any:
    hashes = chain_hashes(prompt, namespace_root(info["model_id"]), FINE_HASH_UNIT)

    async def pin() -> Any:
        async with CacheTierClient(info["service"], token=info["token"]) as tier:
            return await tier.pin(POOL, reader, len(prompt), hashes)
    return asyncio.run(pin())


def _release(info: dict[str, Any], reader: str) -> None:
    async def release() -> None:
        async with CacheTierClient(info["service"], token=info["token"]) as tier:
            await tier.release(POOL, [reader])
    asyncio.run(release())


@pytest.mark.parametrize("interpret", [False, True], ids=["torch", "triton-interpreter"])
def test_a_saved_prefix_is_in_cachetier_layout_and_loads_back_exactly(
        cluster: Cluster, model_dir: Path, interpret: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the torch path (plain CPU), then through the Triton kernels (the interpreter, as a
    CUDA engine runs them compiled), each with a prompt of its own so each saves."""
    monkeypatch.setattr(tile_copy_kernel, "_built", {})  # built here iff the worker launches it
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prompt = tokens(51, 3000) if interpret else PROMPT
    worker, caches, info = _worker(cluster, model_dir)
    state_blocks, kv_blocks = [1, 2, 3], [4, 5, 6]
    keys, values = _fill(caches, state_blocks, kv_blocks, cluster.settings.config)
    hashes = chain_hashes(prompt[:BOUNDARY], namespace_root(info["model_id"]), FINE_HASH_UNIT)
    table = ([0, 1, 0], [0, 2, 0], [0, 3, 0], kv_blocks)
    worker.save(CacheTierMetadata(saves=[SaveJob("r1", BOUNDARY, len(prompt), hashes,
                                                 state_blocks, table)]))
    pinned = _pin(info, "reader", prompt)
    assert pinned.hit_tokens == BOUNDARY
    pool = PagedPool.attach(pickle.loads(cluster.handle_file(0).read_bytes()))
    for i, page in enumerate(pinned.checkpoint_pages):  # the pool's own views read vLLM's state
        conv, recurrent = _state(caches, i, state_blocks[i], cluster.settings.config)
        assert torch.equal(pool.conv_view(page)[0], conv.T)
        assert torch.equal(pool.kda_view(page)[0], recurrent.transpose(-1, -2))
    kv = caches["layers.3.self_attn.attn"]
    for token in (0, 1500, 2303):  # the pool's token rows hold the K and V vLLM wrote
        page = pinned.mla_pages[0][token // 1152]
        row = pool.mla_view(page)[0, token % 1152].view(2, 2, 32)  # [head, K/V, dim]
        assert torch.equal(row, torch.stack((keys[token], values[token]), dim=1)), token

    fresh_state, fresh_kv = [7, 8, 9], [10, 11, 12]
    job = LoadJob("r2", pinned.hit_tokens, 0, pinned.epoch, pinned.mla_pages,
                  pinned.checkpoint_pages,
                  ([0, 0, 7], [0, 0, 8], [0, 0, 9], fresh_kv))
    worker.start_load(CacheTierMetadata(loads=[job]))
    _release(info, "reader")
    assert worker.take_load_results() == ({"r2"}, set())  # ended, not failed
    for i in range(3):
        cache = caches[f"layers.{i}.linear_attn"]
        assert torch.equal(cache[fresh_state[i]], cache[state_blocks[i]])
    assert torch.equal(kv[fresh_kv[:2]], kv[kv_blocks[:2]])  # whole blocks, byte for byte
    assert not kv[fresh_kv[2]].any(), "rows past the hit are vLLM's to compute"
    assert list(tile_copy_kernel._built) == ([True] if interpret else [])
    worker.tier.close()


def test_a_load_pinned_in_a_voided_epoch_copies_nothing_and_reports_a_failed_receive(
        cluster: Cluster, model_dir: Path) -> None:
    worker, caches, info = _worker(cluster, model_dir)
    pinned = _pin(info, "stale-reader")
    assert pinned.hit_tokens == BOUNDARY  # saved by the test above
    job = LoadJob("r3", pinned.hit_tokens, 1152, pinned.epoch - 1, pinned.mla_pages,
                  pinned.checkpoint_pages, ([0, 0, 13], [0, 0, 14], [0, 0, 15], [1, 2, 3]))
    worker.start_load(CacheTierMetadata(loads=[job]))
    _release(info, "stale-reader")
    # ended (the request leaves its wait) and failed (vLLM recomputes it); no block-level
    # failure, which vLLM 0.32 cannot map to requests of a hybrid model (it stops the engine)
    assert worker.take_load_results() == ({"r3"}, {"r3"})
    assert worker.take_load_results() == (set(), set())
    assert not any(caches[f"layers.{i}.linear_attn"][13 + i].any() for i in range(3))
    assert not caches["layers.3.self_attn.attn"][[2, 3]].any()
    worker.tier.close()


def test_a_hit_fills_its_own_block_and_every_block_the_pass_may_run_in() -> None:
    """vLLM copies a hit's state block into the block the step's pass runs in (the table's last)
    before the connector loads, and the pass reads that copy: both must get the state (found with
    real engines: block-aligned hits, then first chunks crossing block ends, came out wrong until
    then). A null block (id 0) is never written."""
    assert state_blocks([0, 3, 9], 2304, 1152) == [3, 9]
    assert state_blocks([0, 0, 1], 2944, 1152) == [1]
    assert state_blocks([0, 0, 7], 2304, 1152) == [7]
    assert state_blocks([0, 5], 2304, 1152) == [5]  # no block past the table's end
    # a first chunk from 2,304 to 5,438: null blocks up to the one it ends in
    assert state_blocks([0, 3, 0, 0, 8], 2304, 1152) == [3, 8]
    assert state_blocks([0, 0, 4, 0, 8], 2944, 1152) == [4, 8]


@pytest.mark.parametrize("isa", [
    "vec",
    pytest.param("amx", marks=pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="vLLM picks its amx kernels only on a CPU with AMX tiles"))])
def test_part_of_a_block_moves_exactly_the_rows_vllm_wrote(model_dir: Path, isa: str) -> None:
    """A prompt tail at 128 tokens fills part of a block: saving and restoring its rows must move
    those tokens' K and V (every dim) and nothing else, in each CPU kernel family's layout. The
    copies used to view vLLM's "vec" K as token rows, which it is not (it is dim-major): whole
    blocks still came back exact, but the tail rows of a restored block were other bytes (0.03
    nats off vLLM's own reuse). Its "amx" layout packs K by 16 tokens and V by token pairs, so a
    tail of 128 rows that a view got wrong would move other tokens' halves."""
    kv = torch.zeros(4, 2, 1152, 64, dtype=torch.bfloat16)
    noise = torch.Generator().manual_seed(5)
    written = 2 * 1152 + torch.arange(300)  # block 2: a pass has written its first 300 rows
    keys, values = _write_kv(kv, written, noise, isa)
    model = config_for_model(model_dir, num_pages=4).model
    views = engine_attention_views(kv, 1152, model, isa)
    page = AttentionViews(torch.zeros(1, 1152, 2, 32, dtype=torch.bfloat16),
                          torch.zeros(1, 1152, 2, 32, dtype=torch.bfloat16))
    table = [0, 0, 2]
    rows = TokenRows.of([(2304, 2432, table, [0, 0, 0])], 1152, 1152)
    rows_to_pool(views, page, rows)
    assert torch.equal(page.keys[0, :128], keys[:128])
    assert torch.equal(page.values[0, :128], values[:128])
    assert not page.keys[0, 128:].any() and not page.values[0, 128:].any()

    restored = torch.zeros_like(kv)
    rows_to_engine(page, engine_attention_views(restored, 1152, model, isa),
                   TokenRows.of([(2304, 2432, [0, 0, 3], [0, 0, 0])], 1152, 1152))
    expected = torch.zeros_like(kv)
    key_cache, value_cache = expected.view(4, 2, 2 * 1152, 32).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(keys[:128], values[:128], key_cache, value_cache,
                                        3 * 1152 + torch.arange(128), isa)
    assert torch.equal(restored, expected)  # vLLM's own bytes for those 128 tokens, no others
