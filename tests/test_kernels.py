"""Kernels against their references and a naive oracle, on every backend this machine can run.

Targets: the torch fallback (CPU), the Triton interpreter (CPU, `TRITON_INTERPRET=1` set for the test
only: launchers jit lazily, so the same process runs it) and compiled Triton on CUDA (marker `gpu`).
Each test asserts which backend actually ran. Interpreter cases stay small: it moves tens of MB/s.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kernels import page_copy
from kernels._launch import LazyJit, _buffers, block_rule, buffer, word_width
from kernels.page_copy_ref import CHUNK_BYTES, LOOP_MIN_BYTES, page_copy_naive, page_copy_ref


@dataclass(frozen=True)
class Target:
    device: str
    backend: str


TARGETS = [
    pytest.param(("cpu", False), id="torch-cpu"),
    pytest.param(("cpu", True), id="triton-interpreter"),
    pytest.param(("cuda", False), id="triton-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    device, interpret = request.param
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield Target(device, "torch" if device == "cpu" and not interpret else "triton")


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A uint8 buffer holding random values of `dtype` (bf16/fp32 bit patterns, not just bytes)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape[:-1] + (shape[-1] // dtype.itemsize,), generator=g).to(dtype)
    return values.view(torch.uint8)


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

COPY_CASES = {
    "restore-full-pages": ((2, 16, 4096), [(0, 8, 0, 4096), (3, 9, 0, 4096), (5, 10, 0, 4096)]),
    "cow-prefix-ends-inside-page": ((2, 16, 4096), [(1, 12, 0, 48 * 64), (2, 13, 0, 16 * 64)]),
    "odd-offsets-odd-counts": ((3, 9, 1012), [(0, 4, 3, 1001), (1, 5, 1011, 1), (2, 6, 7, 13)]),
    "zero-count-rows": ((2, 8, 256), [(0, 4, 0, 0), (1, 5, 16, 64), (2, 6, 256, 0)]),
    "many-pairs": ((2, 300, 64), [(i, 150 + i, i % 7, 64 - i % 7) for i in range(150)]),
    "same-range-groups": ((2, 40, 512), [(i, 20 + i, 64 * (i % 3), 128) for i in range(20)]),
    # 20 ranges of 16 KiB: more than one CHUNK_BYTES step of the CPU gather, the last one partial
    "gather-in-steps": ((2, 24, 16384), [(i, 23 - i, 0, 16384) for i in range(10)]),
    "pages-in-any-order": ((1, 12, 128), [(11, 0, 8, 64), (3, 7, 8, 64), (3, 9, 8, 64)]),
    # a scheduler step's mix: whole pages, prefixes of 1-3 blocks, a range that starts mid-page
    "mixed-pages-and-prefixes": ((2, 16, 4096), [(0, 8, 0, 4096), (1, 9, 0, 1024),
                                                 (2, 10, 0, 3072), (3, 11, 1024, 2048)]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(COPY_CASES))
def test_page_copy_matches_reference(target: Target, case: str, dtype: torch.dtype) -> None:
    shape, rows = COPY_CASES[case]
    buf = filled(shape, dtype, seed=1).to(target.device)
    expected = buf.cpu().clone()
    page_copy_naive(expected.clone(), expected, rows)
    assert page_copy(buf, buf, rows) == target.backend
    assert torch.equal(buf.cpu(), expected)
    ref = filled(shape, dtype, seed=1)
    page_copy_ref(ref, ref, torch.tensor(rows))
    assert torch.equal(ref, expected)


def test_page_copy_between_buffers_of_different_geometry(target: Target) -> None:
    src = filled((2, 5, 4096), torch.bfloat16, seed=2).to(target.device)
    dst = torch.zeros(2, 7, 2048, dtype=torch.uint8, device=target.device)
    rows = [(4, 0, 0, 2048), (0, 6, 512, 1000)]
    assert page_copy(src, dst, rows) == target.backend
    expected = torch.zeros(2, 7, 2048, dtype=torch.uint8)
    page_copy_naive(src.cpu(), expected, rows)
    assert torch.equal(dst.cpu(), expected)


@pytest.mark.parametrize("batch", [[], torch.empty(0, 4, dtype=torch.int64)], ids=["list", "tensor"])
def test_empty_batch_is_a_noop(target: Target, batch: Any) -> None:
    buf = filled((2, 4, 64), torch.float32, seed=3).to(target.device)
    before = buf.clone()
    assert page_copy(buf, buf, batch) == target.backend
    assert torch.equal(buf, before)


def test_gather_in_steps_case_spans_several_steps() -> None:
    shape, rows = COPY_CASES["gather-in-steps"]
    assert shape[0] * len(rows) * rows[0][3] > CHUNK_BYTES


def test_large_ranges_take_the_per_pair_path_and_match() -> None:
    rows = [(0, 2, 8, LOOP_MIN_BYTES), (1, 3, 0, LOOP_MIN_BYTES + 8)]
    buf = filled((2, 4, LOOP_MIN_BYTES + 64), torch.float32, seed=4)
    expected = buf.clone()
    page_copy_naive(buf.clone(), expected, rows)
    page_copy_ref(buf, buf, torch.tensor(rows))
    assert torch.equal(buf, expected)


def test_page_copy_on_buffers_whose_slot_stride_is_not_a_page_multiple(target: Target) -> None:
    """Slots 5.5 pages apart in a bigger allocation: ranges are still found by (slot, page),
    whatever the strides share, and no byte outside the copied ranges changes."""
    storage = filled((1, 1, 3 * 5632), torch.float32, seed=8).view(-1).to(target.device)
    buf = storage.as_strided((3, 4, 1024), (5632, 1024, 1))
    rows = [(0, 3, 0, 1024), (1, 2, 512, 256)]
    expected = storage.cpu().clone()
    expected_view = expected.as_strided(buf.shape, buf.stride())
    page_copy_naive(expected_view.clone(), expected_view, rows)
    assert page_copy(buf, buf, rows) == target.backend
    assert torch.equal(storage.cpu(), expected)


def test_batch_forms_are_all_accepted(target: Target) -> None:
    """Lists, int32 tensors, numpy arrays and non-contiguous views of a bigger tensor."""
    rows = [(0, 4, 0, 64), (1, 5, 64, 32)]
    wide = torch.tensor([[r[0], -1, r[1], -1, r[2], -1, r[3], -1] for r in rows])[:, ::2]
    assert not wide.is_contiguous()
    for form in (rows, torch.tensor(rows, dtype=torch.int32), np.array(rows), wide):
        buf = filled((2, 8, 128), torch.float32, seed=9).to(target.device)
        expected = buf.cpu().clone()
        page_copy_naive(expected.clone(), expected, rows)
        assert page_copy(buf, buf, form) == target.backend
        assert torch.equal(buf.cpu(), expected)


def test_buffer_facts_are_cached_per_tensor_and_dropped_with_it() -> None:
    t = torch.zeros(2, 4, 64, dtype=torch.uint8)
    first = buffer(t)
    assert buffer(t) is first and id(t) in _buffers
    t.set_(torch.zeros(2, 8, 32, dtype=torch.uint8))  # same object, new memory and shape
    assert buffer(t) is not first and buffer(t).pages == 8
    buffer(t).words(8, 1, 2), buffer(t).records(8, 16)  # cached views must not keep `t` alive
    key = id(t)
    del t
    gc.collect()
    assert key not in _buffers


BAD_BATCHES = {
    "src-page-past-end": ([(4, 1, 0, 8)], r"src_page out of range \[0, 4\): \[4\]"),
    "negative-dst-page": ([(0, -1, 0, 8)], r"dst_page out of range \[0, 4\): \[-1\]"),
    "range-past-page-end": ([(0, 1, 60, 8)], r"outside a 64-byte page: \[\[0, 1, 60, 8\]\]"),
    "offset-past-page-end": ([(0, 1, 65, 0)], "outside a 64-byte page"),
    "negative-offset": ([(0, 1, -1, 8)], "outside"),
    "negative-count": ([(0, 1, 0, -8)], "outside"),
    "one-bad-range-among-good": ([(0, 1, 0, 8), (2, 3, 9, 56), (0, 3, 0, 8)],
                                 r"outside a 64-byte page: \[\[2, 3, 9, 56\]\]"),
    "dst-page-is-a-src-page": ([(0, 1, 0, 8), (1, 2, 0, 8)], r"pages \[1\] are destination pages"),
    "wrong-columns": ([(0, 1, 0)], r"shape \[n, 4\]"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_page_copy_rejects_bad_batches(case: str) -> None:
    rows, message = BAD_BATCHES[case]
    buf = torch.zeros(2, 4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        page_copy(buf, buf, rows)


@pytest.mark.parametrize("src, dst, message", [
    (torch.zeros(2, 4, 16), torch.zeros(2, 4, 64, dtype=torch.uint8), "uint8"),
    (torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 4, 64, dtype=torch.uint8),
     "slots, pages, bytes"),
    (torch.zeros(3, 4, 64, dtype=torch.uint8), torch.zeros(2, 4, 64, dtype=torch.uint8), "layer slots"),
], ids=["float-buffer", "2d-buffer", "slot-mismatch"])
def test_page_copy_rejects_bad_buffers(src: torch.Tensor, dst: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        page_copy(src, dst, [(0, 1, 0, 8)])


def test_fallback_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("kernels._launch._fell_back", set())
    buf = torch.zeros(1, 4, 16, dtype=torch.uint8)
    with caplog.at_level(logging.INFO, logger="kernels"):
        page_copy(buf, buf, [(0, 1, 0, 16)])
        page_copy(buf, buf, [(2, 3, 0, 16)])
    assert [r.message for r in caplog.records if "page_copy" in r.message] == [
        "page_copy: tensors on cpu and TRITON_INTERPRET!=1, using the torch reference"]


def test_interpreter_really_is_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(LazyJit(page_copy_naive).kernel(), InterpretedFunction)


@pytest.mark.parametrize("quantities, width", [
    ((0, 4096), 8), ((4, 4096), 4), ((2, 6), 2), ((3, 4096), 1),
], ids=["aligned", "int32", "int16", "odd"])
def test_word_width_is_the_widest_common_divisor(quantities: tuple[int, ...], width: int) -> None:
    assert word_width((buffer(torch.zeros(2, 4, 4096, dtype=torch.uint8)).align, *quantities)) == width


def test_word_width_sees_a_misaligned_buffer() -> None:
    shifted = torch.zeros(2 * 4 * 4096 + 2, dtype=torch.uint8)[2:].view(2, 4, 4096)
    assert word_width((buffer(shifted).align, 0, 4096)) == 2


@pytest.mark.parametrize("max_bytes, width, expected", [
    (1, 1, (1, 1)), (1000, 8, (128, 1)), (4096, 8, (512, 2)), (3 << 20, 8, (2048, 8)),
    (3 << 20, 1, (16384, 8)),
], ids=["one-byte", "odd-kb", "page", "kimi-head-range", "bytes"])
def test_block_rule(max_bytes: int, width: int, expected: tuple[int, int]) -> None:
    assert block_rule(max_bytes, width) == expected


def test_page_copy_compiles_for_hopper_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter skips Triton's type checks and codegen: compile to sm_90 here (bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.page_copy import _KERNEL

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _KERNEL.kernel()
    signature = {name: "*i64" if name.endswith("_ptr") else "i64" for name in fn.arg_names}
    signature["BLOCK"] = "constexpr"
    compiled = triton.compile(ASTSource(fn, signature, {"BLOCK": 2048}),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "enable_fp_fusion": False})
    assert "ld.global" in compiled.asm["ptx"] and compiled.asm["cubin"]


def test_restore_bench_reports_both_baselines(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachetier.bench.restore import Case, measure

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = measure(Case("cow-tiny", "tiny", "cow", 4, None), torch.device("cpu"), reps=1)
    assert result["name"] == "cow-tiny" and result["backend"] == "torch"
    assert result["bytes"] == 4 * 2 * 16 * 64  # 4 pairs x 2 slots x 16 tokens of 64 bytes
    for key in ("ours_gbps", "torch_copy_gbps", "memcpy_gbps"):
        assert result[key] > 0
    for ratio, baseline in (("ratio", "torch_copy_gbps"), ("memcpy_ratio", "memcpy_gbps")):
        assert result[ratio] == pytest.approx(result["ours_gbps"] / result[baseline], rel=0.02,
                                              abs=0.005)  # all rounded to 3 decimals
