"""`cachetier bench restore`: bandwidth of batched page copies next to torch's own copy.

Two operations the data plane runs before every forward pass that hit the cache:
- restore: copy each hit request's checkpoint (one KDA page per KDA group) into its private pages;
- cow: copy the matched prefix of a partially matched MLA page into a private page (the seed's
  2,560 of 6,144 tokens, scaled to the page size).
Each is timed as one `page_copy` batch over a real `PagedPool`, next to `Tensor.copy_` of the same
number of bytes between two preallocated contiguous buffers (the memcpy ceiling); ratio = ours / torch.
On CPU, kimi-k3 pages keep their per-rank size but only a few of the 23 layer slots, to bound memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cachetier.config import PRESETS, CacheSpec, ModelSpec
from gpu_pool import PagedPool
from kernels import page_copy

SEED_PREFIX = 2560 / 6144  # the seed's hit: 2,560 tokens of a 6,144-token page


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    op: str  # "restore" or "cow"
    requests: int
    layer_slots: int | None  # None: all of the preset's


def cases(device: torch.device, quick: bool) -> list[Case]:
    """Tiny pages (overhead-bound) and kimi-k3 per-rank pages (bandwidth-bound), sized per device."""
    tiny = 16 if quick else 64
    if device.type == "cuda":
        requests, slots = (2, None) if quick else (8, None)
    else:
        requests, slots = (1, 1) if quick else (2, 2)
    return [
        Case("restore-tiny", "tiny", "restore", tiny, None),
        Case("cow-tiny", "tiny", "cow", tiny, None),
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
    if case.op == "restore":
        count = layout.geometry.kda_page_bytes
    else:
        tokens = layout.cache.page_tokens
        block = layout.cache.hash_block_tokens
        count = layout.mla_token_range(0, max(block, int(tokens * SEED_PREFIX) // block * block)).size
    pages = torch.randperm(layout.num_pages, generator=torch.Generator().manual_seed(0))
    rows = torch.zeros(pairs, 4, dtype=torch.int64)
    rows[:, 0], rows[:, 1], rows[:, 3] = pages[:pairs], pages[pairs:], count
    return rows


def timed_pair(ours: Callable[[], Any], theirs: Callable[[], Any], device: torch.device,
               reps: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of each, alternating them so both see the same machine load."""
    for _ in range(warmup):
        ours()
        theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, device: torch.device, reps: int) -> dict[str, Any]:
    model, cache, pairs = specs(case)
    with PagedPool.create(model, cache, device=device) as pool:
        rows = batch(case, pool, pairs)
        nbytes = int(rows[:, 3].sum()) * pool.layout.layer_slots
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        backend = page_copy(pool.buffer, pool.buffer, rows)
        ours, theirs = timed_pair(lambda: page_copy(pool.buffer, pool.buffer, rows),
                                  lambda: dst.copy_(src), device, reps)
    return {"name": case.name, "bytes": nbytes, "backend": backend, "pairs": pairs,
            "layer_slots": model.layers_per_group, "ours_gbps": round(nbytes / ours / 1e9, 3),
            "torch_copy_gbps": round(nbytes / theirs / 1e9, 3), "ratio": round(theirs / ours, 3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own options; `--json` belongs to the caller (the CLI prints `run`'s result)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--quick", action="store_true", help="small batches, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both sides (default: torch's own setting)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    reps = args.reps or (5 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"device": str(device), "threads": torch.get_num_threads(),
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
