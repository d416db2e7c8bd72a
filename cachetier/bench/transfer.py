"""`cachetier bench transfer`: agent-to-agent page transfer over loopback next to a raw socket copy.

A case moves a batch of checkpoints (one KDA page per KDA group each, every layer slot) from a
source pool of TP degree `src_tp` to a destination pool of degree `dst_tp`: every destination rank
`pull`s its heads from every source rank that holds some (`gpu_pool.transfer`), all connections at
once. Timed in the same run, repetition by repetition in alternating order:

- `gbps`: our transfer: the request frames, one header per (page, layer slot, byte run) stream,
  each payload sent from the source pool's memory and received straight into its destination
  offset, a new connection per (source rank, destination rank) pair, as the agents do;
- `raw_socket_gbps` (the denominator of `ratio`): the same bytes over the same connections, each
  pair's bytes sent as one contiguous buffer into one contiguous buffer, with the same event-loop
  socket primitives: the bound a transfer of that volume reaches on this machine.

`vs_same_tp` and `resharding_cost` (see `with_same_tp`) say what re-sharding costs over a transfer
that needs none. The source ranks serve from their own event
loop in a thread (in a deployment they are other processes), the destination ranks pull from
this one. The first transfer of each case is checked against the source states.

Pages are the kimi-k3 preset's per-rank pages (96 heads of 128x128 bf16 after the kernel-4 bf16
conv rows of their q, k, v channels) with `--slots` of its
23 layer slots, to bound memory; `--quick` uses tiny pages (the test's run, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from cachetier.config import PRESETS, CacheSpec, ModelSpec
from cachetier.wire.framing import DEFAULT_MAX_FRAME, Endpoint
from cachetier.wire.sockio import (SocketServer, connect, read_frame, recv_into, send_buffers,
                                   send_frame)
from gpu_pool import PageKind, PagedPool
from gpu_pool.streams import PageMove, plan_fetch
from gpu_pool.transfer import PageServer, pull

TOKEN = "bench"
# every re-sharded case has a same-TP case with as many connections (see `with_same_tp`)
DEGREES = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 2), (8, 8), (8, 1))
QUICK_DEGREES = ((1, 1), (1, 2), (2, 1))


@dataclass(frozen=True)
class Geometry:
    model: ModelSpec
    cache: CacheSpec
    checkpoints: int

    def ranks(self, degree: int) -> tuple[ModelSpec, CacheSpec]:
        pages = self.checkpoints * self.model.kda_groups
        return (dataclasses.replace(self.model, tp_degree=degree),
                dataclasses.replace(self.cache, num_pages=pages))

    def moves(self) -> list[PageMove]:
        pages = self.checkpoints * self.model.kda_groups
        return [PageMove(p, pages - 1 - p, PageKind.KDA) for p in range(pages)]


def geometry(args: argparse.Namespace) -> Geometry:
    if args.quick:
        cfg = PRESETS["tiny"]
        return Geometry(dataclasses.replace(cfg.model, kda_heads=8), cfg.cache, args.checkpoints or 4)
    cfg = PRESETS["kimi-k3"]
    return Geometry(dataclasses.replace(cfg.model, layers_per_group=args.slots), cfg.cache,
                    args.checkpoints or 4)


class SourceLoop:
    """An event loop in a thread that runs the source side: one page server per source rank and
    a raw sender (`RawSender`) over the same memory."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-sources",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[Any]) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class RawSender:
    """Answers a frame `{n}` with the first n bytes of one contiguous buffer, in one send."""

    def __init__(self, data: torch.Tensor) -> None:
        self._data = memoryview(data.numpy())
        self.server = SocketServer(self._serve)

    async def _serve(self, conn: Any) -> None:
        while True:
            request = await read_frame(conn, DEFAULT_MAX_FRAME)
            await send_buffers(conn, [self._data[:request["n"]]])


async def raw_copy(url: str, into: memoryview) -> None:
    sock = await connect(Endpoint.parse(url))
    try:
        await send_frame(sock, {"n": len(into)}, DEFAULT_MAX_FRAME)
        await recv_into(sock, into)
    finally:
        sock.close()


def measure(geo: Geometry, src_tp: int, dst_tp: int, reps: int, sources: SourceLoop) -> dict[str, Any]:
    with ExitStack() as stack:
        src_pools = [stack.enter_context(PagedPool.create(*geo.ranks(src_tp))) for _ in range(src_tp)]
        dst_pools = [stack.enter_context(PagedPool.create(*geo.ranks(dst_tp))) for _ in range(dst_tp)]
        for pool in src_pools:
            pool.buffer.view(torch.int16).random_()
        moves = geo.moves()
        src_layout = src_pools[0].layout
        plans = [plan_fetch(src_layout, p.layout, r, moves) for r, p in enumerate(dst_pools)]
        pair_bytes = [sum(s.nbytes for s in streams) for plan in plans for streams in plan.values()]
        nbytes = sum(pair_bytes)
        servers = [PageServer(lambda p=p: p, lambda: TOKEN) for p in src_pools]
        urls = [sources.run(s.start()) for s in servers]
        raw_src = torch.randint(0, 256, (max(pair_bytes),), dtype=torch.uint8)
        raw_dst = torch.empty(nbytes, dtype=torch.uint8)
        raw = RawSender(raw_src)
        raw_url = sources.run(raw.server.start("tcp://127.0.0.1:0"))
        try:
            async def ours() -> None:
                await asyncio.gather(*(pull(p, r, src_layout, urls, moves, TOKEN)
                                       for r, p in enumerate(dst_pools)))

            async def raw_socket() -> None:
                view, at, copies = memoryview(raw_dst.numpy()), 0, []
                for size in pair_bytes:
                    copies.append(raw_copy(raw_url, view[at:at + size]))
                    at += size
                await asyncio.gather(*copies)

            asyncio.run(ours())
            check(src_pools, dst_pools, moves)
            seconds = asyncio.run(timed({"ours": ours, "raw": raw_socket}, reps))
        finally:
            for s in [*servers, raw.server]:
                sources.run(s.close())
    streams = sum(len(v) for plan in plans for v in plan.values())
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {"src_tp": src_tp, "dst_tp": dst_tp, "bytes": nbytes, "streams": streams,
            "connections": len(pair_bytes), "gbps": significant(gbps["ours"]),
            "raw_socket_gbps": significant(gbps["raw"]),
            "ratio": significant(gbps["ours"] / gbps["raw"])}


def significant(value: float) -> float:
    """Four significant digits: tiny quick runs move kB/s, real ones GB/s."""
    return float(f"{value:.4g}")


async def timed(contenders: dict[str, Callable[[], Awaitable[None]]], reps: int) -> dict[str, float]:
    """Median seconds per call; the order alternates so neither always runs second."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            start = time.perf_counter()
            await contenders[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def check(src_pools: Sequence[PagedPool], dst_pools: Sequence[PagedPool],
          moves: Sequence[PageMove]) -> None:
    """Every moved state, both parts gathered over the destination ranks, equals it over the
    source ranks (compared as bits: random bytes hold NaNs)."""
    for move in moves:
        for part in (_recurrent, _conv):
            src, dst = part(src_pools, move.src), part(dst_pools, move.dst)
            if not torch.equal(src.view(torch.uint8), dst.view(torch.uint8)):
                raise RuntimeError(f"page {move.src} did not arrive intact in page {move.dst}")


def _recurrent(pools: Sequence[PagedPool], page: int) -> torch.Tensor:
    """`[slots, heads, K, V]` of `page` over all ranks."""
    return torch.cat([p.kda_view(page) for p in pools], dim=1).contiguous()


def _conv(pools: Sequence[PagedPool], page: int) -> torch.Tensor:
    """`[slots, conv_channels, kernel - 1]` of `page` over all ranks, in global channel order."""
    pieces = []
    for rank, pool in enumerate(pools):
        rows = pool.layout.conv_rows(pool.layout.rank_heads(rank), rank)
        pieces += [(ours.start, pool.conv_view(page)[:, theirs.start:theirs.stop])
                   for ours, theirs in rows]
    return torch.cat([view for _, view in sorted(pieces, key=lambda p: p[0])], dim=1)


def with_same_tp(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`vs_same_tp`: throughput over the same-TP case of this source degree. `resharding_cost`:
    the extra time of re-sharding over the same-TP case with as many connections (the same
    transfer parallelism: 8 -> 1 is compared with 8 -> 8, not with 1 -> 1), each normalised by its
    own raw-socket copy so that machine noise between the two cases cancels: same ratio / this
    ratio - 1 (target < 0.10)."""
    same = {c["src_tp"]: c for c in cases if c["src_tp"] == c["dst_tp"]}
    by_connections = {c["connections"]: c for c in same.values()}
    for case in cases:
        if case["src_tp"] in same:
            case["vs_same_tp"] = significant(case["gbps"] / same[case["src_tp"]]["gbps"])
        reference = by_connections.get(case["connections"])
        if case["src_tp"] != case["dst_tp"] and reference is not None:
            case["resharding_cost"] = significant(reference["ratio"] / case["ratio"] - 1)
    return cases


def progress(line: str) -> None:
    print(f"bench transfer: {line}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own options; `--json` belongs to the caller (the CLI prints `run`'s result)."""
    parser.add_argument("--quick", action="store_true", help="tiny pages, few repetitions")
    parser.add_argument("--checkpoints", type=int, default=None,
                        help="checkpoints per transfer (default 4)")
    parser.add_argument("--slots", type=int, default=2,
                        help="layer slots of the kimi-k3 pages (default 2 of 23)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    parser.add_argument("--degrees", default=None, metavar="S:D,...",
                        help="TP pairs (default: " + ",".join(f"{s}:{d}" for s, d in DEGREES) + ")")


def degrees(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.degrees is None:
        return list(QUICK_DEGREES if args.quick else DEGREES)
    pairs = [tuple(int(x) for x in item.split(":")) for item in args.degrees.split(",")]
    return [(s, d) for s, d in pairs]


def run(args: argparse.Namespace) -> dict[str, Any]:
    geo = geometry(args)
    reps = args.reps or (3 if args.quick else 9)
    torch.set_num_threads(1)
    sources = SourceLoop()
    cases = []
    try:
        for src_tp, dst_tp in degrees(args):
            progress(f"TP {src_tp} -> {dst_tp}")
            cases.append(measure(geo, src_tp, dst_tp, reps, sources))
    finally:
        sources.close()
    return {"preset": "tiny" if args.quick else "kimi-k3", "layer_slots": geo.model.layers_per_group,
            "checkpoints": geo.checkpoints, "reps": reps, "cases": with_same_tp(cases)}
