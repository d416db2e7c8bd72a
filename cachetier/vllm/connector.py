"""`CacheTierConnector`: cachetier as vLLM's KV connector for hybrid (GDN + GQA) models and for
full-attention ones (GQA or MLA).

    KVTransferConfig(kv_connector="CacheTierConnector", kv_connector_module_path="cachetier.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

vLLM builds it twice: in the scheduler (`ConnectorScheduler`: lookups, pins, save planning) and in
each worker (`ConnectorWorker`: the copies and the saves' commits). Both refuse to start, with a
message naming every difference, when the engine does not match the pool: another model (its
fingerprint), another geometry (groups, heads, dims, dtypes, block size, hash unit, tensor-
parallel degree: each rank's worker maps its own rank's agent, `ranks`), prefix caching off
(vLLM turns it off itself for MLA on a CPU without AMX, whose MLA kernels cannot resume from a
cached prefix), a hybrid's mamba cache mode other than align (the saves need vLLM's boundary
states), or, on CPU, a GQA kernel whose block layout the copies do not read
(`kv_copy.CPU_ATTENTION_ISAS`: vec, vec16 and amx, which packs K and V in tiles; the worker views
its blocks by the kernel the engine picked). Each worker also completes vLLM 0.32's copy-on-write
of mid-block local hits, which leaves part of a hybrid's attention block behind, and refuses a
vLLM whose copy it cannot vouch for (`cow`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.v1.kv_cache_interface import MambaSpec

from cachetier.config import Config
from cachetier.vllm.cow import CowCorrection, protect
from cachetier.vllm.geometry import (GeometryMismatch, geometry_differences, model_fingerprint,
                                     model_spec_from_vllm)
from cachetier.vllm.jobs import CacheTierMetadata, WorkerReport
from cachetier.vllm.kv_copy import CPU_ATTENTION_ISAS
from cachetier.vllm.ranks import engine_ranks
from cachetier.vllm.scheduler_side import ConnectorScheduler
from cachetier.vllm.settings import ConnectorSettings
from cachetier.vllm.tier_thread import TierThread
from cachetier.vllm.worker_side import ConnectorWorker, read_handle

log = logging.getLogger("cachetier.vllm")


class CacheTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config,
                                                       engine_id=transfer.engine_id)
        config, attention_isa = _checked_config(settings, vllm_config, kv_cache_config)
        groups = ["linear" if isinstance(g.kv_cache_spec, MambaSpec) else "full"
                  for g in kv_cache_config.kv_cache_groups]
        cow = None if role == KVConnectorRole.SCHEDULER else self._protect_copy_on_write(config)
        self._tier = TierThread(settings.service, settings.token, timeout_s=settings.timeout_s)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(settings, config, groups, self._tier)
        else:
            self._worker = ConnectorWorker(settings, config, groups,
                                           [list(g.layer_names)
                                            for g in kv_cache_config.kv_cache_groups],
                                           self._tier, engine_ranks(config.model.tp_degree),
                                           attention_isa, cow)

    def _protect_copy_on_write(self, config: Config) -> CowCorrection | None:
        """vLLM's own copies of mid-block local hits, completed where they are not whole
        (`cow.protect`, which refuses a vLLM it cannot vouch for): this engine's local hits are
        served, and saved into the tier, as computed."""
        return protect(config.cache.hash_block_tokens, config.cache.page_tokens)

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole before the forward pass starts (`start_load_kv` returns after them)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves run once per step, after the pass (`wait_for_save`): a boundary state is whole
        only once every layer ran."""

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The loads this step ended: a failed one is also ended, so its request leaves its wait
        and vLLM recomputes it (`kv_load_failure_policy="recompute"`)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        ended, failed = self._worker.take_load_results()
        return KVConnectorTransferResults(finished_recving=ended, failed_recving=failed)

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        self._tier.close()

    def _metadata(self) -> CacheTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheTierMetadata)
        return meta

    # -- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            self._scheduler.add_worker_report(report)
        for rid in connector_output.failed_recving or ():
            self._scheduler.load_failed(rid)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        assert self._scheduler is not None
        return False, self._scheduler.request_finished(request)


def _checked_config(settings: ConnectorSettings, vllm_config: Any,
                    kv_cache_config: Any) -> tuple[Config, str | None]:
    """The pool's configuration, once the engine is shown to match it (else `GeometryMismatch`),
    and the engine's CPU attention kernel (None off CPU)."""
    handle, _ = read_handle(settings.handle_file_of(0))  # every rank's pool has one geometry
    pool = Config(handle.model, handle.cache)
    cache_config = vllm_config.cache_config
    problems = []
    fingerprint = model_fingerprint(vllm_config.model_config.model)
    if fingerprint != settings.model_id:
        problems.append(f"model: engine serves {vllm_config.model_config.model} (fingerprint "
                        f"{fingerprint}), pool {settings.pool} holds model {settings.model_id}")
    tp = vllm_config.parallel_config.tensor_parallel_size
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        problems.append(f"pipeline_parallel_size: engine {pp}; the connector serves pipeline "
                        "size 1 (a worker holding only some layers cannot save whole states)")
    engine_model = model_spec_from_vllm(kv_cache_config, tp)
    if not cache_config.enable_prefix_caching:
        problems.append("enable_prefix_caching: engine False, the connector needs it on (vLLM "
                        "turns it off for MLA on a CPU without AMX: those kernels cannot resume "
                        "from a cached prefix)")
    if engine_model.kda_groups and cache_config.mamba_cache_mode != "align":
        problems.append(f"mamba_cache_mode: engine {cache_config.mamba_cache_mode!r}, the "
                        "connector needs 'align'")
    isa = _cpu_attention_isa(vllm_config, engine_model)
    if isa is not None and isa not in CPU_ATTENTION_ISAS:
        problems.append(f"CPU attention kernel: engine {isa!r}, whose KV block layout the "
                        f"connector does not read (it reads {', '.join(CPU_ATTENTION_ISAS)})")
    hash_unit = cache_config.prefix_match_unit or cache_config.block_size
    problems += geometry_differences(pool, engine_model, cache_config.block_size, hash_unit)
    if problems:
        raise GeometryMismatch(f"cachetier refuses this engine for pool {settings.pool}: "
                               + "; ".join(problems))
    return pool, isa


def _cpu_attention_isa(vllm_config: Any, engine_model: Any) -> str | None:
    """The kernel family vLLM's CPU attention backend picks for this GQA engine (it decides how a
    KV block is laid out), or None off CPU and for MLA (one layout on every backend)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or engine_model.attention_kind == "mla":
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(getattr(torch, engine_model.mla_dtype),
                         vllm_config.cache_config.block_size, engine_model.gqa_head_dim,
                         vllm_config.cache_config.cache_dtype)
