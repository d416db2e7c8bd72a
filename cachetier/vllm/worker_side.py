"""The connector in a vLLM worker: copies between the pool and the KV cache, saves what it computed.

The worker maps the pool of its device in place (the agent's `PoolHandle`, published in a file),
so a load is a copy from the pool's pages into vLLM's blocks and a save the reverse, with no
network transfer of bytes. Only metadata crosses the network: a save is one plan for every job of
the step (fresh pages for what the pool lacks, with the usual pins), the copies, one commit, its
confirm and one release; a load checks the pool epoch it pinned in is still the pool's after its
copies, so a hit made void while it was read (an agent lost, the pool invalidated) is reported to
vLLM as a failed receive, which it recomputes, instead of serving bytes nobody vouches for.
Loads are vLLM's asynchronous kind (the request waits for its receive, `take_load_results`):
vLLM 0.32 recovers a failed load of a hybrid model only that way; a block-level failure
(`get_block_ids_with_load_errors`) stops the engine when it has several KV cache groups.

With tensor parallelism each rank's worker maps its own rank's agent (`ConnectorSettings.
handle_file_of`) and copies its share of the heads; a step's saves are planned and committed once,
by rank 0, for all ranks (`ranks.Ranks`): committed only if every rank wrote its share.

The agent's handle file is re-read when it changes (a restarted agent holds a new segment, and
so does one whose fence a writer held past its wait, `gpu_pool.fence`); a save planned across
such a change is abandoned. A save writes under the agent's epoch fence
(`PagedPool.writing`, `gpu_pool.fence`): a save whose epoch was voided after its plan is refused
before its first byte (its pages may be another request's by then), and the agent's fence waits
for a save under way; loads only read.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cachetier.config import Config
from cachetier.engine.checkpoint_placement import PLACEMENTS
from cachetier.vllm.cow import CowCorrection
from cachetier.vllm.jobs import CacheTierMetadata, LoadJob, SaveJob, WorkerReport
from cachetier.vllm.kv_copy import (AttentionViews, StateViews, TokenRows, engine_attention_views,
                                    engine_state_views, finish_copies, load_rows, load_states,
                                    pool_attention_views, pool_state_views, save_rows, save_states)
from cachetier.vllm.ranks import Ranks
from cachetier.vllm.settings import ConnectorSettings
from cachetier.vllm.tier_thread import TierThread
from gpu_pool import PagedPool, PoolHandle
from index.records import CommitItem, RequestPlan, StepPlan, StepRequest
from index.tickets import write_stamp

log = logging.getLogger("cachetier.vllm")


@dataclass
class _PoolMapping:
    pool: PagedPool
    identity: tuple[int, int]  # the handle file's (inode, mtime_ns) when it was read
    # per layer slot, shared by every group of the kind: a page id picks the group's page
    attention: list[AttentionViews]
    state: list[StateViews]


def read_handle(path: str) -> tuple[PoolHandle, tuple[int, int]]:
    stat = os.stat(path)
    return pickle.loads(Path(path).read_bytes()), (stat.st_ino, stat.st_mtime_ns)


class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings, config: Config, groups: list[str],
                 layer_names: list[list[str]], tier: TierThread, ranks: Ranks,
                 attention_isa: str | None = None, cow: CowCorrection | None = None) -> None:
        self.settings = settings
        self.config = config
        self.groups = groups
        self.layer_names = layer_names
        self.tier = tier
        self.ranks = ranks
        self.attention_isa = attention_isa  # vLLM's CPU attention kernel: its block layout
        self.cow = cow  # the correction of vLLM's mid-block copies in this process, if any
        self.placement = PLACEMENTS[settings.placement]
        self.block_tokens = config.cache.page_tokens  # vLLM's block (the alignment rule)
        self._engine_attention: dict[int, list[AttentionViews]] = {}
        self._engine_state: dict[int, list[StateViews]] = {}
        self._device = torch.device("cpu")  # the KV cache's, where the copies are queued
        self._mapping: _PoolMapping | None = None
        self._epoch = 0  # the pool epoch last seen: pins of an older one are void
        self._loads_ended: set[str] = set()  # request ids whose load ended, failed or not
        self._loads_failed: set[str] = set()
        self._report = WorkerReport()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self.config.model
        self._device = next(iter(kv_caches.values())).device
        _allow_amx_tiles(self._device)
        for g, (kind, names) in enumerate(zip(self.groups, self.layer_names)):
            tensors = [kv_caches[name] for name in names]
            if kind == "full":
                self._engine_attention[g] = [
                    engine_attention_views(t, self.block_tokens, model, self.attention_isa)
                    for t in tensors]
            else:
                self._engine_state[g] = [engine_state_views(t, model) for t in tensors]
        self._map_pool()
        try:
            self._epoch = self._pool_epoch()
        except Exception as exc:  # the first load's check learns it
            log.warning("cachetier service not reachable yet: %s", exc)

    # -- the pool ----------------------------------------------------------------------------------

    def _map_pool(self) -> _PoolMapping:
        """The current agent's pool, mapped again when its handle file changed."""
        path = self.settings.handle_file_of(self.ranks.rank)
        stat = os.stat(path)
        identity = (stat.st_ino, stat.st_mtime_ns)
        if self._mapping is not None and self._mapping.identity == identity:
            return self._mapping
        handle, identity = read_handle(path)
        if (handle.model, handle.cache) != (self.config.model, self.config.cache):
            raise RuntimeError(f"{path}: the agent's pool geometry is not the one the service "
                               "gave this connector")
        pool = PagedPool.attach(handle)
        layout = pool.layout
        slots = range(self.config.model.layers_per_group)
        self._mapping = _PoolMapping(pool, identity,
                                     [pool_attention_views(pool.buffer, layout, s) for s in slots],
                                     [pool_state_views(pool.buffer, layout, s) for s in slots])
        return self._mapping

    def _pool_epoch(self) -> int:
        stats = self.tier.call(lambda c: c.stats(self.settings.pool), self.settings.timeout_s)
        return stats.epoch

    # -- loads: before the forward pass -----------------------------------------------------------

    def start_load(self, meta: CacheTierMetadata) -> None:
        if not meta.loads:
            return
        begin = time.perf_counter()
        jobs = [job for job in meta.loads if job.epoch >= self._epoch]
        self._fail(job for job in meta.loads if job.epoch < self._epoch)  # known void: no copy
        try:
            self._copy_loads(self._map_pool(), jobs)
            # Epochs only grow: a pool still in a job's pin epoch after the copy was in it
            # throughout, so its pins held and the bytes read are the pinned ones. One check
            # per step, after the copies.
            self._epoch = self._pool_epoch()
            self._fail(job for job in jobs if job.epoch != self._epoch)
        except Exception as exc:
            log.warning("cachetier load failed, vLLM recomputes: %s", exc)
            self._fail(jobs)
        finally:
            self._loads_ended.update(job.rid for job in meta.loads)
            self._report.restore_ms += 1000 * (time.perf_counter() - begin)

    def _copy_loads(self, mapping: _PoolMapping, jobs: Sequence[LoadJob]) -> None:
        """Each group's rows and states for every job, one `kv_copy` call per group (on CUDA, one
        kernel launch per word width for all its layers); done when it returns."""
        page_tokens, block_tokens = self.config.cache.page_tokens, self.block_tokens
        attention = [g for g, kind in enumerate(self.groups) if kind == "full"]
        linear = [g for g, kind in enumerate(self.groups) if kind == "linear"]
        for a, g in enumerate(attention):
            rows = TokenRows.of([(job.local_tokens, job.hit_tokens, job.block_ids[g],
                                  job.mla_pages[a]) for job in jobs], block_tokens, page_tokens)
            load_rows(mapping.attention, self._engine_attention[g], rows)
        for s, g in enumerate(linear):
            pages, blocks = [], []
            for job in jobs:
                for block in state_blocks(job.block_ids[g], job.hit_tokens, block_tokens):
                    pages.append(job.checkpoint_pages[s])
                    blocks.append(block)
            load_states(mapping.state, self._engine_state[g], pages, blocks)
        finish_copies(self._device)

    def _fail(self, jobs: Any) -> None:
        """Requests whose load vLLM must not trust: it recomputes them from their local hit."""
        for job in jobs:
            if job.rid not in self._loads_failed:
                self._report.failed_loads += 1
                self._loads_failed.add(job.rid)

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """The requests whose load ended since the last call, and those of them that failed."""
        ended, failed = self._loads_ended, self._loads_failed
        self._loads_ended, self._loads_failed = set(), set()
        return ended, failed

    def take_report(self) -> WorkerReport:
        report, self._report = self._report, WorkerReport()
        if self.cow is not None:
            report.cow_copies, seconds = self.cow.take()
            report.cow_ms = 1000 * seconds
        return report

    # -- saves: after the forward pass ------------------------------------------------------------

    def save(self, meta: CacheTierMetadata) -> None:
        """Every rank runs this on the same metadata, so the leader's plan and the ranks'
        verdicts pass between them in step (`Ranks`); only the leader talks to the index."""
        if not meta.saves:
            return
        rids = [f"{self.settings.engine_id}/{job.rid}@{job.boundary}" for job in meta.saves]
        begin = time.perf_counter()
        try:
            mapping = self._mapped()  # before the plan: an agent changed since is caught
            plan = self.ranks.from_leader(self._plan_saves(meta.saves, rids)
                                          if self.ranks.leader else None)
            written = (plan is not None and mapping is not None
                       and self._write_saves(mapping, meta.saves, rids, plan))
            everywhere = self.ranks.all_succeeded(written)
            if self.ranks.leader and plan is not None:  # the leader counts for the engine
                if everywhere:
                    self._commit_saves(meta.saves, rids, plan)
                else:
                    self._report.failed_saves += len(meta.saves)
        finally:
            self._report.save_ms += 1000 * (time.perf_counter() - begin)
            if self.ranks.leader:
                pool = self.settings.pool
                release = self.tier.submit(lambda c: c.release(pool, rids))
                release.add_done_callback(lambda f: f.exception())

    def _plan_saves(self, saves: Sequence[SaveJob], rids: list[str]) -> StepPlan | None:
        """The leader's plan for the step's saves, or None (counted failed) without one."""
        requests = [StepRequest(rid, job.boundary, job.boundary, job.hashes)
                    for rid, job in zip(rids, saves)]
        try:
            plan = self.tier.call(lambda c: c.plan(self.settings.pool, requests),
                                  self.settings.timeout_s)
        except Exception as exc:
            log.warning("cachetier save not planned (the prefix stays uncached): %s", exc)
            plan = None
        else:
            if not isinstance(plan, StepPlan):
                log.info("cachetier save skipped: %s", plan.reason)
                plan = None
        if plan is None:
            self._report.failed_saves += len(saves)
        return plan

    def _mapped(self) -> _PoolMapping | None:
        try:
            return self._map_pool()
        except Exception as exc:
            log.warning("cachetier pool of rank %d not mapped: %s", self.ranks.rank, exc)
            return None

    def _write_saves(self, mapping: _PoolMapping, saves: Sequence[SaveJob], rids: list[str],
                     plan: StepPlan) -> bool:
        """This rank's share of every planned save into its pool; False if any byte could not be
        written (the agent changed since `mapping`, or fenced the plan's epoch off)."""
        try:
            if self._map_pool() is not mapping:
                raise RuntimeError("the agent changed during the save")
            planned = {p.rid: p for p in plan.requests}
            pages = [page for p in plan.requests
                     for page in p.written_pages(self.config.cache.page_tokens)]
            # refused once the agent fenced the epoch off, or handed a page to a later step
            with mapping.pool.writing(plan.epoch, write_stamp(plan.ticket), pages):
                self._copy_saves(mapping, [(job, planned[rid]) for rid, job in zip(rids, saves)])
            return True
        except Exception as exc:
            log.warning("cachetier save failed on rank %d (the prefix stays uncached): %s",
                        self.ranks.rank, exc)
            return False

    def _commit_saves(self, saves: Sequence[SaveJob], rids: list[str], plan: StepPlan) -> None:
        planned = {p.rid: p for p in plan.requests}
        items = [self._commit_item(job, planned[rid]) for rid, job in zip(rids, saves)]
        try:
            self.tier.call(lambda c: _commit(c, self.settings.pool, items),
                           self.settings.timeout_s)
        except Exception as exc:
            self._report.failed_saves += len(saves)
            log.warning("cachetier commit failed (the prefix stays uncached): %s", exc)

    def _copy_saves(self, mapping: _PoolMapping,
                    pairs: Sequence[tuple[SaveJob, RequestPlan]]) -> None:
        """As `_copy_loads`, the other way; done when it returns, so inside the fence."""
        page_tokens, block_tokens = self.config.cache.page_tokens, self.block_tokens
        attention = [g for g, kind in enumerate(self.groups) if kind == "full"]
        linear = [g for g, kind in enumerate(self.groups) if kind == "linear"]
        for a, g in enumerate(attention):
            rows = TokenRows.of([(plan.start, plan.stop, job.block_ids[g], plan.mla_pages[a])
                                 for job, plan in pairs], block_tokens, page_tokens)
            save_rows(self._engine_attention[g], mapping.attention, rows)
        with_state = [(job, plan) for job, plan in pairs
                      if plan.checkpoint_pages and plan.checkpoint_tokens == job.boundary]
        for s, g in enumerate(linear):
            blocks = [job.state_blocks[s] for job, _ in with_state]
            pages = [plan.checkpoint_pages[s] for _, plan in with_state]
            save_states(self._engine_state[g], mapping.state, blocks, pages)
        finish_copies(self._device)

    def _commit_item(self, job: SaveJob, plan: RequestPlan) -> CommitItem:
        if not plan.checkpoint_pages or plan.checkpoint_tokens != job.boundary:
            return CommitItem(plan.rid, plan.stop)
        kind = self.placement.checkpoint_kind(plan, job.prompt_tokens,
                                              self.config.cache.hash_block_tokens,
                                              self.config.cache.page_tokens)
        if kind is None:
            return CommitItem(plan.rid, plan.stop)
        return CommitItem(plan.rid, plan.stop, plan.checkpoint_tokens, kind=kind)


def _allow_amx_tiles(device: torch.device) -> None:
    """Ask Linux for this process's AMX tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, through
    torch) before any forward pass: vLLM's CPU AMX attention kernel does not ask for it itself.
    An engine whose first pass was a restored request with fewer than 16 tokens left to compute
    (an exact resend) died of SIGILL in that kernel; after one ordinary prefill in the process,
    the same pass ran (measured on the tiny GQA model: only a connector makes such a first pass)."""
    if device.type == "cpu" and torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def state_blocks(table: list[int], hit_tokens: int, block_tokens: int) -> list[int]:
    """The blocks of one linear group that must hold a hit's state. Align mode keeps the state at
    tokens `hit` in the block of the hit's last token, which later hits on this engine read; but
    before the connector loads, vLLM has already copied that block into the block this step's
    pass runs in (the table's last, past null blocks when the first chunk spans several blocks),
    and the pass reads its initial state from there. So every real block from the hit's on gets
    the state: the pass overwrites the ones after it. Found with real engines: a block-aligned
    hit, then a first chunk crossing block ends, came out wrong until each was covered."""
    first = (hit_tokens - 1) // block_tokens
    return [block for block in table[first:] if block > 0]


async def _commit(client: Any, pool: str, items: list[CommitItem]) -> None:
    committed = await client.commit(pool, items)
    await client.confirm(pool, committed.ticket)
