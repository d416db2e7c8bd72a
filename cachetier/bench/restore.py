"""`cachetier bench restore`: bandwidth of batched page copies next to torch's own copy.

Two operations the data plane runs before every forward pass that hit the cache:
- restore: copy each hit request's checkpoint (one KDA page per KDA group) into its private pages;
- cow: copy the matched prefix of a partially matched MLA page into a private page (the seed's
  2,560 of 6,144 tokens, scaled to the page size).
Each case is one `page_copy` batch over a real `PagedPool` (pages in random order, as a free list
gives them), timed in the same run, repetition by repetition, against two uses of `Tensor.copy_`:

- `torch_copy_gbps` (the denominator of `ratio`): `copy_` of the same bytes, between the same pages
  of the same pool, with the fewest `copy_` calls that byte layout allows: one per pair, since a
  pair's range over all layer slots is one strided view. The views are built before timing, so only
  the copies count. This is what torch does with the batch's own bytes.
- `memcpy_gbps`: one `copy_` of the same number of bytes between two preallocated contiguous
  buffers: an upper bound that no batch of scattered pages reaches (`memcpy_ratio` = ours / it).
  It is the device's copy bandwidth, the figure a GPU run compares batches of 64 MiB or more with.

Tiny cases move 100 KB - 6 MB, so they stay cache-resident for every contender, and are timed as
loops of calls (`calls` per repetition); the `-step` cases restore many requests in one batch, as a
scheduler step would. On CPU, kimi-k3 pages keep their per-rank size but only a few of the 23 layer
slots, to bound memory, and torch runs on one thread unless `--threads` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cachetier.config import PRESETS, CacheSpec, ModelSpec
from gpu_pool import PagedPool
from kernels import page_copy

SEED_PREFIX = 2560 / 6144  # the seed's hit: 2,560 tokens of a 6,144-token page
REP_SECONDS = 0.05  # each contender's turn in a repetition lasts this long at least


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    op: str  # "restore", "cow" (the seed's prefix everywhere) or "cow-mixed" (1 to all-but-one blocks)
    requests: int
    layer_slots: int | None  # None: all of the preset's


def cases(device: torch.device, quick: bool) -> list[Case]:
    """Tiny pages (overhead-bound) and kimi-k3 per-rank pages (bandwidth-bound), sized per device."""
    tiny, step = (16, 64) if quick else (64, 256)
    if device.type == "cuda":
        requests, slots = (2, None) if quick else (8, None)
    else:
        requests, slots = (1, 1) if quick else (2, 2)
    return [
        Case("restore-tiny", "tiny", "restore", tiny, None),
        Case("cow-tiny", "tiny", "cow", tiny, None),
        Case("restore-tiny-step", "tiny", "restore", step, None),
        Case("cow-tiny-step", "tiny", "cow", step, None),
        Case("cow-tiny-mixed", "tiny", "cow-mixed", tiny, None),
        Case("restore-kimi-k3", "kimi-k3", "restore", requests, slots),
        Case("cow-kimi-k3", "kimi-k3", "cow", 2 * requests, slots),
    ]


def specs(case: Case) -> tuple[ModelSpec, CacheSpec, int]:
    """The model, a cache just big enough for the batch, and the pairs in the batch."""
    cfg = PRESETS[case.preset]
    model = cfg.model
    if case.layer_slots is not None:
        model = dataclasses.replace(model, layers_per_group=case.layer_slots)
    pairs = case.requests * (model.kda_groups if case.op == "restore" else 1)
    return model, dataclasses.replace(cfg.cache, num_pages=2 * pairs), pairs


def batch(case: Case, pool: PagedPool, pairs: int) -> torch.Tensor:
    """`pairs` rows over distinct pages in random order, as a real pool's free list would give."""
    layout = pool.layout
    tokens, block = layout.cache.page_tokens, layout.cache.hash_block_tokens
    count: int | torch.Tensor
    if case.op == "restore":
        count = layout.geometry.kda_page_bytes
    elif case.op == "cow":
        count = layout.mla_token_range(0, max(block, int(tokens * SEED_PREFIX) // block * block)).size
    else:  # every request matched its own number of hash blocks of its last page
        blocks = 1 + torch.arange(pairs) % max(1, layout.cache.blocks_per_page - 1)
        count = blocks * layout.mla_token_range(0, block).size
    pages = torch.randperm(layout.num_pages, generator=torch.Generator().manual_seed(0))
    rows = torch.zeros(pairs, 4, dtype=torch.int64)
    rows[:, 0], rows[:, 1], rows[:, 3] = pages[:pairs], pages[pairs:], count
    return rows


def per_pair_copies(buffer: torch.Tensor, rows: torch.Tensor) -> Callable[[], None]:
    """The `torch_copy_gbps` contender: one `copy_` per pair of prebuilt [slots, count] views."""
    views = [(buffer[:, d, o:o + c], buffer[:, s, o:o + c]) for s, d, o, c in rows.tolist()]

    def copy() -> None:
        for dst, src in views:
            dst.copy_(src)
    return copy


def timed(contenders: dict[str, Callable[[], Any]], device: torch.device, reps: int,
          warmup: int = 3) -> tuple[dict[str, float], int]:
    """Median seconds per call of each contender, and the calls per repetition.

    Every repetition runs each contender `calls` times back to back, so all see the same machine
    load; the order rotates between repetitions, so none always runs in the cache (or the idle
    cores) its predecessor left. `calls` makes the slowest contender's turn last `REP_SECONDS`.
    """
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    single = max(_seconds(fn, 1, device) for fn in contenders.values())
    calls = max(1, int(REP_SECONDS / max(single, 1e-9)))
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(_seconds(contenders[name], calls, device) / calls)
    return {name: statistics.median(t) for name, t in times.items()}, calls


def _seconds(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, device: torch.device, reps: int) -> dict[str, Any]:
    model, cache, pairs = specs(case)
    with PagedPool.create(model, cache, device=device) as pool:
        rows = batch(case, pool, pairs)
        buffer = pool.buffer
        buffer[:, rows[:, 0]] = torch.randint(0, 256, (buffer.size(0), pairs, buffer.size(2)),
                                              dtype=torch.uint8, device=device)
        backend = page_copy(buffer, buffer, rows)
        _check_copied(buffer, rows)
        nbytes = int(rows[:, 3].sum()) * pool.layout.layer_slots
        flat_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        seconds, calls = timed({"ours": lambda: page_copy(buffer, buffer, rows),
                                "pairs": per_pair_copies(buffer, rows),
                                "memcpy": lambda: flat_dst.copy_(flat_src)}, device, reps)
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {"name": case.name, "bytes": nbytes, "backend": backend, "pairs": pairs,
            "layer_slots": model.layers_per_group, "calls": calls,
            "ours_gbps": round(gbps["ours"], 3), "torch_copy_gbps": round(gbps["pairs"], 3),
            "ratio": round(gbps["ours"] / gbps["pairs"], 3),
            "memcpy_gbps": round(gbps["memcpy"], 3),
            "memcpy_ratio": round(gbps["ours"] / gbps["memcpy"], 3)}


def _check_copied(buffer: torch.Tensor, rows: torch.Tensor) -> None:
    """The timed batch really copies: the first and last rows' destinations equal their sources."""
    for s, d, o, c in rows[:4].tolist() + rows[-4:].tolist():
        if not torch.equal(buffer[:, d, o:o + c], buffer[:, s, o:o + c]):
            raise RuntimeError(f"page_copy left page {d} different from page {s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own options; `--json` belongs to the caller (the CLI prints `run`'s result)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--quick", action="store_true", help="small batches, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for every contender (default: 1 on CPU, for "
                             "repeatable figures; torch's own setting on CUDA)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    reps = args.reps or (5 if args.quick else 15)
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    return {"device": str(device), "threads": torch.get_num_threads(), "reps": reps,
            "cases": [measure(c, device, reps) for c in cases(device, args.quick)]}


def main() -> None:
    """`python -m cachetier.bench.restore`: the same run without the CLI."""
    parser = argparse.ArgumentParser(prog="python -m cachetier.bench.restore", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one line of JSON instead of indented")
    args = parser.parse_args()
    print(json.dumps(run(args), indent=None if args.json else 2))


if __name__ == "__main__":
    main()
