"""The connector in vLLM's scheduler: finds hits beyond vLLM's own, pins them, plans the saves.

A request's lookup is one `pin` call to the service (lookup and pin in one script): the
scheduler never waits for it. The first `get_num_new_matched_tokens` submits it and answers None
("ask again"); a later step reads the answer. A hit is loaded asynchronously in vLLM's terms:
the request waits for its receive (the worker copies in the step that follows), so a load found
void is a failed receive vLLM recomputes, the one failure vLLM 0.32 recovers from for hybrid
models. The pin is held under the reader id
`<engine>/<request>` until vLLM reports the request finished (`request_finished_all_groups`), so
nothing the worker reads can be evicted or rewritten before vLLM is done with it; a hit no deeper
than vLLM's local one is released at once.

Saves follow vLLM's align mode: each step, vLLM hands over the exact blocks holding the state
at every boundary it kept (`kv_connector_block_state.boundary_state_offloads`: its attention
block ends and each prompt's last hash-unit boundary). Each boundary inside the prompt becomes a
`SaveJob` for the worker, which writes it after that step's forward pass. A full-attention model
has no state to hand over, and every prefix of its KV is a place to resume: each step, a request
whose computed prompt tokens crossed a hash-unit boundary saves up to its deepest one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cachetier.config import Config
from cachetier.vllm.jobs import CacheTierMetadata, LoadJob, SaveJob, WorkerReport
from cachetier.vllm.settings import ConnectorSettings
from cachetier.vllm.tier_thread import TierThread
from index.hashing import chain_hashes, hash_len, namespace_root
from index.prefix import PinnedPrefix

log = logging.getLogger("cachetier.vllm")


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    hashes: bytes
    lookup: concurrent.futures.Future[PinnedPrefix] | None = None
    pinned: PinnedPrefix | None = None
    scheduled: bool = False  # once scheduled, a request is never loaded into again
    saved_boundary: int = 0
    report: dict[str, int] = field(default_factory=lambda: {"cachetier_hit_tokens": 0,
                                                            "cachetier_loaded_tokens": 0,
                                                            "cachetier_saved_boundaries": 0})

    @property
    def reader_hit(self) -> int:
        return self.pinned.hit_tokens if self.pinned is not None else 0


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, config: Config, groups: list[str],
                 tier: TierThread) -> None:
        self.settings = settings
        self.config = config
        self.block = config.cache.hash_block_tokens
        self.groups = groups  # "linear" or "full" per vLLM group, in the engine's order
        self.tier = tier
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []  # allocated since the last step's metadata
        self._roots: dict[tuple[str, str], bytes] = {}
        self.lookups = 0
        self.lookup_failures = 0
        self.steps = 0
        self.busy_s = 0.0  # in this connector's scheduler calls: the cost it adds to each step
        self.workers = WorkerReport()

    # -- lookups ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._timed():
            return self._matched(request, num_computed_tokens)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._track(request)
        if tracked.lookup is not None and tracked.pinned is None:
            if not tracked.lookup.done():
                return None, False
            try:
                tracked.pinned = tracked.lookup.result()
            except Exception as exc:  # the tier is away: a miss, never an engine failure
                self.lookup_failures += 1
                log.warning("cachetier lookup for %s failed: %s", request.request_id, exc)
                tracked.pinned = PinnedPrefix(self._reader(request.request_id), -1, 0, [], [])
        if tracked.lookup is None or tracked.scheduled:
            # A request scheduled before and asked about again was preempted: vLLM recomputes
            # it from its own cache (its loads are planned for new requests only).
            return 0, False
        hit = tracked.reader_hit
        if hit <= num_computed_tokens:
            self._release(tracked)
            return 0, False
        return hit - num_computed_tokens, True

    def _track(self, request: Any) -> _Tracked:
        tokens = list(request.all_token_ids)
        hashes = chain_hashes(tokens, self._root(request), self.block, self.config.cache.hash_algo)
        tracked = _Tracked(request, hashes)
        self._tracked[request.request_id] = tracked
        if len(tokens) > self.block:  # a hit leaves a token to compute: needs two blocks at least
            reader = self._reader(request.request_id)
            self.lookups += 1
            tracked.lookup = self.tier.submit(
                lambda c: c.pin(self.settings.pool, reader, len(tokens), hashes))
        return tracked

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        with self._timed():
            self._allocated(request, blocks, num_external_tokens)

    def _allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.pinned is None:
            return
        if num_external_tokens > 0:
            pinned = tracked.pinned
            # vLLM has allocated the request's blocks up to the hit, and waits for the receive
            self._loads.append(LoadJob(request.request_id, pinned.hit_tokens,
                                       pinned.hit_tokens - num_external_tokens, pinned.epoch,
                                       pinned.mla_pages, pinned.checkpoint_pages,
                                       tuple(list(ids) for ids in blocks.get_block_ids())))
            tracked.report["cachetier_hit_tokens"] = tracked.reader_hit
            tracked.report["cachetier_loaded_tokens"] = num_external_tokens
        else:
            self._release(tracked)

    def load_failed(self, rid: str) -> None:
        """vLLM recomputes a request whose receive failed, asking about it again: its hit is
        void (unpinned now), so the answer is a miss, not the same load over and over."""
        with self._timed():
            tracked = self._tracked.get(rid)
            if tracked is not None:
                self._release(tracked)
                tracked.report["cachetier_loaded_tokens"] = 0

    # -- each step -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> CacheTierMetadata:
        self.steps += 1
        with self._timed():
            return self._step_meta(scheduler_output)

    def _step_meta(self, scheduler_output: Any) -> CacheTierMetadata:
        meta = CacheTierMetadata(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.scheduled = True
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is None:
            return meta
        if "linear" not in self.groups:
            meta.saves.extend(self._attention_saves(scheduler_output.num_scheduled_tokens,
                                                    block_state))
        elif block_state.boundary_state_offloads:
            meta.saves.extend(self._saves(block_state))
        return meta

    def _attention_saves(self, scheduled: dict[str, int], block_state: Any) -> list[SaveJob]:
        """A full-attention model's saves: the prompt up to the deepest hash-unit boundary its
        computed tokens reach once this step's pass has run (vLLM counts them after this call),
        for each request whose step crosses one (what it computed before, its local or tier hit
        included, is held already) beyond what it saved."""
        width = hash_len(self.config.cache.hash_algo)
        jobs = []
        for rid, tokens in scheduled.items():
            tracked = self._tracked.get(rid)
            block_ids = block_state.get_block_ids(rid)
            if tracked is None or block_ids is None:
                continue
            prompt, before = tracked.request.num_prompt_tokens, tracked.request.num_computed_tokens
            boundary = min(before + tokens, prompt) // self.block * self.block
            if boundary <= max(tracked.saved_boundary, before // self.block * self.block):
                continue
            jobs.append(SaveJob(rid, boundary, prompt,
                                tracked.hashes[:boundary // self.block * width], [],
                                tuple(list(ids) for ids in block_ids)))
            tracked.saved_boundary = boundary
            tracked.report["cachetier_saved_boundaries"] += 1
        return jobs

    def _saves(self, block_state: Any) -> list[SaveJob]:
        linear = [g for g, kind in enumerate(self.groups) if kind == "linear"]
        width = hash_len(self.config.cache.hash_algo)
        jobs = []
        for rid, entries in block_state.boundary_state_offloads.items():
            tracked = self._tracked.get(rid)
            block_ids = block_state.get_block_ids(rid)
            if tracked is None or block_ids is None:
                continue
            prompt = tracked.request.num_prompt_tokens
            loaded = tracked.report["cachetier_hit_tokens"]  # what the pool already holds
            by_boundary: dict[int, dict[int, int]] = defaultdict(dict)
            for group, block, boundary in entries:
                by_boundary[boundary][group] = block
            for boundary in sorted(by_boundary):
                states = by_boundary[boundary]
                if (boundary % self.block or boundary > prompt
                        or boundary <= max(tracked.saved_boundary, loaded)
                        or any(g not in states for g in linear)):
                    continue
                blocks = boundary // self.block
                jobs.append(SaveJob(rid, boundary, prompt, tracked.hashes[:blocks * width],
                                    [states[g] for g in linear],
                                    tuple(list(ids) for ids in block_ids)))
                tracked.saved_boundary = boundary
                tracked.report["cachetier_saved_boundaries"] += 1
        return jobs

    # -- the end of a request --------------------------------------------------------------------

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Unpins the request's hit; returns what the connector did for it, which vLLM hands
        back in `RequestOutput.kv_transfer_params`: the hit it loaded, the boundaries saved,
        and this engine's connector totals so far (steps, time, failures)."""
        with self._timed():
            tracked = self._tracked.pop(request.request_id, None)
            if tracked is None:
                return None
            self._release(tracked)
        return {**tracked.report, **self.totals()}

    def add_worker_report(self, report: WorkerReport) -> None:
        self.workers = self.workers.aggregate(report)

    def totals(self) -> dict[str, Any]:
        return {"cachetier_engine": self.settings.engine_id, "cachetier_steps": self.steps,
                "cachetier_scheduler_ms": round(1000 * self.busy_s, 3),
                "cachetier_restore_ms": round(self.workers.restore_ms, 3),
                "cachetier_save_ms": round(self.workers.save_ms, 3),
                "cachetier_failed_loads": self.workers.failed_loads,
                "cachetier_failed_saves": self.workers.failed_saves,
                "cachetier_cow_copies": self.workers.cow_copies,
                "cachetier_cow_ms": round(self.workers.cow_ms, 3),
                "cachetier_lookups": self.lookups,
                "cachetier_lookup_failures": self.lookup_failures}

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - begin

    def _release(self, tracked: _Tracked) -> None:
        """Unpin now, in the background (releasing an unknown reader is harmless); a lookup still
        in flight is released once it lands, so a request ended meanwhile leaks no pin."""
        if tracked.lookup is None:
            return
        reader = self._reader(tracked.request.request_id)
        if tracked.pinned is None:
            tracked.lookup.add_done_callback(lambda _: self._unpin(reader))
            return
        if tracked.pinned.hit_tokens == 0:
            return
        tracked.pinned = PinnedPrefix(reader, tracked.pinned.epoch, 0, [], [])
        self._unpin(reader)

    def _unpin(self, reader: str) -> None:
        future = self.tier.submit(lambda c: c.release(self.settings.pool, [reader]))
        future.add_done_callback(_log_failure(f"release of {reader}"))

    # -- namespaces ------------------------------------------------------------------------------

    def _root(self, request: Any) -> bytes:
        salt = getattr(request, "cache_salt", None) or ""
        lora = getattr(request, "lora_request", None)
        adapter = lora.lora_name if lora is not None else ""
        key = (salt, adapter)
        if key not in self._roots:
            self._roots[key] = namespace_root(self.settings.model_id, salt, adapter,
                                              self.config.cache.hash_algo)
        return self._roots[key]

    def _reader(self, rid: str) -> str:
        return f"{self.settings.engine_id}/{rid}"


def _log_failure(what: str) -> Any:
    def report(future: concurrent.futures.Future[Any]) -> None:
        if future.exception() is not None:
            log.warning("cachetier %s failed: %s", what, future.exception())
    return report
