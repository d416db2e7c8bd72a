"""The connector's copies through the Triton tile-copy kernel against its torch path, which stays the
reference: for random batches of jobs (token ranges starting and ending inside blocks, several
blocks and layers, both directions), vLLM's CPU "vec" layout, the CUDA flash-attention layout, the
MLA latent rows (one layout on every backend) and the GDN states (conv part transposed, recurrent
part as is), in bf16 and fp32, every byte of both buffers must come out equal. The kernel runs in
Triton's interpreter (`TRITON_INTERPRET=1`, set for the test only: launchers jit at launch), so
shapes stay small; on a GPU, `scripts/gpu_check.sh` runs the `gpu`-marked cases compiled (fixed
batches of the same kinds; none has run yet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachetier.config import CacheSpec, ModelSpec
from cachetier.hf_config import NO_LINEAR_STATE
from cachetier.vllm.kv_copy import (AttentionViews, StateViews, TokenRows, engine_attention_views,
                                    engine_state_views, load_rows, load_states, pool_attention_views,
                                    pool_state_views, rows_to_engine, rows_to_pool, save_rows,
                                    save_states, states_to_engine, states_to_pool)
from gpu_pool.layout import PageLayout, torch_dtype
from kernels.tile_copy import _KERNEL as tile_copy_kernel
from kernels.tile_copy import part_row, tile_copy

BLOCKS, PAGES, LAYERS = 9, 9, 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
EXAMPLES = settings(max_examples=25, deadline=None)


@contextmanager
def triton_interpreter(on: bool) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if on:
            patch.setenv("TRITON_INTERPRET", "1")
        else:
            patch.delenv("TRITON_INTERPRET", raising=False)
        yield


def model(attention: torch.dtype = torch.bfloat16, conv: torch.dtype = torch.bfloat16,
          recurrent: torch.dtype = torch.float32) -> ModelSpec:
    """A small Qwen3-Next-like GDN + GQA model: 2 KV heads of 8 dims, 2 value heads sharing one key
    head, states of 8 x 8."""
    return ModelSpec(name="small", linear_kind="gdn", attention_kind="gqa", kda_groups=1,
                     mla_groups=1, layers_per_group=LAYERS, kda_heads=2, kda_key_heads=1,
                     kda_head_k_dim=8, kda_head_v_dim=8, kda_state_dtype=DTYPE_NAMES[recurrent],
                     conv_kernel=4, conv_dtype=DTYPE_NAMES[conv], mla_latent_dim=0,
                     gqa_kv_heads=2, gqa_head_dim=8, mla_dtype=DTYPE_NAMES[attention])


def mla_model(attention: torch.dtype = torch.bfloat16) -> ModelSpec:
    """A small DeepSeek-like full-attention model: one MLA latent of 24 per token, no linear
    state."""
    return ModelSpec(**{**NO_LINEAR_STATE, "name": "small-mla", "attention_kind": "mla",
                        "mla_groups": 1, "layers_per_group": LAYERS, "mla_latent_dim": 24,
                        "mla_dtype": DTYPE_NAMES[attention]})


def random_bytes(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A `dtype` tensor of random bytes below 0x7f: every value finite in any float dtype, so
    no NaN payload can make two correct copies differ."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 0x7f, (*shape[:-1], shape[-1] * size), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype)


View = Callable[[list[torch.Tensor], int], "AttentionViews | StateViews"]


@dataclass
class Side:
    """One side's storage (compared byte for byte) and how its layer `i` is viewed."""

    storage: list[torch.Tensor]
    view: View

    @property
    def views(self) -> list:
        return [self.view(self.storage, i) for i in range(LAYERS)]

    def clone(self) -> Side:
        return Side([t.clone() for t in self.storage], self.view)

    def to(self, device: str) -> Side:
        return Side([t.to(device) for t in self.storage], self.view)


def pool_side(layout: PageLayout, kind: str, seed: int) -> Side:
    views = pool_attention_views if kind == "attention" else pool_state_views
    return Side([random_bytes(layout.buffer_shape, seed)],
                lambda storage, slot: views(storage[0], layout, slot))


def engine_attention(spec: ModelSpec, layout_kind: str, block_tokens: int, seed: int) -> Side:
    heads, dim = spec.attn_heads_per_rank, spec.gqa_head_dim
    shape = {"vec": (BLOCKS, heads, block_tokens, 2 * dim),
             "flash": (2, BLOCKS, block_tokens, heads, dim),
             "mla": (BLOCKS, 1, block_tokens, spec.mla_latent_dim)}[layout_kind]
    return Side([random_bytes(shape, seed + i, torch_dtype(spec.mla_dtype)) for i in range(LAYERS)],
                lambda storage, i: engine_attention_views(storage[i], block_tokens, spec,
                                                          "vec" if layout_kind == "vec" else None))


def engine_states(spec: ModelSpec, page_bytes: int, seed: int) -> Side:
    """GDN layers as vLLM registers them: raw int8 blocks, each state packed at its start and the
    block padded to the page."""
    state = spec.kda_rank_conv_bytes + spec.kda_rank_recurrent_bytes
    return Side([random_bytes((BLOCKS, page_bytes), seed + i).view(torch.int8) for i in range(LAYERS)],
                lambda storage, i: engine_state_views(storage[i].as_strided(
                    (BLOCKS, 1, 1, state), (page_bytes, state, state, 1)), spec))


def assert_same_bytes(a: Side, b: Side) -> None:
    for x, y in zip(a.storage, b.storage, strict=True):
        assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8))


@st.composite
def row_spans(draw: st.DrawFn, block_tokens: int, page_tokens: int) -> list[tuple]:
    """1-3 requests, each `[start, stop)` over up to 3 blocks and pages, starting and ending
    anywhere (an empty range too); no block nor page belongs to two requests, so every
    destination row is written once."""
    blocks = draw(st.permutations(range(BLOCKS)))
    pages = draw(st.permutations(range(PAGES)))
    tokens = 3 * min(block_tokens, page_tokens)
    spans = []
    for r in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, tokens - 1))
        stop = draw(st.integers(start, tokens))
        spans.append((start, stop, blocks[3 * r:3 * r + 3], pages[3 * r:3 * r + 3]))
    return spans


def run_rows(layout_kind: str, dtype: torch.dtype, direction: str, spans: list[tuple],
             block_tokens: int, page_tokens: int, device: str = "cpu") -> None:
    """The torch path on CPU copies, then the dispatcher on `device` (the interpreter on CPU):
    the same bytes on both sides, and Triton ran."""
    spec = mla_model(dtype) if layout_kind == "mla" else model(attention=dtype)
    cache = CacheSpec(hash_block_tokens=4, page_tokens=page_tokens, page_alignment=16,
                      num_pages=PAGES)
    expected_pool = pool_side(PageLayout.from_specs(spec, cache), "attention", seed=1)
    expected_engine = engine_attention(spec, layout_kind, block_tokens, seed=2)
    pool, engine = expected_pool.to(device), expected_engine.to(device)
    rows = TokenRows.of(spans, block_tokens, page_tokens)
    for p, e in zip(expected_pool.views, expected_engine.views):
        if direction == "load":
            rows_to_engine(p, e, rows)
        else:
            rows_to_pool(e, p, rows)
    with triton_interpreter(device == "cpu"):
        backend = (load_rows(pool.views, engine.views, rows) if direction == "load"
                   else save_rows(engine.views, pool.views, rows))
    assert backend == "triton"
    assert_same_bytes(pool, expected_pool)
    assert_same_bytes(engine, expected_engine)


def run_states(dtypes: tuple[torch.dtype, torch.dtype], direction: str, pages: list[int],
               blocks: list[int], device: str = "cpu") -> None:
    conv, recurrent = dtypes
    spec = model(conv=conv, recurrent=recurrent)
    layout = PageLayout.from_specs(spec, CacheSpec(hash_block_tokens=4, page_tokens=8,
                                                   page_alignment=16, num_pages=PAGES))
    expected_pool = pool_side(layout, "state", seed=3)
    expected_engine = engine_states(spec, layout.page_bytes, seed=4)
    pool, engine = expected_pool.to(device), expected_engine.to(device)
    for p, e in zip(expected_pool.views, expected_engine.views):
        if direction == "load":
            states_to_engine(p, e, pages, blocks)
        else:
            states_to_pool(e, p, blocks, pages)
    with triton_interpreter(device == "cpu"):
        backend = (load_states(pool.views, engine.views, pages, blocks) if direction == "load"
                   else save_states(engine.views, pool.views, blocks, pages))
    assert backend == "triton"
    assert_same_bytes(pool, expected_pool)
    assert_same_bytes(engine, expected_engine)


@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout_kind", ["vec", "flash", "mla"],
                         ids=["cpu-vec", "cuda-flash", "mla"])
@EXAMPLES
@given(data=st.data())
def test_token_rows_match_the_torch_path(layout_kind: str, dtype: torch.dtype, direction: str,
                                         data: st.DataObject) -> None:
    block_tokens = data.draw(st.sampled_from([8, 16]), label="block_tokens")
    page_tokens = data.draw(st.sampled_from([8, 16]), label="page_tokens")
    spans = data.draw(row_spans(block_tokens, page_tokens), label="spans")
    run_rows(layout_kind, dtype, direction, spans, block_tokens, page_tokens)


def test_an_mla_row_is_one_token_s_latent_on_both_sides() -> None:
    """The MLA views' meaning, not only their agreement with the kernel: pool page p's row r is
    the latent at offset `r * latent` of the page's attention bytes, and vLLM block b's row r the
    `[b, r]` latent of its `[blocks, block_tokens, latent]` tensor (or `[b, 0, r]` of the
    `[blocks, 1, block_tokens, latent]` one vLLM registers)."""
    spec = mla_model(torch.float32)
    layout = PageLayout.from_specs(spec, CacheSpec(hash_block_tokens=4, page_tokens=8,
                                                   page_alignment=16, num_pages=PAGES))
    buffer = torch.zeros(layout.buffer_shape, dtype=torch.uint8)
    pool = pool_attention_views(buffer, layout, 1)
    latent = torch.arange(24, dtype=torch.float32)
    buffer[1, 5, 3 * 24 * 4:4 * 24 * 4] = latent.view(torch.uint8)  # page 5, row 3, slot 1
    for engine in (torch.zeros(BLOCKS, 8, 24), torch.zeros(BLOCKS, 1, 8, 24)):
        views = engine_attention_views(engine, 8, spec)
        assert views.values is None and len(views.parts) == 1
        rows_to_engine(pool, views, TokenRows.of([(3, 4, [6], [5])], 8, 8))
        assert torch.equal(engine.view(BLOCKS, 8, 24)[6, 3], latent)
        assert engine.count_nonzero() == 23
    with pytest.raises(ValueError, match="MLA KV layout"):
        engine_attention_views(torch.zeros(BLOCKS, 8, 2, 12), 8, spec)


STATE_DTYPES = {"conv-bf16-recurrent-fp32": (torch.bfloat16, torch.float32),
                "fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16)}


@st.composite
def state_pairs(draw: st.DrawFn, direction: str) -> tuple[list[int], list[int]]:
    """(pages, blocks): a load may write one page into several blocks (`state_blocks`), a save
    writes distinct pages; destinations are distinct either way."""
    count = draw(st.integers(0, 4))
    destinations = draw(st.permutations(range(BLOCKS if direction == "load" else PAGES)))[:count]
    sources = draw(st.lists(st.integers(0, (PAGES if direction == "load" else BLOCKS) - 1),
                            min_size=count, max_size=count))
    return (sources, destinations) if direction == "load" else (destinations, sources)


@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize("dtypes", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@EXAMPLES
@given(data=st.data())
def test_states_match_the_torch_path(dtypes: tuple[torch.dtype, torch.dtype], direction: str,
                                     data: st.DataObject) -> None:
    pages, blocks = data.draw(state_pairs(direction), label="pages, blocks")
    run_states(dtypes, direction, pages, blocks)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_SPANS = [(3, 37, [4, 1, 7], [2, 0, 5]), (0, 29, [8, 3, 0], [6, 1, 3]), (16, 16, [2], [4])]
GPU_STATES = {"load": ([2, 2, 5], [3, 8, 0]), "save": ([7, 0], [1, 4])}  # (pages, blocks)


@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout_kind", ["vec", "flash", "mla"],
                         ids=["cpu-vec", "cuda-flash", "mla"])
@pytest.mark.gpu
@needs_cuda
def test_compiled_rows_match_the_torch_path_on_cuda(layout_kind: str, dtype: torch.dtype,
                                                    direction: str) -> None:
    run_rows(layout_kind, dtype, direction, GPU_SPANS, 16, 16, device="cuda")


@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize("dtypes", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.gpu
@needs_cuda
def test_compiled_states_match_the_torch_path_on_cuda(dtypes: tuple[torch.dtype, torch.dtype],
                                                      direction: str) -> None:
    run_states(dtypes, direction, *GPU_STATES[direction], device="cuda")


def test_the_dispatcher_runs_the_torch_path_on_plain_cpu(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Without a GPU and without the interpreter, the torch path (the reference itself) runs, the
    kernel is never built, and the fallback is logged once, as `page_copy`'s is."""
    monkeypatch.setattr(tile_copy_kernel, "_built", {})
    monkeypatch.setattr("kernels._launch._fell_back", set())
    spec = model()
    layout = PageLayout.from_specs(spec, CacheSpec(hash_block_tokens=4, page_tokens=8,
                                                   page_alignment=16, num_pages=PAGES))
    pool, engine = pool_side(layout, "attention", seed=5), engine_attention(spec, "vec", 8, seed=6)
    states, engine_state = pool_side(layout, "state", seed=7), engine_states(spec, layout.page_bytes, 8)
    rows = TokenRows.of([(3, 21, [4, 1, 7], [2, 0, 5])], 8, 8)
    expected, expected_states = engine.clone(), engine_state.clone()
    for p, e in zip(pool.views, expected.views):
        rows_to_engine(p, e, rows)
    for p, e in zip(states.views, expected_states.views):
        states_to_engine(p, e, [2, 2], [3, 8])
    with triton_interpreter(False), caplog.at_level(logging.INFO, logger="kernels"):
        assert load_rows(pool.views, engine.views, rows) == "torch"
        assert load_states(states.views, engine_state.views, [2, 2], [3, 8]) == "torch"
    assert not tile_copy_kernel._built
    assert [r.message for r in caplog.records if "kv_copy" in r.message] == [
        "kv_copy: tensors on cpu and TRITON_INTERPRET!=1, using the torch reference"]
    assert_same_bytes(engine, expected)
    assert_same_bytes(engine_state, expected_states)
    assert not torch.equal(engine.storage[0], engine_attention(spec, "vec", 8, seed=6).storage[0])


def _tile_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(src, dst) storage pairs whose `[i0, i1, A, B]` views need what the connector's small
    shapes never reach: tiles over the 16 KiB block (several programs along A, several
    iterations along B), a transposed fp32 tile, a byte tile whose rows are strided."""
    wide = random_bytes((4, 2, 3, 20000), 9)
    return {
        "wide-byte-rows": (wide, random_bytes((3, 2, 3, 20000), 10)),
        "transposed-fp32": (random_bytes((3, 2, 200, 96), 11, torch.float32),
                            random_bytes((4, 2, 96, 200), 12, torch.float32).transpose(2, 3)),
        "strided-bytes": (random_bytes((5, 3, 7, 33), 13)[..., ::3],
                          random_bytes((2, 4, 7, 11), 14)),
    }


@pytest.mark.parametrize("case", list(_tile_cases()))
def test_tile_copy_moves_what_indexing_moves(case: str) -> None:
    src, dst = _tile_cases()[case]
    jobs = torch.tensor([[0, 1, 1, 0], [2, 0, 0, 1]])
    expected = dst.clone()
    expected[jobs[:, 2], jobs[:, 3]] = src[jobs[:, 0], jobs[:, 1]]
    with triton_interpreter(True):
        assert tile_copy([(src, dst)], jobs) == 1
    assert torch.equal(dst, expected)


def test_a_part_moves_the_widest_word_its_addresses_and_strides_allow() -> None:
    """Flash-attention rows (dims contiguous on both sides) move as int64 words; vLLM's CPU K,
    dim-major, moves element by element; its V, token-major, as words again."""
    spec = model()
    layout = PageLayout.from_specs(spec, CacheSpec(hash_block_tokens=4, page_tokens=8,
                                                   page_alignment=16, num_pages=PAGES))
    pool = pool_side(layout, "attention", seed=1).views[0]
    flash = engine_attention(spec, "flash", 8, seed=2).views[0]
    vec = engine_attention(spec, "vec", 8, seed=2).views[0]
    assert part_row(flash.keys, pool.keys).width == 8
    assert part_row(flash.values, pool.values).row[-1] == 8 * 2 // 8  # 8 bf16 dims in 2 words
    assert part_row(vec.keys, pool.keys).width == 2
    assert part_row(vec.values, pool.values).width == 8


@pytest.mark.parametrize("jobs, message", [
    ([[0, 0, 9, 0]], r"dst_i0 out of range \[0, 9\): \[9\]"),
    ([[-1, 0, 0, 0]], r"src_i0 out of range"),
    ([[0, 8, 0, 0]], r"src_i1 out of range \[0, 8\)"),
], ids=["dst-block", "negative", "row-past-the-block"])
def test_tile_copy_refuses_jobs_outside_the_views(jobs: list[list[int]], message: str) -> None:
    src, dst = random_bytes((9, 8, 2, 8), 1), random_bytes((9, 8, 2, 8), 2)
    with triton_interpreter(True), pytest.raises(ValueError, match=message):
        tile_copy([(src, dst)], jobs)


def test_tile_copy_refuses_parts_of_two_dtypes() -> None:
    src = random_bytes((2, 1, 2, 8), 1, torch.float32)
    with pytest.raises(ValueError, match="tiles into"):
        tile_copy([(src, src.to(torch.bfloat16))], [[0, 0, 1, 0]])


def test_tile_copy_compiles_for_hopper_without_a_gpu() -> None:
    """The interpreter skips Triton's type checks and codegen (the int64-to-pointer casts among
    them): compile to sm_90 here, with the bundled ptxas, for each word width."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with triton_interpreter(False):
        fn = tile_copy_kernel.kernel()
    signature = {"parts_ptr": "*i64", "jobs_ptr": "*i64", "jobs": "i64", "WORD": "constexpr",
                 "BLOCK_R": "constexpr", "BLOCK_B": "constexpr"}
    for word in (tl.int64, tl.int16):
        compiled = triton.compile(ASTSource(fn, signature, {"WORD": word, "BLOCK_R": 16,
                                                            "BLOCK_B": 64}),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "enable_fp_fusion": False})
        assert "ld.global" in compiled.asm["ptx"] and compiled.asm["cubin"]
