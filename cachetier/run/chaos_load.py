"""The verifying load of `cachetier chaos`: schedulers that also play the inference worker.

Each client plans one request at a time, attached to every rank's pool through the agents'
handle files as a co-located worker is: before its forward pass it checks every byte its plan
says is restored or cached (state pages hold a pattern unique to their token prefix and KDA
group, MLA pages each token's value), then writes its own under the pool's fence (token values
into the MLA pages, the pattern into the checkpoint pages), commits, confirms and releases. A
hit whose bytes differ is a wrong hit; an error that is not retryable is counted as such; the
request is released whatever happened, so at the end nothing may be left pinned.

Which process's memory serves a plan is known by its epoch: an agent restarted after a kill
registers in a new epoch, and writes its handle file before it can acknowledge anything of it,
so a plan of an epoch newer than any seen is read through the handle files as they are now.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cachetier.client import CacheTierClient
from cachetier.errors import CacheTierError, StaleOrder
from gpu_pool.pool import PagedPool
from index.hashing import chain_hashes, namespace_root
from index.records import CommitItem, RequestPlan, StepPlan, StepRefusal, StepRequest
from index.tickets import write_stamp

ROOT = namespace_root("cachetier-chaos")
_ATTACH_TIMEOUT_S = 20.0
_RELEASE_TIMEOUT_S = 20.0
_KEPT_EPOCHS = 8  # views of older epochs are dropped (a plan that old fails its fence anyway)


@dataclass
class Tally:
    steps: int = 0
    hits_checked: int = 0
    wrong_hits: int = 0
    retryable: dict[str, int] = field(default_factory=dict)
    non_retryable: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, for the report
    in_flight: int = 0  # plans sent and not answered yet
    last_ok: float = 0.0

    def failed(self, op: str, exc: BaseException) -> None:
        if isinstance(exc, CacheTierError) and exc.retryable:
            self.retryable[exc.code] = self.retryable.get(exc.code, 0) + 1
        else:
            self.non_retryable += 1
            self.problem(f"{op}: {type(exc).__name__}: {exc}")

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


class Workers:
    """Every rank's pool as the worker maps it, per epoch (see the module docstring)."""

    def __init__(self, handle_files: list[Path]) -> None:
        self.handle_files = handle_files
        self.current: list[PagedPool | None] = [None] * len(handle_files)
        self._identity: list[tuple[int, int] | None] = [None] * len(handle_files)
        self._by_epoch: dict[int, list[PagedPool]] = {}
        self._lock = asyncio.Lock()

    async def views(self, epoch: int) -> list[PagedPool]:
        async with self._lock:
            if epoch in self._by_epoch:
                return self._by_epoch[epoch]
            older = [e for e in self._by_epoch if e < epoch]
            if epoch < max(self._by_epoch, default=-1) and older:
                return self._by_epoch[max(older)]
            views = await self.reload()
            self._by_epoch[epoch] = views
            for stale in sorted(self._by_epoch)[:-_KEPT_EPOCHS]:
                del self._by_epoch[stale]
            return views

    async def reload(self) -> list[PagedPool]:
        """Attach again every rank whose handle file names another pool than the one mapped."""
        for rank, path in enumerate(self.handle_files):
            async with asyncio.timeout(_ATTACH_TIMEOUT_S):
                while True:
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(path)
                        identity = (st.st_ino, st.st_mtime_ns)
                        if identity == self._identity[rank]:
                            break
                        handle = pickle.loads(path.read_bytes())
                        self.current[rank] = PagedPool.attach(handle)
                        self._identity[rank] = identity
                        break
                    await asyncio.sleep(0.01)
        return [view for view in self.current if view is not None]


def state_pattern(tokens: list[int], group: int, nbytes: int) -> torch.Tensor:
    """The bytes a checkpoint of `tokens` holds in KDA group `group`: unique per prefix."""
    seed = hashlib.blake2b(repr((tokens, group)).encode(), digest_size=64).digest()
    reps = -(-nbytes // len(seed))
    return torch.frombuffer(bytearray(seed * reps), dtype=torch.uint8)[:nbytes]


def wrong_bytes(views: list[PagedPool], step: RequestPlan, tokens: list[int],
                page_tokens: int) -> str | None:
    """Why a hit's bytes are not the prefix it claims, on some rank; None when they all are."""
    hit = step.hit_tokens
    restores = [c for c in step.copies if c.dst in step.state_pages]
    if [c.dst for c in restores] != step.state_pages:
        return f"{step.rid}: the copies do not restore its state pages {step.state_pages}"
    for rank, view in enumerate(views):
        page_bytes = view.buffer.shape[-1]
        for group, c in enumerate(restores):
            want = state_pattern(tokens[:hit], group, page_bytes)[c.offset:c.offset + c.nbytes]
            got = view.buffer[:, c.dst, c.offset:c.offset + c.nbytes]
            if not torch.equal(got, want.expand_as(got)):
                return (f"{step.rid}: rank {rank} state page {c.dst} is not the {hit}-token "
                        "checkpoint")
        for pages in step.mla_pages:
            for first in range(0, hit, page_tokens):
                page, n = pages[first // page_tokens], min(page_tokens, hit - first)
                want_t = torch.tensor(tokens[first:first + n], dtype=torch.float32)[None, :, None]
                got = view.mla_view(page)[:, :n, :]
                if not torch.equal(got, want_t.to(got.dtype).expand_as(got)):
                    return f"{step.rid}: rank {rank} MLA page {page} lacks tokens {first}.."
    return None


def forward(views: list[PagedPool], plan: StepPlan, step: RequestPlan, tokens: list[int],
            page_tokens: int, checkpoint_tokens: int) -> None:
    """The pass of `step` of `plan`, under every rank's fence and claims as a worker writes."""
    stamp, pages = write_stamp(plan.ticket), step.written_pages(page_tokens)
    with contextlib.ExitStack() as fences:
        for view in views:
            fences.enter_context(view.writing(plan.epoch, stamp, pages))
        for view in views:
            for pages in step.mla_pages:
                for pos in range(step.start, step.stop):
                    view.mla_view(pages[pos // page_tokens])[:, pos % page_tokens, :] = \
                        float(tokens[pos])
            if checkpoint_tokens:
                for group, page in enumerate(step.checkpoint_pages):
                    view.buffer[:, page] = state_pattern(tokens[:checkpoint_tokens], group,
                                                         view.buffer.shape[-1])


@dataclass(frozen=True)
class LoadShape:
    pool: str
    block: int
    page_tokens: int
    docs: list[list[int]]


def make_docs(count: int, tokens: int) -> list[list[int]]:
    return [[1000 * (d + 1) + (13 * i + 7 * d) % 997 for i in range(tokens)] for d in range(count)]


async def one_request(tier: CacheTierClient, workers: Workers, shape: LoadShape, rid: str,
                      tokens: list[int], tally: Tally) -> None:
    op = "plan"
    try:
        request = StepRequest(rid, len(tokens), len(tokens),
                              chain_hashes(tokens, ROOT, shape.block), True)
        tally.in_flight += 1
        try:
            plan = await tier.plan(shape.pool, [request])
        finally:
            tally.in_flight -= 1
        if isinstance(plan, StepRefusal):
            return
        assert isinstance(plan, StepPlan)
        (step,) = plan.requests
        views = await workers.views(plan.epoch)
        if step.hit_tokens:
            wrong = wrong_bytes(views, step, tokens, shape.page_tokens)
            tally.hits_checked += 1
            if wrong is not None:
                tally.wrong_hits += 1
                tally.problem(f"wrong hit (epoch {plan.epoch}): {wrong}")
        op = "forward"
        ck = step.stop // shape.block * shape.block if step.checkpoint_pages else 0
        ck = ck if ck > step.start else 0
        forward(views, plan, step, tokens, shape.page_tokens, ck)
        op = "commit"
        done = await tier.commit(shape.pool, [CommitItem(rid, step.stop, ck, True)])
        op = "confirm"
        await tier.confirm(shape.pool, done.ticket)
        tally.steps += 1
        tally.last_ok = time.monotonic()
    except Exception as exc:  # noqa: BLE001 (every failure is counted, none ends the load)
        tally.failed(op, exc)
        await asyncio.sleep(random.uniform(0.005, 0.03))
    finally:
        try:
            await release_for_sure(tier, shape.pool, rid, tally.failed, _RELEASE_TIMEOUT_S)
        except TimeoutError:
            tally.non_retryable += 1
            tally.problem(f"release of {rid} did not succeed within {_RELEASE_TIMEOUT_S:g} s")


async def late_write(tier: CacheTierClient, workers: Workers, shape: LoadShape, rid: str,
                     tokens: list[int], stall_s: float, tally: Tally) -> str:
    """Plan `rid`, stall `stall_s` (past its lease: the reaper releases it and the load's steps
    may take its pages), then run its pass: "refused" (`StaleOrder`: some page was handed on),
    "landed" (none was: nobody reads those bytes as valid) or "skipped" (not planned, or the
    pool moved to another epoch meanwhile, which refuses it for that reason)."""
    request = StepRequest(rid, len(tokens), len(tokens), chain_hashes(tokens, ROOT, shape.block),
                          True)
    try:
        plan = await tier.plan(shape.pool, [request])
    except CacheTierError:
        return "skipped"
    if not isinstance(plan, StepPlan):
        return "skipped"
    await asyncio.sleep(stall_s)
    views = await workers.views(plan.epoch)
    (step,) = plan.requests
    try:
        forward(views, plan, step, tokens, shape.page_tokens, 0)
    except StaleOrder:
        moved = any(view.fence.epoch() != plan.epoch for view in views)
        return "skipped" if moved else "refused"
    finally:  # reaped already, unless the reaper was late
        await release_for_sure(tier, shape.pool, rid, tally.failed, _RELEASE_TIMEOUT_S)
    return "landed"


async def release_for_sure(tier: CacheTierClient, pool: str, rid: str,
                           failed: Callable[[str, BaseException], None], timeout_s: float) -> None:
    """A scheduler releases a request whatever happened to it (a failed plan may have happened on
    the service), retrying while the service cannot (Redis down, a failover, a recovery), each
    failure told to `failed`; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                await tier.release(pool, [rid])
                return
            except CacheTierError as exc:
                failed("release", exc)
                await asyncio.sleep(0.05)


async def client_loop(connect: Callable[[], CacheTierClient], workers: Workers,
                      shape: LoadShape, n: int, stop: asyncio.Event, tally: Tally,
                      seed: int) -> None:
    rng = random.Random(seed * 1000 + n)
    async with connect() as tier:
        i = 0
        while not stop.is_set():
            doc = rng.choice(shape.docs)
            tokens = doc[:rng.randrange(2 * shape.block, len(doc))] + [n, i]
            await one_request(tier, workers, shape, f"chaos-c{n}-{i}", tokens, tally)
            i += 1
