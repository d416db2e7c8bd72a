"""Copying a cached prefix from one pool to another (prefill/decode disaggregation, cross-pool hits).

The destination copies the source's pages with the index flow of an ordinary step, the transfer
taking the place of the forward pass, so its index ends up holding entries of its own:

1. `pin_prefix` in the source: the longest usable prefix, pinned under a reader id;
2. `plan_step` in the destination for that prefix plus one token (its own hit, if any, is kept and
   only the rest moves): private MLA pages for the slots it lacks and checkpoint pages at the hit;
   the plan's own copies (restore, copy-on-write) run on the destination agents, then its confirm;
3. every destination rank pulls its share of the pages from the source ranks (`protocol.Fetch`,
   re-sharding on the way when the TP degrees differ);
4. the source epoch is checked (an invalidated source may have reused the pages mid-read), then
   `commit` (endpoints up to the hit, the checkpoint at the hit, durable) and its `confirm`;
5. `release` in the destination (the pages go to its cache) and in the source (the pins go).

Any failure releases both: the destination rolls back what it never confirmed, so no entry points
to pages a transfer did not finish, and the source pins go with the reader record.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass

from cachetier.config import Config
from cachetier.errors import BadMessage, CodedError, CopyFailed, ErrorCode, ErrorInfo, RemoteError
from cachetier.service.fleet import AgentLink, StepGuard, fence_links, run_copies, step_order
from cachetier.wire.protocol import Fetch, HandoffReply
from gpu_pool.layout import PageKind
from gpu_pool.streams import PageMove
from index.errors import StaleEpoch
from index.hashing import hash_len
from index.lifecycle import RequestLifecycle
from index.prefix import PinnedPrefix
from index.records import CommitItem, RequestPlan, StepPlan, StepRequest
from index.store import PrefixIndex


@dataclass(frozen=True)
class PoolSide:
    """One pool as the hand-off sees it: its index, geometry, agents and step guard."""

    index: PrefixIndex
    config: Config
    links: list[AgentLink]
    guard: StepGuard


async def hand_off(src: PoolSide, dst: PoolSide, prompt_tokens: int, hashes: bytes,
                   timeout: float) -> HandoffReply:
    a, b = src.config.cache, dst.config.cache
    if (a.hash_block_tokens, a.hash_algo) != (b.hash_block_tokens, b.hash_algo):
        raise BadMessage("pools that hash prompts differently cannot share a prefix")
    reader = f"handoff-{uuid.uuid4().hex}"
    pinned = await src.index.pin_prefix(reader, prompt_tokens, hashes)
    try:
        if pinned.hit_tokens == 0:
            return HandoffReply(0, 0, 0)
        return await _receive(src, dst, pinned, hashes, reader, timeout)
    finally:
        with contextlib.suppress(StaleEpoch):  # invalidated: the pins are void already
            await src.index.release([reader])


async def _receive(src: PoolSide, dst: PoolSide, pinned: PinnedPrefix, hashes: bytes, rid: str,
                   timeout: float) -> HandoffReply:
    hit = pinned.hit_tokens
    cache = dst.config.cache
    prefix = hashes[:hit // cache.hash_block_tokens * hash_len(cache.hash_algo)]
    # The plan's own copies are not a settle hook: a destination that holds the prefix already
    # runs none of them. Leaving the block releases the request, its pages going to the cache.
    async with RequestLifecycle(dst.index) as steps:
        outcome = await steps.plan([StepRequest(rid, hit + 1, hit + 1, prefix, True)])
        if not isinstance(outcome, StepPlan):
            raise CodedError(ErrorInfo(ErrorCode.CONFLICT, f"destination pool full: "
                                       f"{outcome.reason}", True))
        (plan,) = outcome.requests
        if plan.start >= hit:
            return HandoffReply(hit, 0, plan.start)
        await _run_plan_copies(dst, outcome, timeout)
        moves = _moves(pinned, plan, src.config)
        fetch = Fetch(outcome.epoch, [link.data_url for link in src.links], src.config.model,
                      src.config.cache, [m.row() for m in moves])
        await _fetch(dst.links, fetch, timeout)
        src.guard.check()  # the source kept its epoch: the pages read were the pinned ones
        checkpoint = hit if plan.checkpoint_pages else 0
        await steps.finish([CommitItem(rid, hit, checkpoint, True)])
        dst.guard.check()
        return HandoffReply(hit, hit - plan.start, hit)


async def _fetch(links: list[AgentLink], fetch: Fetch, timeout: float) -> None:
    """Every destination rank pulls its share; an agent's refusal keeps its own code (a
    `transfer_failed` says the source went away, not that the order was wrong)."""
    try:
        await run_copies(links, fetch, timeout)  # type: ignore[arg-type]  # any agent request
    except CopyFailed as exc:
        if isinstance(exc.__cause__, RemoteError):
            raise exc.__cause__ from None
        raise


async def _run_plan_copies(dst: PoolSide, plan: StepPlan, timeout: float) -> None:
    dst.guard.check()
    await fence_links(dst.links, plan.epoch, timeout)  # before any write: copies, the fetch
    batch = step_order(plan, dst.config.cache.page_tokens)
    if batch is not None:  # claimed before the fetch writes them too
        await run_copies(dst.links, batch, timeout)
    await dst.index.confirm(plan.ticket)


def _moves(pinned: PinnedPrefix, plan: RequestPlan, config: Config) -> list[PageMove]:
    """The source pages the destination lacks, onto the pages its plan allocated: MLA slots from
    the first one it does not hold (token prefixes; the last one partly filled), and the
    checkpoint, one page per KDA group."""
    page_tokens = config.cache.page_tokens
    token_bytes = config.model.mla_token_bytes
    hit = pinned.hit_tokens
    slots = -(-hit // page_tokens)
    moves = []
    for src_group, dst_group in zip(pinned.mla_pages, plan.mla_pages, strict=True):
        for slot in range(plan.start // page_tokens, slots):
            tokens = min(page_tokens, hit - slot * page_tokens)
            nbytes = 0 if tokens == page_tokens else tokens * token_bytes
            moves.append(PageMove(src_group[slot], dst_group[slot], PageKind.MLA, nbytes))
    for src_page, dst_page in zip(pinned.checkpoint_pages, plan.checkpoint_pages, strict=True):
        moves.append(PageMove(src_page, dst_page, PageKind.KDA))
    return moves
