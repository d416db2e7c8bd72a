"""cachetier's cache events in vLLM's KV-events format, for routers written against vLLM.

A pure conversion, one cachetier `EventBatch` to one vLLM `KVEventBatch`, built from vLLM's own
msgspec structs (`vllm.distributed.kv_events`), so the bytes a router decodes with
`msgspec.msgpack.Decoder(KVEventBatch)` are vLLM's by construction. What a router sees, field by
field:

- `block_hashes`, `parent_block_hash`: cachetier's chained hashes as bytes (vLLM's
  `ExternalBlockHash` is `bytes | int`), not vLLM's own block hashes of the same tokens: a router
  must hash prompts as cachetier does (`index.hashing.chain_hashes` from the namespace root, at
  `block_size` tokens) to look them up.
- `token_ids`: always `[]`. The index keeps hashes only, so cachetier's events carry no tokens;
  vLLM's own offloading paths send `[]` likewise when they have no token metadata. A router that
  derives its keys from `token_ids` cannot use these events.
- `block_size`: the pool's hash block (tokens per hash), as the cachetier event says.
- `lora_id`, `lora_name`, `extra_keys`: None. cachetier folds the namespace (model, tenant salt,
  adapter) into the chain's root hash, so the hashes already differ per adapter.
- `medium`: `MEDIUM_GPU`: a pool's pages are the agents' device memory (CPU agents, as in the
  tests and `cachetier up`, are reported as GPU all the same: `VllmEventMapping.medium` says
  otherwise); `ownership`: `cachetier/<pool>`, vLLM's field for the secondary tier an event comes
  from, which also tells the pools of one stream apart; `locality`: None (unspecified): the
  publisher is this converter, not an engine, so "local to the publisher" has no answer.
- Groups: cachetier stores and evicts a page set whole, every group of a kind at once, so the
  stream has two groups: `group_idx` 0 for full attention (`kv_cache_spec_kind` "mla_attention"
  or "full_attention", as the model's `attention_kind` is MLA or GQA) and 1 for the
  linear-attention checkpoints (KDA or Gated DeltaNet: "mamba", the spec kind vLLM gives them).
  Stores carry the kind, removals only the group, as vLLM's do. A checkpoint is one group-1 block
  whose hash is the full-attention hash of the block it ends: the linear state after that whole
  prefix, with no parent (it is no link of a chain, and the hash names the whole prefix). A
  hybrid prefix hit resumes at a checkpoint, so a router scores a prompt by its deepest block
  stored in group 1 whose group-0 chain up to it is stored too.
- `AllBlocksCleared`: vLLM's has no fields, so the pool's new epoch is dropped.
- `ts` is kept; `data_parallel_rank` is left None, for the publisher to fill in. The batch's
  sequence number is the publisher's (vLLM numbers batches when it sends them), not cachetier's.

A cachetier batch lost upstream (a seq gap) or one this mapping cannot express becomes an
`AllBlocksCleared` first: vLLM's only way to tell a consumer that its view is stale (`vllm_batch`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Self

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVEventBatch
from vllm.v1.kv_cache_interface import KVCacheSpecKind

from cachetier.config import ModelSpec
from cachetier.events.cache_events import (AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent,
                                           EventBatch)

log = logging.getLogger(__name__)

VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared
GROUP_OF_KIND = {"mla": 0, "kda": 1}  # cachetier's cache kind -> the stream's group_idx
_FULL_ATTENTION_SPEC = {"mla": KVCacheSpecKind.MLA_ATTENTION, "gqa": KVCacheSpecKind.FULL_ATTENTION}


def ownership(pool: str) -> str:
    """The `ownership` of a pool's events: which cachetier pool they describe."""
    return f"cachetier/{pool}"


@dataclass(frozen=True)
class VllmEventMapping:
    """What the cachetier events do not say but vLLM's do: the spec kind of each group and the
    medium. `for_model` reads the kinds from the pool's model."""

    full_attention_kind: str = KVCacheSpecKind.MLA_ATTENTION.value
    linear_kind: str = KVCacheSpecKind.MAMBA.value
    medium: str = MEDIUM_GPU

    @classmethod
    def for_model(cls, model: ModelSpec) -> Self:
        return cls(full_attention_kind=_FULL_ATTENTION_SPEC[model.attention_kind].value)

    def spec_kind(self, kind: str) -> str:
        return self.full_attention_kind if kind == "mla" else self.linear_kind


def to_vllm(batch: EventBatch, mapping: VllmEventMapping) -> KVEventBatch:
    """The batch's events as vLLM's, in order; ValueError for an event that names one group of a
    kind (cachetier's own events never do: page sets are stored and evicted whole)."""
    return KVEventBatch(ts=batch.ts, events=[_event(e, batch.pool, mapping)
                                             for e in batch.events])


def vllm_batch(batch: EventBatch, missed: int, mapping: VllmEventMapping) -> KVEventBatch:
    """What the vLLM stream says for a received batch: an `AllBlocksCleared` first when batches
    were lost just before it (`missed`, from `SequenceTracker`), since the consumer's view may
    hold blocks that a lost batch removed; and only that when the batch cannot be expressed, for
    the same reason. Clearing errs on the safe side: the consumer then misses blocks still
    stored (until they are stored again) rather than routing to blocks that are gone."""
    try:
        converted = to_vllm(batch, mapping)
    except ValueError as exc:
        log.warning("pool %s batch %d cleared in the vLLM stream: %s", batch.pool, batch.seq, exc)
        return KVEventBatch(ts=batch.ts, events=[VllmAllBlocksCleared()])
    if missed:
        converted.events.insert(0, VllmAllBlocksCleared())
    return converted


def _event(event: CacheEvent, pool: str, mapping: VllmEventMapping) -> VllmEvent:
    if isinstance(event, AllBlocksCleared):
        return VllmAllBlocksCleared()
    if event.group_idx is not None:
        raise ValueError(f"a {type(event).__name__} of {event.kind} group {event.group_idx} alone "
                         "has no group in the vLLM stream")
    group = GROUP_OF_KIND[event.kind]
    if isinstance(event, BlockRemoved):
        return VllmBlockRemoved(block_hashes=list(event.block_hashes), medium=mapping.medium,
                                group_idx=group, ownership=ownership(pool))
    assert isinstance(event, BlockStored)
    return VllmBlockStored(
        block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
        token_ids=[], block_size=event.block_size, lora_id=None, medium=mapping.medium,
        lora_name=None, group_idx=group, kv_cache_spec_kind=mapping.spec_kind(event.kind),
        ownership=ownership(pool))
