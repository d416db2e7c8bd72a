"""`PrefillScheduler`: serves multi-turn sessions through the tier the way an inference engine does.

Each scheduling step plans every request in flight in one call (the service pins the hits, runs
the restore copies on the agents and answers with page tables), runs the forward pass of each
request's chunk from where its plan starts, reading and writing only pool pages, then commits what
the pass produced (MLA endpoints, the checkpoint of the `CheckpointPlacement`) and confirms it. A
request's first step starts at its cache hit; later steps continue its chunked prefill. A
session's next turn is sent once its previous turn is done, after its think time, so sessions
interleave within steps and later turns hit what earlier ones left. The steps go through
`index.lifecycle.RequestLifecycle` over the pool's `TierPool`, so a run that fails (a refused
single request, a forward pass that raises) releases every request it had in flight. The pass
writes under each rank's epoch fence (`PagedPool.writing`): a step whose epoch an agent has
fenced off since its plan fails with `StaleOrder` instead of writing pages handed out anew.

With `verify`, every finished request's outputs (those it computed, from the hit on) are compared
with a cold recompute of the same tokens: the oracle that says the cache served exactly the state
of its declared prefix. A mismatch is counted and reported, never raised, so a run shows all of
them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cachetier.client import CacheTierClient
from cachetier.config import Config
from cachetier.engine.checkpoint_placement import CheckpointPlacement
from cachetier.engine.sessions import Session
from gpu_pool.pool import PagedPool
from index.hashing import chain_hashes, namespace_root
from index.lifecycle import RequestLifecycle
from index.records import CommitItem, RequestPlan, StepPlan, StepRefusal, StepRequest
from index.tickets import write_stamp
from tinymodel import ChunkRequest, TinyHybrid, outputs_match


class EngineError(RuntimeError):
    """The tier refused a step even for a single request: the pool is too small for it."""


@dataclass(frozen=True)
class RequestResult:
    rid: str
    session: str
    turn: int
    prompt_tokens: int
    hit_tokens: int
    match_tokens: int  # the MLA match at lookup: what a checkpoint there would have served
    steps: int
    finished_step: int
    verified: bool | None  # None: verification off
    max_abs_error: float


@dataclass
class _InFlight:
    rid: str
    session: Session
    turn: int
    tokens: np.ndarray
    pos: int = 0
    hit: int = -1  # known after the first step
    match: int = 0
    steps: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pos == len(self.tokens)


@dataclass(order=True)
class _Arrival:
    step: int
    order: int
    session: Session = field(compare=False)
    turn: int = field(compare=False)


class PrefillScheduler:
    def __init__(self, tier: CacheTierClient, pool_id: str, config: Config,
                 policy: CheckpointPlacement, model: TinyHybrid, ranks: Sequence[PagedPool], *,
                 chunk_tokens: int = 64, max_batch: int = 16, verify: bool = True,
                 on_result: Callable[[RequestResult], None] | None = None) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.tier = tier
        self.pool_id = pool_id
        self.config = config
        self.policy = policy
        self.model = model
        self.ranks = list(ranks)  # every tensor-parallel rank's pool, attached, in rank order
        self.chunk_tokens = chunk_tokens
        self.max_batch = min(max_batch, config.cache.max_batch)
        self.verify = verify
        self.on_result = on_result or (lambda result: None)
        self.block = config.cache.hash_block_tokens
        self.root = namespace_root(config.model.name, algo=config.cache.hash_algo)
        self.step_count = 0
        self._serial = 0
        self._reference: dict[str, torch.Tensor] = {}

    async def run(self, sessions: Sequence[Session]) -> list[RequestResult]:
        """Serve every turn of every session; session `n` sends its first turn at step `n`, so
        later sessions find what earlier ones cached while both are in flight."""
        order = itertools.count()
        arrivals = sorted(_Arrival(n + s.think_steps[0], next(order), s, 0)
                          for n, s in enumerate(sessions))
        active: list[_InFlight] = []
        results: list[RequestResult] = []
        async with RequestLifecycle(self.tier.pool(self.pool_id)) as steps:
            while arrivals or active:
                while (arrivals and arrivals[0].step <= self.step_count
                       and len(active) < self.max_batch):
                    a = arrivals.pop(0)
                    active.append(self._start(a.session, a.turn))
                if not active:
                    self.step_count = arrivals[0].step
                    continue
                for request in await self._step(steps, active):
                    active.remove(request)
                    result = self._finish(request)
                    results.append(result)
                    self.on_result(result)
                    nxt = request.turn + 1
                    if nxt < len(request.session.prompts):
                        wait = request.session.think_steps[nxt]
                        arrivals.append(_Arrival(self.step_count + wait, next(order),
                                                 request.session, nxt))
                        arrivals.sort()
        return results

    def _start(self, session: Session, turn: int) -> _InFlight:
        self._serial += 1
        rid = f"{session.name}-t{turn}-{self._serial}"
        return _InFlight(rid, session, turn, np.asarray(session.prompts[turn], dtype=np.uint32))

    async def _step(self, steps: RequestLifecycle, active: list[_InFlight]) -> list[_InFlight]:
        """One scheduling step; returns the requests it finished. A refused step is retried with
        the requests not yet started left out (they wait for pages to come back)."""
        batch = list(active)
        while True:
            plan = await steps.plan([self._step_request(r) for r in batch])
            if isinstance(plan, StepPlan):
                break
            waiting = [r for r in batch if r.hit < 0]
            if not waiting:
                raise EngineError(_refused(plan))
            batch = [r for r in batch if r is not waiting[-1]]
            if not batch:
                raise EngineError(_refused(plan))
        self.step_count += 1
        by_rid = {r.rid: r for r in batch}
        planned = [(by_rid[p.rid], p) for p in plan.requests]
        stamp, page_tokens = write_stamp(plan.ticket), self.config.cache.page_tokens
        pages = [page for _, p in planned for page in p.written_pages(page_tokens)]
        with contextlib.ExitStack() as writing:  # every rank fenced for the plan's step
            for rank in self.ranks:
                writing.enter_context(rank.writing(plan.epoch, stamp, pages))
            outputs = self.model.forward(self.ranks, [ChunkRequest.from_plan(p, r.tokens)
                                                     for r, p in planned])
        items = [self._advance(r, p, out) for (r, p), out in zip(planned, outputs)]
        await steps.finish(items)
        finished = [r for r in batch if r.done]
        if finished:
            await steps.release([r.rid for r in finished])
        return finished

    def _step_request(self, r: _InFlight) -> StepRequest:
        if r.hit < 0:
            hashes = chain_hashes(r.tokens, self.root, self.block, self.config.cache.hash_algo)
            return self.policy.first_step(r.rid, self.chunk_tokens, len(r.tokens), hashes,
                                          self.block, self.config.cache.page_tokens)
        return self.policy.next_step(r.rid, self.chunk_tokens, len(r.tokens),
                                     self.config.cache.page_tokens)

    def _advance(self, r: _InFlight, plan: RequestPlan, out: torch.Tensor) -> CommitItem:
        if r.hit < 0:
            r.hit, r.match = plan.hit_tokens, plan.match_tokens
        r.pos = plan.stop
        r.steps += 1
        r.outputs.append(out)
        return self.policy.commit_item(plan, len(r.tokens), self.block,
                                       self.config.cache.page_tokens)

    def _finish(self, r: _InFlight) -> RequestResult:
        verified, error = None, 0.0
        if self.verify:
            computed = torch.cat(r.outputs)
            expected = self._recomputed(r)[r.hit:len(r.tokens)]
            verified = outputs_match(computed, expected)
            if computed.shape == expected.shape:
                error = float((computed - expected).abs().max())
            else:
                error = float("inf")
        return RequestResult(r.rid, r.session.name, r.turn, len(r.tokens), r.hit, r.match, r.steps,
                             self.step_count, verified, error)


    def _recomputed(self, r: _InFlight) -> torch.Tensor:
        """The cold recompute covering `r`'s prompt. The model is causal and each turn's prompt
        is a prefix of the session's last one, so one recompute of that last prompt serves every
        turn (computed at the first turn that needs it, dropped after the last)."""
        final = np.asarray(r.session.prompts[-1], dtype=np.uint32)
        if len(final) < len(r.tokens) or not np.array_equal(final[:len(r.tokens)], r.tokens):
            return self.model.recompute(r.tokens)
        if r.session.name not in self._reference:
            self._reference[r.session.name] = self.model.recompute(final)
        if r.turn == len(r.session.prompts) - 1:
            return self._reference.pop(r.session.name)
        return self._reference[r.session.name]


def _refused(refusal: StepRefusal) -> str:
    return (f"step refused: {refusal.reason} ({refusal.pages_needed} pages needed, "
            f"{refusal.pages_available} available)")
