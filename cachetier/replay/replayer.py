"""`cachetier replay`: a request trace served through the real index, one pool per replay runner.

`tests/policy_model.py` restates the index's rules to pin the runners' conventions down; this
module measures the index itself (Redis, the production Lua scripts, `PrefixIndex`), so the figures it
reports are those of the code that runs, and the tests compare the two.

A request is served the way the engine serves it, minus the bytes: `plan_step` (lookup, pins,
eviction, allocation) for each chunk of its prefill, `commit` of what the pass produced (endpoints,
and the checkpoint the `CheckpointPlacement` keeps or not), `confirm` of the commit's ticket, and
`release` once the prompt is done. There is no agent, so the plan's copies are not run and its
ticket is not confirmed on its own: `commit` drops the restore pins (as it does for a plan never
confirmed) and confirmation is cumulative per request, so the commit's confirm settles both.
Requests are served one after the other in timestamp order (stable), each one's registrations
visible to the next: the convention that reproduces the issue's figures (see
`tests/policy_model.py`).

Replay runners are configurations of the real code (`runners.RUNNERS`, which also drives them): a
pool configuration, an eviction policy and a `CheckpointPlacement`, or the adaptive runner; each
gets a pool of its own in the same Redis. Capacity is a budget in bytes of the preset, counted in
unified page ids (padding included): `num_pages = budget // page_id_bytes`. Unlimited is a page
count nothing can exhaust: the free list is lazy (ids >= `fresh` are never materialised), so it
costs nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Protocol

from redis.asyncio import Redis

from cachetier.config import Config, ConfigError
from cachetier.engine.checkpoint_placement import CheckpointPlacement
from cachetier.replay.traces import BLOCK_TOKENS, TraceRequest, block_tokens_for
from eviction.policy import EvictionWeights, lru
from index.hashing import HashAlgo, chain_hashes, hash_len, namespace_root
from index.lifecycle import RequestLifecycle
from index.records import StepPlan, StepRefusal
from index.store import PrefixIndex

UNLIMITED_PAGES = 2**40  # never reached: 2**40 page ids of kimi-k3 would be 179 EB
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}


class ReplayError(RuntimeError):
    """The replay cannot run as asked (a replay runner that is not available, a budget too
    small)."""


def parse_budget(text: str) -> int | None:
    """Bytes of a size such as `400GB`, `1.6TB`, `512GiB` or `12345` (GB = 1e9, GiB = 2**30);
    None for `unlimited`."""
    clean = text.strip().upper()
    if clean == "UNLIMITED":
        return None
    number = clean.rstrip("BKMGTPI")
    unit = clean[len(number):] or "B"
    try:
        value = Decimal(number) * _UNITS[unit]
    except (InvalidOperation, KeyError):
        value = None
    if value is None or not value.is_finite():
        raise ValueError(f"bad budget {text!r}: expected a size such as 400GB, 1.6TB, 512GiB "
                         "or 'unlimited'")
    if value < 1:
        raise ValueError(f"bad budget {text!r}: must be at least one byte")
    return int(value)


def budget_pages(budget_bytes: int | None, config: Config) -> int:
    """Unified page ids a byte budget buys; `UNLIMITED_PAGES` for None."""
    if budget_bytes is None:
        return UNLIMITED_PAGES
    pages = budget_bytes // config.geometry.page_id_bytes
    if pages < 1:
        raise ReplayError(f"a budget of {budget_bytes} bytes buys no page: one page id of preset "
                          f"{config.model.name} holds {config.geometry.page_id_bytes} bytes")
    return pages


# -- records ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServedRequest:
    input_tokens: int
    hit_tokens: int
    match_tokens: int  # the MLA match at lookup: what a checkpoint there would have served
    steps: int
    refused: bool = False  # a step was refused: the pool could not hold the request


@dataclass(frozen=True)
class PolicyCounters:
    checkpoints_written: int  # commits whose checkpoint was registered
    checkpoints_alive: int  # in the pool at the end
    checkpoint_bytes: int  # what the alive ones hold, padding included
    evictions: int  # entries (endpoints and checkpoints) the plans evicted


@dataclass(frozen=True)
class PolicyResult:
    name: str
    served: list[ServedRequest]
    counters: PolicyCounters
    budget_pages: int | None  # None: unlimited
    wall_s: float

    @property
    def input_tokens(self) -> int:
        return sum(s.input_tokens for s in self.served)

    @property
    def hit_tokens(self) -> int:
        return sum(s.hit_tokens for s in self.served)

    @property
    def hit_ratio(self) -> float:
        """Token-weighted: prefill tokens served from the cache over all prompt tokens."""
        total = self.input_tokens
        return self.hit_tokens / total if total else 0.0


@dataclass(frozen=True)
class BudgetResult:
    budget_bytes: int | None
    policies: dict[str, PolicyResult]
    wall_s: float


# -- prompts ---------------------------------------------------------------------------------------

class PromptHashes:
    """Chained hashes of the trace's synthesised prompts, memoised per trace hash id.

    Trace ids are prefix-chained, so the chained hash of an index block is a function of the trace
    id at its end: each id's tokens are synthesised and hashed once, for all requests sharing it
    and all pools (the Mooncake trace has 43,924 distinct ids among 121,877 blocks). One instance
    serves one trace: ids of different traces mean different prefixes."""

    def __init__(self, model_id: str, algo: HashAlgo) -> None:
        self.root = namespace_root(model_id, algo=algo)
        self.algo = algo
        self._memo: dict[tuple[int, int], bytes] = {}  # (block tokens, trace id at its end) -> hash

    def hashes(self, request: TraceRequest, block_tokens: int) -> bytes:
        """One hash per complete `block_tokens` block of the prompt (a multiple of the trace's)."""
        ratio = block_tokens // BLOCK_TOKENS
        blocks = request.input_length // block_tokens
        ends = request.hash_ids[ratio - 1:blocks * ratio:ratio]
        known = 0
        while known < blocks and (block_tokens, ends[known]) in self._memo:
            known += 1
        if known < blocks:
            root = self._memo[block_tokens, ends[known - 1]] if known else self.root
            tokens = block_tokens_for(request.hash_ids[known * ratio:blocks * ratio]).reshape(-1)
            blob = chain_hashes(tokens, root, block_tokens, self.algo)
            width = hash_len(self.algo)
            for n, j in enumerate(range(known, blocks)):
                self._memo[block_tokens, ends[j]] = blob[n * width:(n + 1) * width]
        return b"".join(self._memo[block_tokens, h] for h in ends)


# -- runners ---------------------------------------------------------------------------------------

class PolicyRunner(Protocol):
    """One replay runner's cache, asked to serve the trace's requests one at a time."""

    name: str

    async def setup(self, redis: Redis) -> None:
        """Create the runner's pool(s) on `redis`."""

    async def serve(self, request: TraceRequest) -> ServedRequest:
        """Serve one request, all its steps, and release it."""

    async def counters(self) -> PolicyCounters:
        """What the runner's pool(s) hold and did, once the trace is served."""


class PoolRunner:
    """One pool of the real index with one `CheckpointPlacement`: a `PolicyRunner`, and the building
    block of runners made of several pools."""

    def __init__(self, name: str, redis: Redis, pool_id: str, config: Config,
                 weights: EvictionWeights, policy: CheckpointPlacement, chunk_tokens: int, *,
                 prompts: PromptHashes | None = None) -> None:
        """`prompts` lets pools replaying one trace share the hashing of its prompts."""
        if config.cache.hash_block_tokens % BLOCK_TOKENS:
            raise ConfigError("cache.hash_block_tokens", f"{config.cache.hash_block_tokens} is not "
                              f"a multiple of the trace's {BLOCK_TOKENS}-token blocks")
        if chunk_tokens < 1:
            raise ConfigError("replay.chunk", f"must be >= 1, got {chunk_tokens}")
        self.name = name
        self.config = config
        self.index = PrefixIndex(redis, pool_id, config, weights)
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.prompts = prompts or PromptHashes(config.model.name, config.cache.hash_algo)
        self._serial = itertools.count()
        self._written = 0
        self._evictions = 0

    async def setup(self, redis: Redis) -> None:
        if redis is not self.index.redis:
            raise ValueError(f"{self.name}: its pool lives on the client it was built with")
        await self.index.create()

    async def serve(self, request: TraceRequest) -> ServedRequest:
        rid = f"r{next(self._serial)}"
        length, block = request.input_length, self.config.cache.hash_block_tokens
        hashes = self.prompts.hashes(request, block)
        steps = 0
        async with RequestLifecycle(self.index) as lifecycle:  # no agent: nothing to settle
            plan = await lifecycle.plan(
                [self.policy.first_step(rid, self.chunk_tokens, length, hashes, block,
                                        self.config.cache.page_tokens)])
            if isinstance(plan, StepRefusal):  # nothing was planned: served without the cache
                return ServedRequest(length, 0, 0, 0, refused=True)
            first = plan.requests[0]
            while isinstance(plan, StepPlan):
                self._evictions += plan.evicted
                step = plan.requests[0]
                item = self.policy.commit_item(step, length, block, self.config.cache.page_tokens)
                committed = await lifecycle.finish([item])
                self._written += committed.requests[0].checkpoint == "registered"
                steps += 1
                if step.stop == length:
                    break
                plan = await lifecycle.plan([self.policy.next_step(
                    rid, self.chunk_tokens, length, self.config.cache.page_tokens)])
            refused = isinstance(plan, StepRefusal)
        return ServedRequest(length, first.hit_tokens, first.match_tokens, steps, refused)

    async def counters(self) -> PolicyCounters:
        alive = (await self.index.stats()).checkpoints
        pooled = self.config.model.kda_groups * self.config.geometry.page_id_bytes
        return PolicyCounters(self._written, alive, alive * pooled, self._evictions)


# -- replay runners --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayContext:
    """What the runners of one replay share: the server, the preset sized to the budget (its
    `num_pages`), the chunk size, the prompts' hashes, and a prefix naming this replay's pools."""

    redis: Redis
    config: Config
    chunk_tokens: int
    prompts: PromptHashes
    pool_prefix: str = "replay"

    def pool_id(self, name: str) -> str:
        return f"{self.pool_prefix}.{name}"

    def pool(self, name: str, config: Config, policy: CheckpointPlacement,
             weights: EvictionWeights | None = None) -> PoolRunner:
        return PoolRunner(name, self.redis, self.pool_id(name), config, weights or lru(), policy,
                          self.chunk_tokens, prompts=self.prompts)


def full_attention(config: Config) -> Config:
    """The same pool without KDA groups: every MLA match is a hit, no checkpoint is planned."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, kda_groups=0))


def coupled(config: Config) -> Config:
    """Hash block = page: the classic prefix cache, whose checkpoints can only sit at page ends."""
    return dataclasses.replace(config, cache=dataclasses.replace(
        config.cache, hash_block_tokens=config.cache.page_tokens))


def unlimited(config: Config) -> Config:
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                 num_pages=UNLIMITED_PAGES))
