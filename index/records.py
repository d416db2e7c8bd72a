"""What a scheduler hands the index and gets back: small frozen records, never Redis keys.

Page tables are indexed [group][slot]: one page id per cache group for every `page_tokens` of the
prompt, as vLLM's `KVCacheBlocks` does, so a worker can read its group's pages without knowing how
page sets are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eviction.policy import CheckpointClass, CheckpointKind


@dataclass(frozen=True)
class StepRequest:
    """One request of a scheduling step. New requests carry their prompt's chained hashes (one per
    complete hash block); a request already planned before continues its prefill without them.

    The `stop_at_*` switches let the index cut the step short where a checkpoint is worth
    keeping, which only it can know on a request's first step (the hit decides where it starts):
    `stop_at_match` ends the step at the end of the request's MLA match when that lies beyond the
    hit (a branch point: the next request sharing this prefix then hits at full depth),
    `stop_at_page_end` ends it at the next physical page end (a rung of the checkpoint ladder),
    `stop_at_last_page_end` at the prompt's deepest page end before its last token, when the
    step starts before it (the one rung worth a checkpoint's bytes when the budget is tight), and
    `stop_at_resend_point` one hash block before the end of a prompt that ends on a hash-block
    boundary, when the step starts before that (a hit leaves a token to compute, so an exact
    resend of such a prompt can hit there and not at its turn end).

    `turn_end_kind` is the class the caller's policy keeps the checkpoint at the deepest boundary
    a hit can reach, `(P - 1) // B * B`, as (the prompt's turn end, or its resend point when the
    prompt is block-aligned), None when it keeps none there. It matters when the hit lands
    exactly on that boundary: the one it restores from *is* that kept checkpoint, and the index
    promotes it to this class if it is an intermediate or superseded one, as a duplicate commit
    of that class would (otherwise the request that wrote it as its intermediate recycles it),
    and leaves it in its class when the request completes.
    """

    rid: str
    compute_tokens: int
    prompt_tokens: int | None = None
    hashes: bytes | None = None
    checkpoint: bool = True
    stop_at_match: bool = False
    stop_at_page_end: bool = False
    stop_at_last_page_end: bool = False
    stop_at_resend_point: bool = False
    turn_end_kind: CheckpointKind | None = None

    def __post_init__(self) -> None:
        if self.turn_end_kind == "intermediate":
            raise ValueError(f"{self.rid}: a turn end is kept, never intermediate")

    @property
    def is_new(self) -> bool:
        return self.hashes is not None


@dataclass(frozen=True)
class PageCopy:
    """Copy `nbytes` at `offset` of every layer slot of page `src` into page `dst`."""

    src: int
    dst: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RequestPlan:
    rid: str
    hit_tokens: int
    start: int
    stop: int
    mla_pages: list[list[int]]
    state_pages: list[int]
    checkpoint_pages: list[int]
    checkpoint_tokens: int
    copies: list[PageCopy]
    match_tokens: int = 0  # the MLA match found at lookup (>= hit_tokens; deeper when no checkpoint)

    def written_pages(self, page_tokens: int) -> list[int]:
        """The pages this step of the request writes (what its step claims for it,
        `gpu_pool.claims`): its MLA pages from the one holding its start (its own: a hit
        ending inside a page was copied to a page of its own), its private state and its
        checkpoint pages."""
        first = self.start // page_tokens
        mla = [page for group in self.mla_pages for page in group[first:]]
        return [*mla, *self.state_pages, *self.checkpoint_pages]


@dataclass(frozen=True)
class Removal:
    kind: Literal["ep", "ck"]
    block_hash: bytes


@dataclass(frozen=True)
class StepPlan:
    ticket: int
    epoch: int
    requests: list[RequestPlan]
    evicted: int
    removed: list[Removal] = field(default_factory=list)


@dataclass(frozen=True)
class StepRefusal:
    """The pool cannot serve this step now; nothing was changed."""

    reason: str
    pages_needed: int
    pages_available: int


@dataclass(frozen=True)
class CommitItem:
    """`kind` is the checkpoint's class (`eviction.policy`: the pool's weights value each class):
    an `intermediate` one is recycled when the request's next checkpoint is registered, the
    others are kept. Callers that only know kept or not say `durable` (kept: a `turn`); with a
    kind, `durable` follows it. `superseded` is not committed: the index demotes a turn end to it
    once a later request resumed from it and went past."""

    rid: str
    stop: int
    checkpoint_tokens: int = 0
    durable: bool = False
    kind: CheckpointKind | None = None

    def __post_init__(self) -> None:
        if self.kind is not None:
            if self.durable and self.kind == "intermediate":
                raise ValueError(f"{self.rid}: a durable checkpoint cannot be intermediate")
            object.__setattr__(self, "durable", self.kind != "intermediate")

    @property
    def checkpoint_class(self) -> CheckpointClass:
        if self.kind is not None:
            return self.kind
        return "turn" if self.durable else "intermediate"


@dataclass(frozen=True)
class CommittedRequest:
    """`block_hashes` is the chain of hashes the commit processed, each one block past the one
    before and the first one past `parent_hash` (None at the namespace root): what the cache
    holds for this request now (matchable once the ticket is confirmed), for cache events."""

    rid: str
    endpoints: int
    checkpoint: Literal["none", "registered", "duplicate", "unanchored"]
    block_hashes: list[bytes] = field(default_factory=list)
    parent_hash: bytes | None = None
    checkpoint_hash: bytes | None = None


@dataclass(frozen=True)
class CommitResult:
    ticket: int
    requests: list[CommittedRequest]
    removed: list[Removal] = field(default_factory=list)


@dataclass(frozen=True)
class ReleaseResult:
    released: int
    unknown: list[str]
    removed: list[Removal] = field(default_factory=list)


@dataclass(frozen=True)
class EvictResult:
    evicted: int
    removed: list[Removal] = field(default_factory=list)


@dataclass(frozen=True)
class IndexStats:
    """Counters of one pool, kept by the scripts as they change it (reading them is O(1))."""

    epoch: int
    num_pages: int
    free_pages: int
    evictable_pages: int
    requests: int
    pending_tickets: int
    checkpoints: int  # registered in every KDA group (one record each)
    durable_checkpoints: int  # of a kept class (any but intermediate): meta.durable_cks
