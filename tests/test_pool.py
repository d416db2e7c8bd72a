"""PagedPool: typed views are views, layouts match `PageLayout`, debug tags, cross-process sharing."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import queue
import time
from typing import Any, Iterator

import pytest
import torch

from cachetier.config import PRESETS, CacheSpec, ModelSpec
from gpu_pool import PageKind, PageKindError, PagedPool, PoolHandle
from gpu_pool.sharing import HostShm

TINY = PRESETS["tiny"]
BF16_MODEL = dataclasses.replace(TINY.model, kda_state_dtype="bfloat16", conv_dtype="bfloat16",
                                 mla_dtype="bfloat16", mla_latent_dim=32)
# the GDN + GQA family with tiny's 4 value heads (over 2 key heads): token rows of 2 KV heads
GQA_MODEL = dataclasses.replace(PRESETS["tiny-gqa"].model, kda_heads=4, kda_key_heads=2)
SMALL_CACHE = dataclasses.replace(TINY.cache, num_pages=8)
BY_DTYPE = pytest.mark.parametrize("pool", [(TINY.model, False), (BF16_MODEL, False),
                                            (GQA_MODEL, False)],
                                   ids=["fp32", "bf16", "gdn-gqa"], indirect=True)
DEBUG = pytest.mark.parametrize("pool", [(TINY.model, True)], ids=["debug"], indirect=True)
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


def pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic data both processes can rebuild, so values can be checked on either side."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> Iterator[PagedPool]:
    model, debug = getattr(request, "param", (TINY.model, False))
    with PagedPool.create(model, SMALL_CACHE, debug=debug) as p:
        yield p


def test_views_have_the_layout_shapes_and_dtypes(pool: PagedPool) -> None:
    assert pool.buffer.shape == (2, 8, 6656) and pool.buffer.dtype == torch.uint8
    assert pool.mla_view(1).shape == (2, 64, 16) and pool.mla_view(1).dtype == torch.float32
    assert pool.kda_view(1).shape == (2, 4, 16, 16)
    assert pool.kda_view(1, heads=slice(1, 3)).shape == (2, 2, 16, 16)
    assert pool.conv_view(1).shape == (2, 192, 3) and pool.conv_view(1).dtype == torch.float32


@pytest.mark.parametrize("pool", [(GQA_MODEL, False)], ids=["gdn-gqa"], indirect=True)
def test_gqa_views_hold_kv_heads_per_token_and_gdn_conv_by_key_heads(pool: PagedPool) -> None:
    assert pool.mla_view(1).shape == (2, 64, 2 * 2 * 8)  # per token: K, V of head 0, then head 1
    assert pool.kda_view(1).shape == (2, 4, 16, 16)
    assert pool.conv_view(1).shape == (2, 2 * 2 * 16 + 4 * 16, 3)  # q, k of 2 key heads; v of 4


def test_views_alias_the_buffer_at_the_layout_offsets(pool: PagedPool) -> None:
    layout = pool.layout
    base = pool.buffer.data_ptr()
    head2 = layout.buffer_range(page=3, slot=0, within=layout.kda_head_range(2))
    assert pool.kda_view(3, heads=slice(2, 4)).data_ptr() == base + head2.offset
    token0 = layout.buffer_range(5, 0, layout.mla_token_range(0, 0))
    assert pool.mla_view(5).data_ptr() == base + token0.offset
    pool.mla_view(5)[1, 7, 3] = 2.5
    assert pool.mla_view(5)[1, 7, 3] == 2.5


@BY_DTYPE
def test_kda_head_stream_bytes_sit_where_the_layout_says(pool: PagedPool) -> None:
    layout = pool.layout
    state = pattern((2, 4, 16, 16), layout.kda_dtype, seed=1)
    pool.kda_view(2).copy_(state)
    flat = pool.buffer.view(-1)
    for slot in range(2):
        for head in range(4):
            r = layout.buffer_range(2, slot, layout.kda_head_range(head))
            stored = state[slot, head].transpose(0, 1).contiguous().view(-1).view(torch.uint8)
            assert torch.equal(flat[r.offset:r.end], stored)


@BY_DTYPE
def test_conv_rows_sit_channel_major_before_the_recurrent_part(pool: PagedPool) -> None:
    layout = pool.layout
    conv = pattern(tuple(pool.conv_view(2).shape), layout.conv_dtype, seed=5)
    state = pattern((2, 4, 16, 16), layout.kda_dtype, seed=6)
    pool.conv_view(2).copy_(conv)
    pool.kda_view(2).copy_(state)
    for slot in range(2):
        block = pool.buffer[slot, 2, :layout.recurrent_offset]
        assert torch.equal(block, conv[slot].contiguous().view(-1).view(torch.uint8))
    assert torch.equal(pool.conv_view(2), conv)  # the recurrent write left the conv rows alone


@BY_DTYPE
def test_first_tokens_of_an_mla_page_are_a_byte_prefix(pool: PagedPool) -> None:
    layout = pool.layout
    latents = pattern(tuple(pool.mla_view(4).shape), layout.mla_dtype, seed=2)
    pool.mla_view(4).copy_(latents)
    r = layout.mla_token_range(0, 48)
    for slot in range(2):
        stored = latents[slot, :48].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(pool.buffer[slot, 4, r.offset:r.end], stored)


@pytest.mark.parametrize("tagged, read", [
    (PageKind.KDA, "mla_view"), (PageKind.MLA, "kda_view"), (PageKind.MLA, "conv_view"),
    (PageKind.UNTAGGED, "mla_view"),
], ids=["kda-read-as-mla", "mla-read-as-kda", "mla-read-as-conv", "untagged-read"])
@DEBUG
def test_debug_mode_rejects_mismatched_views(pool: PagedPool, tagged: PageKind, read: str) -> None:
    pool.tag(1, tagged)
    with pytest.raises(PageKindError, match="page 1 is tagged"):
        getattr(pool, read)(1)


@DEBUG
def test_debug_mode_allows_matching_views(pool: PagedPool) -> None:
    pool.tag(1, PageKind.MLA)
    pool.tag(2, PageKind.KDA)
    assert pool.kind(1) is PageKind.MLA and pool.kind(2) is PageKind.KDA
    pool.mla_view(1)
    pool.kda_view(2, heads=slice(0, 1))


@BY_DTYPE
def test_type_confused_reads_give_visibly_different_data(pool: PagedPool) -> None:
    """Same bytes, other layout: a KDA page read as MLA tokens gives the conv rows, then each head's
    state transposed, never a plausible reshape of the state; an MLA page read as KDA heads starts
    at other bytes."""
    layout = pool.layout
    state = pattern((2, 4, 16, 16), layout.kda_dtype, seed=3)
    pool.kda_view(1).copy_(state)
    assert layout.recurrent_offset % layout.geometry.mla_token_bytes == 0
    first_token = layout.recurrent_offset // layout.geometry.mla_token_bytes
    tokens = layout.head_bytes // layout.geometry.mla_token_bytes
    head0 = pool.mla_view(1)[:, first_token:first_token + tokens]  # head 0's bytes as tokens
    assert not torch.allclose(head0.float(), state[:, 0].float().reshape(head0.shape))
    assert torch.equal(head0.float(), state[:, 0].transpose(1, 2).float().reshape(head0.shape))
    latents = pattern(tuple(pool.mla_view(2).shape), pool.layout.mla_dtype, seed=4)
    pool.mla_view(2).copy_(latents)
    as_kda = pool.kda_view(2).reshape(2, -1)[:, :1024].float()
    assert not torch.allclose(as_kda, latents.reshape(2, -1)[:, :1024].float())


@pytest.mark.parametrize("call, args", [
    ("mla_view", (8,)), ("kda_view", (-1,)), ("tag", (9, PageKind.MLA)),
    ("kda_view", (0, slice(0, 4, 2))),
], ids=["page-past-end", "negative-page", "tag-past-end", "strided-heads"])
def test_bad_arguments_are_rejected(pool: PagedPool, call: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        getattr(pool, call)(*args)


def test_kda_view_on_a_model_without_kda_is_rejected() -> None:
    model = ModelSpec(kda_groups=0)
    with PagedPool.create(model, CacheSpec(num_pages=2)) as p:
        with pytest.raises(ValueError, match="no KDA"):
            p.kda_view(0)
        with pytest.raises(ValueError, match="no KDA"):
            p.conv_view(0)


def test_handle_pickles_and_attaches_in_process(pool: PagedPool) -> None:
    handle = pickle.loads(pickle.dumps(pool.handle()))
    other = PagedPool.attach(handle)
    other.mla_view(3).fill_(7.0)
    assert torch.equal(pool.mla_view(3), torch.full((2, 64, 16), 7.0))
    other.tag(3, PageKind.MLA)
    assert pool.kind(3) is PageKind.MLA


def test_close_removes_the_shared_names_only_for_the_owner() -> None:
    pool = PagedPool.create(TINY.model, SMALL_CACHE)
    handle = pool.handle()
    assert isinstance(handle.data, HostShm)
    PagedPool.attach(handle).close()
    assert os.path.exists(handle.data.path) and os.path.exists(handle.tags.path)
    pool.mla_view(0).fill_(1.0)
    pool.close()
    assert not os.path.exists(handle.data.path) and not os.path.exists(handle.tags.path)
    assert pool.mla_view(0).sum() == 2 * 64 * 16  # the mapping outlives the name


def test_unsupported_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported pool device"):
        PagedPool.create(TINY.model, SMALL_CACHE, device="meta")


def _worker(handle: PoolHandle, inbox: Any, outbox: Any) -> None:
    """Runs in a spawned process: check the agent's bytes, write some, check the agent's next write."""
    pool = PagedPool.attach(handle)
    cpu = pool.buffer.device.type == "cpu"
    mla_shape, kda_shape = tuple(pool.mla_view(1).shape), tuple(pool.kda_view(2).shape)
    saw = torch.equal(pool.mla_view(1).cpu(), pattern(mla_shape, torch.float32, 10))
    report = {"saw_agent_write": saw}
    pool.kda_view(2).copy_(pattern(kda_shape, torch.float32, 11))
    try:
        pool.mla_view(2)  # the agent tagged page 2 KDA: tags are shared too
        report["tags_shared"] = False
    except PageKindError:
        report["tags_shared"] = True
    if cpu:
        with open("/proc/self/maps") as f:
            maps = f.read()
        path = handle.data.path
        report["mapped_file"] = path in maps and pool.buffer.untyped_storage().filename == path
    else:
        torch.cuda.synchronize()
    outbox.put(report)
    inbox.get(timeout=60)
    outbox.put({"saw_later_write": torch.equal(pool.mla_view(1).cpu(),
                                               pattern(mla_shape, torch.float32, 12))})


@pytest.mark.parametrize("device", DEVICES)
def test_spawned_worker_shares_the_pool_both_ways(device: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    with PagedPool.create(TINY.model, SMALL_CACHE, device=device, debug=True) as pool:
        if device == "cpu":  # the agent's own buffer is the shared mapping, not a private copy
            assert pool.buffer.untyped_storage().filename == pool.handle().data.path
        pool.tag(1, PageKind.MLA)
        pool.tag(2, PageKind.KDA)
        pool.mla_view(1).copy_(pattern((2, 64, 16), torch.float32, 10))
        _sync(device)
        inbox, outbox = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=_worker, args=(pool.handle(), inbox, outbox))
        worker.start()
        try:
            first = _receive(outbox, worker)
            assert first.pop("saw_agent_write") and first.pop("tags_shared")
            assert all(first.values())  # mapped the same /dev/shm file (CPU)
            assert torch.equal(pool.kda_view(2).cpu(), pattern((2, 4, 16, 16), torch.float32, 11))
            pool.mla_view(1).copy_(pattern((2, 64, 16), torch.float32, 12))
            _sync(device)
            inbox.put("go")
            assert _receive(outbox, worker) == {"saw_later_write": True}
        finally:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
        assert worker.exitcode == 0


def _receive(outbox: Any, worker: Any, timeout: float = 120.0) -> Any:
    """The worker's next report; fails fast if the worker died instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return outbox.get(timeout=0.5)
        except queue.Empty:
            assert worker.is_alive(), f"worker exited with {worker.exitcode}"
    raise AssertionError("worker sent nothing in time")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
