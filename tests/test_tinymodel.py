"""The tiny hybrid model as an oracle: pool runs equal the cold recompute, and the check can fail.

Every test that runs the model runs it for both families, `tiny` (KDA + MLA) and `tiny-gqa` (Gated
DeltaNet + GQA): the module's fixtures are parametrized by the preset.

Prompt A is prefilled once per module through the pool, in chunks that cross hash blocks mid-chunk,
leaving its MLA pages and one checkpoint per crossed block; later tests resume other requests from
those pages, always through copies (restore, copy-on-write) so A's shared pages stay untouched.
Tensor-parallel runs use pools of their own, one per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachetier.config import Config, load_config
from gpu_pool.layout import ByteRange, PageKind
from gpu_pool.pool import PageKindError, PagedPool
from index.records import PageCopy, RequestPlan
from kernels import page_copy
from tinymodel import (ChunkError, ChunkRequest, PoolMismatch, TinyHybrid, UnsupportedModel, ops,
                       outputs_match)
from tinymodel.state import KdaState

TINY = load_config("tiny")
FAMILIES = ["tiny", "tiny-gqa"]
BLOCK, PAGE = TINY.cache.hash_block_tokens, TINY.cache.page_tokens
PROMPT = np.random.default_rng(7).integers(0, 2**32, 150, dtype=np.uint64)
A_BOUNDS = (0, 40, 70, 110, 128, 150)  # snapshots at 32, 64, 96, 144 inside a chunk, 128 at its end
SCRATCH = range(200, 256)  # reused by every hypothesis example: stale bytes are always there
RankPools = Callable[[int, int], list[PagedPool]]


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """Request A after its prefill: its page table and its checkpoints by boundary."""

    mla: list[list[int]]
    snapshots: dict[int, list[int]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matmuls only lose from a thread pool (they wait on its barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def config(request: pytest.FixtureRequest) -> Config:
    """The preset of the family under test (both share `TINY.cache`)."""
    config = load_config(request.param)
    assert config.cache == TINY.cache
    return config


@pytest.fixture(scope="module")
def model(config: Config) -> TinyHybrid:
    return TinyHybrid(config.model, seed=1)


@pytest.fixture(scope="module")
def pool(config: Config) -> Iterator[PagedPool]:
    with PagedPool.create(config.model, config.cache) as p:
        yield p


@pytest.fixture
def rank_pools(config: Config) -> Iterator[RankPools]:
    """Creates the pools of every rank of the family's model at a TP degree, closed after the
    test."""
    with contextlib.ExitStack() as stack:
        def create(degree: int, num_pages: int) -> list[PagedPool]:
            spec = dataclasses.replace(config.model, tp_degree=degree)
            cache = dataclasses.replace(config.cache, num_pages=num_pages)
            return [stack.enter_context(PagedPool.create(spec, cache)) for _ in range(degree)]
        yield create


@pytest.fixture(scope="module")
def page_ids(config: Config) -> Iterator[int]:
    return iter(range(SCRATCH.start))


@pytest.fixture(scope="module")
def reference(model: TinyHybrid) -> torch.Tensor:
    return model.recompute(PROMPT)


@pytest.fixture(scope="module")
def prefilled(model: TinyHybrid, pool: PagedPool, page_ids: Iterator[int],
              reference: torch.Tensor) -> Prefilled:
    mla = [take(page_ids, slots(len(PROMPT)))]
    outputs, snapshots = prefill(model, pool, PROMPT, A_BOUNDS, mla, take(page_ids, 3), page_ids)
    assert outputs_match(outputs, reference)
    return Prefilled(mla, snapshots)


def take(ids: Iterator[int], n: int) -> list[int]:
    return list(itertools.islice(ids, n))


def slots(tokens: int) -> int:
    return -(-tokens // PAGE)


def prefill(model: TinyHybrid, pool: PagedPool | Sequence[PagedPool],
            tokens: Sequence[int] | np.ndarray, bounds: Sequence[int], mla: list[list[int]],
            state: list[int], ids: Iterator[int]) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """Run the chunks [bounds[i], bounds[i+1]) one step each, snapshotting as the index plans it:
    at the last hash-block boundary of every chunk that crosses one, into fresh pages."""
    outputs, snapshots = [], {}
    for start, stop in itertools.pairwise(bounds):
        at = stop // BLOCK * BLOCK if stop // BLOCK > start // BLOCK else 0
        pages = take(ids, 3) if at else []
        outputs += model.forward(pool, [ChunkRequest(tokens, start, stop, mla, state, at, pages)])
        if at:
            snapshots[at] = pages
    return torch.cat(outputs), snapshots


def restore(pool: PagedPool, checkpoint: Sequence[int], state: Sequence[int]) -> None:
    nbytes = pool.layout.geometry.kda_page_bytes
    rows = [[src, dst, 0, nbytes] for src, dst in zip(checkpoint, state, strict=True)]
    page_copy(pool.buffer, pool.buffer, rows)


def copy_rows(pool: PagedPool, src: int, dst: int, tokens: int) -> None:
    page_copy(pool.buffer, pool.buffer, [[src, dst, 0, tokens * pool.layout.model.mla_token_bytes]])


def resume(pool: PagedPool, prefilled: Prefilled, ids: Iterator[int],
           hit: int) -> tuple[list[int], list[int]]:
    """Request B's pages after a hit at `hit` on A: A's whole pages below the hit shared, the
    partial page copied on write, fresh pages after it, the checkpoint restored into fresh state."""
    shared = hit // PAGE
    table = prefilled.mla[0][:shared] + take(ids, slots(len(PROMPT)) - shared)
    if hit % PAGE:
        copy_rows(pool, prefilled.mla[0][shared], table[shared], hit % PAGE)
    state = take(ids, 3)
    restore(pool, prefilled.snapshots[hit], state)
    return table, state


def corrupt(pool: PagedPool, page: int, slot: int, within: ByteRange) -> None:
    where = pool.layout.buffer_range(page, slot, within)
    pool.buffer.view(-1)[where.offset:where.end].view(torch.float32).add_(1.0)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_chunked_forward_through_the_pool_matches_recompute(
        model: TinyHybrid, pool: PagedPool, reference: torch.Tensor, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, len(PROMPT)), label="prompt tokens")
    cuts = data.draw(st.sets(st.integers(1, n - 1), max_size=5) if n > 1 else st.just(set()),
                     label="chunk bounds")
    scratch = iter(SCRATCH)
    mla = [take(scratch, slots(len(PROMPT)))]
    outputs, snapshots = prefill(model, pool, PROMPT[:n], [0, *sorted(cuts), n], mla,
                                 take(scratch, 3), scratch)
    assert outputs_match(outputs, reference[:n])  # different spans: equal to ~1e-6, not the bit
    for at, pages in snapshots.items():  # each checkpoint resumes the prompt at its boundary
        state = take(scratch, 3)
        restore(pool, pages, state)
        stop = min(at + 5, len(PROMPT))
        [out] = model.forward(pool, [ChunkRequest(PROMPT, at, stop, mla, state)])
        assert outputs_match(out, reference[at:stop]), f"checkpoint at {at}"


def per_token_kda(model: TinyHybrid, hidden: torch.Tensor, state: KdaState,
                  split: int) -> tuple[torch.Tensor, KdaState, KdaState]:
    """The short convolution and the gated delta rule token by token, in float64: the definition
    `ops.kda_span` computes in blocks. Returns (hidden out, final state, state after `split`
    tokens). KDA decays per key channel, GDN per head (one gate per head, broadcast over K), and
    GDN's value heads read their group's key head."""
    dims, w = model.dims, model.weights.kda[0][0]
    heads, keys, k_dim, v_dim = dims.kda_heads, dims.key_heads, dims.kda_k, dims.kda_v
    gates = dims.gate_width // heads
    x = torch.nn.functional.rms_norm(hidden.double(), (dims.d_model,), w.norm.double(), 1e-6)
    qkv, gate, strength = (x @ w.w_in.double()).split(
        (dims.conv_channels, heads * gates, heads), dim=-1)
    decay = torch.sigmoid(gate.view(-1, heads, gates, 1) + w.a_bias.double())
    beta = torch.sigmoid(strength)
    rows, s, reads, snapshot = state.conv.double(), state.recurrent.double(), [], None
    for t in range(hidden.shape[0]):
        window = torch.cat((rows, qkv[t].unsqueeze(1)), dim=1)  # [C, kernel], oldest first
        mixed = torch.nn.functional.silu((window * w.conv.double()).sum(dim=1))
        rows = window[:, 1:]
        qk, v = mixed.split((2 * keys * k_dim, heads * v_dim))
        qk = torch.nn.functional.normalize(qk.view(2, keys, k_dim), dim=-1)
        q, k = qk.repeat_interleave(heads // keys, dim=1).unbind(0)
        s = s * decay[t]
        error = v.view(heads, v_dim) - torch.einsum("hk,hkv->hv", k, s)
        s = s + beta[t].view(heads, 1, 1) * k.unsqueeze(-1) * error.unsqueeze(1)
        reads.append(torch.einsum("hk,hkv->hv", q, s).reshape(-1))
        snapshot = KdaState(rows, s) if t + 1 == split else snapshot
    return hidden.double() + torch.stack(reads) @ w.wo.double(), KdaState(rows, s), snapshot


@pytest.mark.parametrize("split_at", ["inside", "straddling"])
@pytest.mark.parametrize("block, max_log_decay", [(64, 60.0), (7, 60.0), (64, 0.3)],
                         ids=["one-block", "many-blocks", "halved-blocks"])
@pytest.mark.parametrize("steps", [1, 24, 90])
def test_the_blockwise_kda_is_the_token_by_token_recurrence(
        model: TinyHybrid, monkeypatch: pytest.MonkeyPatch, block: int, max_log_decay: float,
        steps: int, split_at: str) -> None:
    """Also when the snapshot falls fewer than `kernel - 1` tokens into the span: its conv rows
    then straddle the span's start (some come from the state the span started from)."""
    monkeypatch.setattr(ops, "KDA_BLOCK", block)
    monkeypatch.setattr(ops, "MAX_BLOCK_LOG_DECAY", max_log_decay)
    gen = torch.Generator().manual_seed(steps)
    dims = model.dims
    hidden = torch.randn(steps, dims.d_model, generator=gen)
    state = KdaState(torch.randn(dims.conv_channels, dims.conv_kernel - 1, generator=gen),
                     0.3 * torch.randn(dims.kda_heads, dims.kda_k, dims.kda_v, generator=gen))
    split = steps // 3 + 1 if split_at == "inside" else min(steps, dims.conv_kernel - 2)
    out, final, snapshot = ops.kda_span(model.weights.kda[0][0], dims, hidden, state, split)
    expected_out, expected_final, expected_snapshot = per_token_kda(model, hidden, state, split)
    pairs = [(out, expected_out), (final.conv, expected_final.conv),
             (final.recurrent, expected_final.recurrent), (snapshot.conv, expected_snapshot.conv),
             (snapshot.recurrent, expected_snapshot.recurrent)]
    for actual, wanted in pairs:
        assert torch.allclose(actual.double(), wanted, rtol=1e-5, atol=1e-5)


def test_a_snapshot_inside_a_chunk_keeps_the_conv_rows_across_the_chunk_boundary(
        model: TinyHybrid, rank_pools: RankPools, reference: torch.Tensor) -> None:
    """A chunk [30, 33) snapshots at 32: the snapshot's conv rows are the inputs at 29, 30, 31,
    and the one at 29 comes from the state the chunk started from."""
    [pool] = rank_pools(1, 10)
    outputs, snapshots = prefill(model, pool, PROMPT[:33], [0, 30, 33], [[0]], [1, 2, 3],
                                 iter(range(4, 10)))
    assert outputs_match(outputs, reference[:33]) and list(snapshots) == [16, 32]
    for slot in range(model.dims.blocks):  # the conv inputs at 29..31 of slot `slot` of group 0
        layer = model.weights.kda[0][slot]
        inputs = ops.rms_norm(hidden_before(model, slot), layer.norm) @ layer.w_in
        rows = inputs[29:32, :model.dims.conv_channels].T
        assert torch.allclose(pool.conv_view(snapshots[32][0])[slot], rows, rtol=1e-5, atol=1e-5)
    restore(pool, snapshots[32], [1, 2, 3])
    [out] = model.forward(pool, [ChunkRequest(PROMPT, 32, 40, [[0]], [1, 2, 3])])
    assert outputs_match(out, reference[32:40])


def hidden_before(model: TinyHybrid, slot: int) -> torch.Tensor:
    """The input of KDA group 0's layer `slot` over PROMPT[:32], computed cold."""
    dims, w = model.dims, model.weights
    hidden = w.embed[torch.from_numpy(PROMPT[:32].astype(np.int64) % dims.vocab)]
    for block in range(slot + 1):
        if block == slot:
            return hidden
        for group in range(dims.kda_groups):
            hidden, _, _ = ops.kda_span(w.kda[group][block], dims, hidden, KdaState.zeros(dims))
        for group in range(dims.mla_groups):
            rows = ops.attention_rows(w.mla[group][block], dims, hidden, 0)
            hidden = ops.attention_span(w.mla[group][block], dims, hidden, 0, rows)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("at", [32, 64, 96, 128, 144])
def test_every_checkpoint_resumes_the_prompt_at_its_boundary(
        model: TinyHybrid, pool: PagedPool, page_ids: Iterator[int], prefilled: Prefilled,
        reference: torch.Tensor, at: int) -> None:
    state = take(page_ids, 3)
    restore(pool, prefilled.snapshots[at], state)
    [out] = model.forward(pool, [ChunkRequest(PROMPT, at, at + 6, prefilled.mla, state)])
    assert outputs_match(out, reference[at:at + 6])


@pytest.mark.parametrize("hit", [64, 96], ids=["page-aligned", "mid-page"])
def test_resuming_another_request_from_a_hit_matches_its_recompute(
        model: TinyHybrid, pool: PagedPool, page_ids: Iterator[int], prefilled: Prefilled,
        hit: int) -> None:
    tokens = np.concatenate([PROMPT[:hit], np.arange(1_000, 1_130 - hit, dtype=np.uint64)])
    other = np.arange(5_000, 5_000 + len(tokens) - hit, dtype=np.uint64)
    other_reference = model.recompute(other)
    table, state = resume(pool, prefilled, page_ids, hit)
    other_table, other_state = [take(page_ids, slots(len(other)))], take(page_ids, 3)
    shared_before = pool.buffer[:, prefilled.mla[0][:hit // PAGE]].clone()
    outputs: list[torch.Tensor] = []
    for start, stop in itertools.pairwise([hit, hit + 7, hit + 30, len(tokens)]):
        cold = ChunkRequest(other, start - hit, stop - hit, other_table, other_state)
        b, c = model.forward(pool, [ChunkRequest(tokens, start, stop, [table], state), cold])
        outputs.append(b)
        assert outputs_match(c, other_reference[start - hit:stop - hit])
    assert outputs_match(torch.cat(outputs), model.recompute(tokens)[hit:])
    assert torch.equal(pool.buffer[:, prefilled.mla[0][:hit // PAGE]], shared_before)


@pytest.mark.parametrize("group, slot, head, within", [
    (0, 0, 0, None), (2, 1, 3, ByteRange(4 * 37, 4)), (1, 1, 2, ByteRange(512, 64)),
], ids=["whole-head", "one-float", "64-bytes"])
def test_a_corrupt_checkpoint_byte_range_changes_the_outputs(
        model: TinyHybrid, pool: PagedPool, page_ids: Iterator[int], prefilled: Prefilled,
        reference: torch.Tensor, group: int, slot: int, head: int,
        within: ByteRange | None) -> None:
    checkpoint = take(page_ids, 3)
    restore(pool, prefilled.snapshots[96], checkpoint)  # a copy: A's checkpoint stays intact
    head_range = pool.layout.kda_head_range(head)
    corrupt(pool, checkpoint[group], slot, head_range if within is None
            else ByteRange(head_range.offset + within.offset, within.size))
    state = take(page_ids, 3)
    restore(pool, checkpoint, state)
    [out] = model.forward(pool, [ChunkRequest(PROMPT, 96, 110, prefilled.mla, state)])
    assert not outputs_match(out, reference[96:110])


@pytest.mark.parametrize("group, slot, head, part, channel", [
    (0, 0, 0, 0, 0), (1, 1, 3, 1, 15), (2, 0, 2, 2, 7),
], ids=["q-row", "k-row", "v-row"])
def test_corrupt_conv_rows_alone_change_the_outputs(
        model: TinyHybrid, pool: PagedPool, page_ids: Iterator[int], prefilled: Prefilled,
        reference: torch.Tensor, group: int, slot: int, head: int, part: int,
        channel: int) -> None:
    """One conv channel's rows of one head in one layer, the recurrent part left intact: a
    checkpoint that restored only the recurrent matrix would pass this test."""
    checkpoint = take(page_ids, 3)
    restore(pool, prefilled.snapshots[96], checkpoint)
    group_size = model.dims.kda_heads // model.dims.key_heads  # GDN: heads sharing a key head
    first = head - head % group_size
    _, local = pool.layout.conv_rows(range(first, first + group_size))[part]
    rows = pool.layout.conv_range(local[channel:channel + 1])
    assert rows.end <= pool.layout.recurrent_offset
    corrupt(pool, checkpoint[group], slot, rows)
    state = take(page_ids, 3)
    restore(pool, checkpoint, state)
    [out] = model.forward(pool, [ChunkRequest(PROMPT, 96, 110, prefilled.mla, state)])
    assert not outputs_match(out, reference[96:110])


def test_a_corrupt_mla_row_changes_the_outputs(model: TinyHybrid, pool: PagedPool,
                                               page_ids: Iterator[int], prefilled: Prefilled,
                                               reference: torch.Tensor) -> None:
    table, state = resume(pool, prefilled, page_ids, 96)
    private = take(page_ids, 1)[0]
    copy_rows(pool, table[0], private, PAGE)
    corrupt(pool, private, 1, pool.layout.mla_token_range(40, 41))
    [out] = model.forward(pool, [ChunkRequest(PROMPT, 96, 110, [[private, *table[1:]]], state)])
    assert not outputs_match(out, reference[96:110])


def test_type_confused_pages_give_different_outputs(model: TinyHybrid, pool: PagedPool,
                                                    page_ids: Iterator[int], prefilled: Prefilled,
                                                    reference: torch.Tensor) -> None:
    table, state = resume(pool, prefilled, page_ids, 96)
    ok = ChunkRequest(PROMPT, 96, 110, [table], state)
    assert outputs_match(model.forward(pool, [ok])[0], reference[96:110])
    kda_as_mla = take(page_ids, 1)[0]
    restore(pool, prefilled.snapshots[96][:1], [kda_as_mla])
    confused = dataclasses.replace(ok, mla_pages=[[kda_as_mla, *table[1:]]])
    assert not outputs_match(model.forward(pool, [confused])[0], reference[96:110])
    mla_as_kda = take(page_ids, 1)[0]
    copy_rows(pool, table[0], mla_as_kda, PAGE)
    restore(pool, prefilled.snapshots[96], state)
    confused = dataclasses.replace(ok, state_pages=[mla_as_kda, *state[1:]])
    assert not outputs_match(model.forward(pool, [confused])[0], reference[96:110])


def test_a_debug_pool_refuses_a_type_confused_page(model: TinyHybrid, config: Config) -> None:
    cache = dataclasses.replace(config.cache, num_pages=8)
    with PagedPool.create(config.model, cache, debug=True) as pool:
        for page, kind in [(0, PageKind.MLA), *((p, PageKind.KDA) for p in range(1, 4))]:
            pool.tag(page, kind)
        [out] = model.forward(pool, [ChunkRequest(PROMPT, 0, 20, [[0]], [1, 2, 3])])
        assert outputs_match(out, model.recompute(PROMPT[:20]))
        with pytest.raises(PageKindError):
            model.forward(pool, [ChunkRequest(PROMPT, 20, 30, [[1]], [1, 2, 3])])
        with pytest.raises(PageKindError):
            model.forward(pool, [ChunkRequest(PROMPT, 20, 30, [[0]], [0, 2, 3])])


def test_the_model_sizes_are_the_pool_layout(model: TinyHybrid, pool: PagedPool) -> None:
    model.check_pool(pool)
    layout, dims = pool.layout, model.dims
    row = 64 if dims.attention_kind == "mla" else 2 * 2 * 8 * 4  # latent; K and V of 2 heads
    assert layout.mla_token_range(0, 1).size == dims.attn_units * dims.attn_unit_elems * 4 == row
    assert layout.kda_head_range(0).size == dims.kda_k * dims.kda_v * 4 == 1024
    assert layout.layer_slots == dims.blocks and layout.rank_heads(0) == range(dims.kda_heads)


@pytest.mark.parametrize("change, message", [
    ({"mla_dtype": "bfloat16"}, "mla_dtype='bfloat16'"),
    ({"kda_state_dtype": "bfloat16"}, "kda_state_dtype='bfloat16'"),
    ({"conv_dtype": "bfloat16"}, "conv_dtype='bfloat16'"),
    ({"mla_latent_dim": 4}, "no latent beside rope_dim=4"),
    ({"attention_kind": "gqa", "mla_latent_dim": 0, "gqa_kv_heads": 2, "gqa_head_dim": 3},
     "gqa_head_dim=3 must be even"),
])
def test_a_spec_the_model_cannot_serve_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        TinyHybrid(dataclasses.replace(TINY.model, **change))


def test_a_pool_laid_out_for_another_model_is_refused() -> None:
    model = TinyHybrid(TINY.model)
    other = dataclasses.replace(TINY.model, mla_latent_dim=32, kda_heads=2)
    mismatch = "KDA heads: model 4, pool 2.*attention unit bytes: model 64, pool 128"
    with (PagedPool.create(other, dataclasses.replace(TINY.cache, num_pages=4)) as pool,
          pytest.raises(PoolMismatch, match=mismatch)):
        model.forward(pool, [ChunkRequest(PROMPT, 0, 4, [[0]], [1, 2, 3])])


@pytest.mark.parametrize("request_, message", [
    (ChunkRequest(PROMPT, 0, 0, [[0]], [1, 2, 3]), "empty"),
    (ChunkRequest(PROMPT, 0, 151, [[0, 4, 5]], [1, 2, 3]), "outside a 150-token prompt"),
    (ChunkRequest(PROMPT, 60, 70, [[0]], [1, 2, 3]), "need 2"),
    (ChunkRequest(PROMPT, 0, 10, [[0]], [1, 2]), "2 pages, the model has 3"),
    (ChunkRequest(PROMPT, 16, 40, [[0]], [1, 2, 3], 16, [4, 5, 6]), r"outside \(16, 40\]"),
    (ChunkRequest(PROMPT, 0, 40, [[0]], [1, 2, 3], 32, [3, 4, 5]), "overlap"),
], ids=["empty", "past-prompt", "missing-slot", "state-groups", "snapshot-at-start", "overlap"])
def test_an_inconsistent_chunk_is_refused(model: TinyHybrid, pool: PagedPool,
                                          request_: ChunkRequest, message: str) -> None:
    with pytest.raises(ChunkError, match=message):
        model.forward(pool, [request_])


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_pool_on_any_device_serves_the_cpu_model(model: TinyHybrid, config: Config,
                                                   reference: torch.Tensor, device: str) -> None:
    cache = dataclasses.replace(config.cache, num_pages=11)
    with PagedPool.create(config.model, cache, device) as pool:
        outputs, snapshots = prefill(model, pool, PROMPT[:80], [0, 23, 80], [[0, 1]], [2, 3, 4],
                                     iter(range(5, 11)))
        assert outputs_match(outputs, reference[:80])
        [out] = model.forward(pool, [ChunkRequest(PROMPT, 80, 90, [[0, 1]], [2, 3, 4])])
    assert outputs_match(out, reference[80:90]) and list(snapshots) == [16, 80]


def test_a_full_attention_model_runs_from_its_mla_pages_alone(config: Config) -> None:
    spec = dataclasses.replace(config.model, kda_groups=0)
    model = TinyHybrid(spec)
    tokens = PROMPT[:70]
    with PagedPool.create(spec, dataclasses.replace(TINY.cache, num_pages=4)) as pool:
        outputs = [model.forward(pool, [ChunkRequest(tokens, start, stop, [[0, 1]], [])])[0]
                   for start, stop in [(0, 9), (9, 66), (66, 70)]]
    assert outputs_match(torch.cat(outputs), model.recompute(tokens))


def test_a_request_plan_maps_onto_a_chunk() -> None:
    plan = RequestPlan("r", 48, 48, 100, [[7, 8]], [1, 2, 3], [4, 5, 6], 96,
                       [PageCopy(9, 1, 0, 4096)])
    chunk = ChunkRequest.from_plan(plan, PROMPT)
    assert (chunk.start, chunk.stop, chunk.snapshot_tokens) == (48, 100, 96)
    assert (chunk.mla_pages, chunk.state_pages, chunk.snapshot_pages) == ([[7, 8]], [1, 2, 3],
                                                                         [4, 5, 6])
    assert not chunk.fresh_state


def test_the_weights_do_not_depend_on_the_tp_degree(model: TinyHybrid, config: Config,
                                                    reference: torch.Tensor) -> None:
    other = TinyHybrid(dataclasses.replace(config.model, tp_degree=4), seed=1)
    assert other.dims == model.dims
    assert torch.equal(other.weights.kda[2][1].w_in, model.weights.kda[2][1].w_in)
    assert torch.equal(other.recompute(PROMPT), reference)  # the same ops on the same weights


@pytest.mark.parametrize("degree", [2, 4])
def test_a_tensor_parallel_forward_matches_recompute(model: TinyHybrid, reference: torch.Tensor,
                                                     rank_pools: RankPools, degree: int) -> None:
    pools = rank_pools(degree, 18)
    mla = [[0, 1, 2]]
    outputs, snapshots = prefill(model, pools, PROMPT, [0, 40, 70, 150], mla, [3, 4, 5],
                                 iter(range(6, 15)))
    assert outputs_match(outputs, reference) and list(snapshots) == [32, 64, 144]
    state = [15, 16, 17]
    for pool in pools:  # every rank restores its own share of the checkpoint
        restore(pool, snapshots[64], state)
    [out] = model.forward(pools, [ChunkRequest(PROMPT, 64, 80, mla, state)])
    assert outputs_match(out, reference[64:80])


def test_each_rank_pool_holds_exactly_its_heads(model: TinyHybrid,
                                                rank_pools: RankPools) -> None:
    """The same chunks on one TP=1 pool and on two TP=2 pools (full of stale bytes): rank r's KDA
    pages hold the TP=1 bytes of its heads (recurrent matrices and q, k, v conv rows) at its own
    offsets, its full-attention pages the same rows of its units (the MLA latent, or its GQA KV
    head), and no other byte changes."""
    [single], pools = rank_pools(1, 11), rank_pools(2, 11)
    before = [fill_with_garbage(pool, seed=rank) for rank, pool in enumerate(pools)]
    bounds, mla, state = [0, 23, 80], [[0, 1]], [2, 3, 4]
    _, snapshots = prefill(model, single, PROMPT[:80], bounds, mla, state, iter(range(5, 11)))
    prefill(model, pools, PROMPT[:80], bounds, mla, state, iter(range(5, 11)))
    kda_pages = state + [page for pages in snapshots.values() for page in pages]
    mla_tokens = [(0, PAGE), (1, 80 - PAGE)]
    group = model.dims.kda_heads // model.dims.key_heads  # value heads reading one key head
    unit = single.layout.model.attn_head_bytes
    for rank, pool in enumerate(pools):
        expected = before[rank].view(-1).clone()
        layout = pool.layout
        for slot in range(layout.layer_slots):
            for page, head in itertools.product(kda_pages, layout.rank_heads(rank)):
                put(expected, pool, single, page, slot, layout.kda_head_range(head, rank),
                    single.layout.kda_head_range(head))
            for page, first in itertools.product(kda_pages, layout.rank_heads(rank)[::group]):
                for ours, theirs in layout.conv_rows(range(first, first + group), rank):
                    put(expected, pool, single, page, slot, layout.conv_range(theirs),
                        single.layout.conv_range(ours))
            units = layout.rank_attn_heads(rank)
            for (page, tokens), token in itertools.product(mla_tokens, range(PAGE)):
                if token < tokens:
                    at = layout.mla_token_range(token, token + 1).offset
                    within = single.layout.mla_token_range(token, token + 1).offset
                    put(expected, pool, single, page, slot, ByteRange(at, len(units) * unit),
                        ByteRange(within + units.start * unit, len(units) * unit))
        assert torch.equal(pool.buffer.view(-1), expected), f"rank {rank}"


def put(expected: torch.Tensor, pool: PagedPool, source: PagedPool, page: int, slot: int,
        at: ByteRange, within: ByteRange) -> None:
    """Write `within` (a range of one slot of `source`'s page) into `expected`, a flat buffer laid
    out as `pool`, at `at` in the same page and slot."""
    where = pool.layout.buffer_range(page, slot, at)
    what = source.layout.buffer_range(page, slot, within)
    expected[where.offset:where.end] = source.buffer.view(-1)[what.offset:what.end]


def fill_with_garbage(pool: PagedPool, seed: int) -> torch.Tensor:
    data = torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    pool.buffer.copy_(data)
    return data


@pytest.mark.parametrize("ranks, message", [
    (lambda new: new(2, 4)[:1], "1 pools given for a layout of tp_degree=2"),
    (lambda new: new(1, 4) + new(1, 4), "2 pools given for a layout of tp_degree=1"),
    (lambda new: new(2, 4)[:1] + new(2, 5)[1:], r"ranks \[1\] are laid out for another model"),
    (lambda new: new(2, 4)[:1] * 2, "one pool is given for two ranks"),
    (lambda new: [], "no pool given"),
], ids=["too-few", "too-many", "other-cache", "same-pool-twice", "none"])
def test_pools_that_are_not_the_ranks_of_one_layout_are_refused(
        model: TinyHybrid, rank_pools: RankPools,
        ranks: Callable[[RankPools], list[PagedPool]], message: str) -> None:
    with pytest.raises(PoolMismatch, match=message):
        model.forward(ranks(rank_pools), [ChunkRequest(PROMPT, 0, 4, [[0]], [1, 2, 3])])
