"""What the scheduler-side connector tells the workers each step (vLLM pickles it across)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)


@dataclass(frozen=True)
class LoadJob:
    """Restore a pinned hit into the request's vLLM blocks before its first forward pass.

    Tokens `[local_tokens, hit_tokens)` of every attention group come from `mla_pages`
    (`[attention group][slot]`); the state at `hit_tokens` of every linear group comes from
    `checkpoint_pages` into the block vLLM reads it from, the one of the hit's last token.
    `block_ids` is the request's table per vLLM group, in the engine's group order."""

    rid: str
    hit_tokens: int
    local_tokens: int
    epoch: int
    mla_pages: list[list[int]]
    checkpoint_pages: list[int]
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True)
class SaveJob:
    """Persist the prefix `[0, boundary)` of a request whose forward pass in this step leaves the
    state at `boundary` in `state_blocks` (one per linear group, as vLLM's align mode offers
    them); the attention rows come from its current `block_ids`."""

    rid: str
    boundary: int
    prompt_tokens: int
    hashes: bytes
    state_blocks: list[int]
    block_ids: tuple[list[int], ...]


@dataclass
class CacheTierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """What the workers did since their last report, summed over ranks by vLLM (`aggregate`)."""

    restore_ms: float = 0.0
    save_ms: float = 0.0
    failed_loads: int = 0
    failed_saves: int = 0
    cow_copies: int = 0  # vLLM's mid-block block copies the connector completed (`cow`)
    cow_ms: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        assert isinstance(other, WorkerReport)
        return WorkerReport(self.restore_ms + other.restore_ms, self.save_ms + other.save_ms,
                            self.failed_loads + other.failed_loads,
                            self.failed_saves + other.failed_saves,
                            self.cow_copies + other.cow_copies, self.cow_ms + other.cow_ms)
