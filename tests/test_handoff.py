"""A prefix cached in a TP=2 prefill pool handed to a TP=1 decode pool through the service.

Real service, real agents (in-process), real redis-server. The prefill "forward pass" writes
token ids as full-attention rows on every rank and each rank's heads of a known checkpoint state;
after the hand-off, a request planned on the decode pool hits there and the decode agent's pages
hold exactly those rows and the whole state (all heads, re-sharded on the way). The hand-off
runs for both families: KDA + MLA (the latent replicated on both prefill ranks) and GDN + GQA
(each prefill rank one KV head, joined into every token row of the decode rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket

import pytest
import torch

from cachetier.client import CacheTierClient
from cachetier.config import CacheSpec, Config, ModelSpec
from cachetier.errors import ErrorCode, RemoteError
from cachetier.wire.framing import encode_frame
from cachetier.wire.protocol import ok_frame
from cachetier.wire.sockio import read_frame, send_buffers
from gpu_pool import PagedPool
from gpu_pool.agent import Agent, AgentSettings
from gpu_pool.transfer import STREAM_HEADER, PageServer, StreamsAccepted
from index.hashing import chain_hashes
from index.lifecycle import RequestLifecycle
from index.records import RequestPlan
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys
from tests.cluster_harness import TOKEN, agent_token, running_agent, running_service
from tests.index_harness import ROOT, commit_item, new_request, only

MODEL = ModelSpec(kda_heads=8, kda_head_k_dim=4, kda_head_v_dim=8, mla_latent_dim=4)
GQA_MODEL = ModelSpec(name="gdn-gqa", linear_kind="gdn", attention_kind="gqa", kda_heads=8,
                      kda_key_heads=4, kda_head_k_dim=4, kda_head_v_dim=8, mla_latent_dim=0,
                      gqa_kv_heads=2, gqa_head_dim=2)
CACHE = CacheSpec(hash_block_tokens=4, page_tokens=16, page_alignment=64, num_pages=64)
BLOCK, PAGE = CACHE.hash_block_tokens, CACHE.page_tokens
DOC = [5 + (3 * i) % 97 for i in range(60)]


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's prefill (TP 2) and decode (TP 1) pools and the known checkpoint state."""

    prefill: Config
    decode: Config
    state: torch.Tensor  # [groups, slots, heads, K, V]
    conv: torch.Tensor  # [groups, slots, conv channels, kernel - 1]

    @classmethod
    def of(cls, model: ModelSpec) -> Family:
        lead = (model.kda_groups, model.layers_per_group)
        state = torch.randn(*lead, model.kda_heads, model.kda_head_k_dim, model.kda_head_v_dim,
                            generator=torch.Generator().manual_seed(0))
        conv = torch.randn(*lead, model.conv_channels, model.conv_kernel - 1,
                           generator=torch.Generator().manual_seed(1))
        return cls(Config(dataclasses.replace(model, tp_degree=2), CACHE), Config(model, CACHE),
                   state, conv)


KDA_MLA, GDN_GQA = Family.of(MODEL), Family.of(GQA_MODEL)
PREFILL, DECODE, STATE, CONV = KDA_MLA.prefill, KDA_MLA.decode, KDA_MLA.state, KDA_MLA.conv


@contextlib.asynccontextmanager
async def cluster(redis_url: str, family: Family = KDA_MLA, **agent_overrides):
    async with running_service(redis_url, config=family.prefill,
                               pool_configs={"decode": family.decode}) as svc:
        async with contextlib.AsyncExitStack() as stack:
            prefill = [await stack.enter_async_context(running_agent(
                svc.url, pool="prefill", rank=r, tp_degree=2, **agent_overrides)) for r in range(2)]
            decode = await stack.enter_async_context(running_agent(svc.url, pool="decode"))
            tier = await stack.enter_async_context(CacheTierClient(svc.url, token=TOKEN, timeout=10))
            yield tier, prefill, decode


def forward(views: list[PagedPool], plan: RequestPlan, tokens: list[int],
            family: Family = KDA_MLA) -> None:
    """What the prefill ranks' forward pass leaves: each rank's token rows (the latent, or its KV
    heads), each rank's heads (their conv rows and recurrent states)."""
    for rank, view in enumerate(views):
        for pos in range(plan.start, plan.stop):
            view.mla_view(plan.mla_pages[0][pos // PAGE])[:, pos % PAGE] = float(tokens[pos])
        heads = view.layout.rank_heads(rank)
        for group, page in enumerate(plan.checkpoint_pages):
            view.kda_view(page).copy_(family.state[group, :, heads.start:heads.stop])
            conv = view.conv_view(page)
            for ours, theirs in view.layout.conv_rows(heads, rank):
                conv[:, theirs.start:theirs.stop] = family.conv[group, :, ours.start:ours.stop]


async def prefill(tier: CacheTierClient, views: list[PagedPool], tokens: list[int],
                  family: Family = KDA_MLA) -> None:
    async with RequestLifecycle(tier.pool("prefill")) as steps:
        plan = only(await steps.plan([new_request("p", tokens, len(tokens), BLOCK)]))
        forward(views, plan, tokens, family)
        await steps.finish([commit_item(plan, plan.stop, True, True, BLOCK)])


async def no_pins(redis, pool: str, config: Config) -> None:
    state = await read_pool(redis, pool_keys(pool))
    sanity_check(state, config.cache.num_pages, config.cache.blocks_per_page)
    assert state.req == {} and state.tix == {}
    assert all(rec.get("ref", 0) == 0 for rec in state.pages.values())


@pytest.mark.parametrize("family", [KDA_MLA, GDN_GQA], ids=["kda-mla", "gdn-gqa"])
async def test_a_prefill_prefix_lands_in_the_decode_pool_resharded(redis, redis_url, family):
    tokens = DOC[:42]                                              # checkpoint at 40: 2.5 pages
    hashes = chain_hashes(tokens, ROOT, BLOCK)
    async with cluster(redis_url, family) as (tier, prefill_agents, decode_agent):
        views = [PagedPool.attach(a.handle()) for a in prefill_agents]
        await prefill(tier, views, tokens, family)
        probes = await tier.route(["decode", "prefill"], len(tokens), hashes)
        assert [(p.pool, p.hit_tokens) for p in probes] == [("prefill", 40), ("decode", 0)]
        moved = await tier.handoff("prefill", "decode", len(tokens), hashes)
        assert (moved.hit_tokens, moved.moved_tokens, moved.cached_tokens) == (40, 40, 40)
        view = PagedPool.attach(decode_agent.handle())
        filled: dict[int, int] = {}  # blocks each decode MLA page holds, by its endpoints
        for lead, fill in (await read_pool(redis, pool_keys("decode"))).ep.values():
            filled[lead] = max(fill, filled.get(lead, 0))
        partial = {lead: fill for lead, fill in filled.items() if fill < PAGE // BLOCK}
        assert list(partial.values()) == [40 % PAGE // BLOCK]
        for lead, fill in partial.items():  # the moved prefix only: the fresh pool's zeros after
            assert not view.mla_view(lead)[:, fill * BLOCK:].any()
        again = await tier.handoff("prefill", "decode", len(tokens), hashes)
        assert (again.moved_tokens, again.cached_tokens) == (0, 40)   # held already: no copy
        probes = await tier.route(["prefill", "decode"], len(tokens), hashes)
        assert sorted((p.pool, p.hit_tokens) for p in probes) == [("decode", 40), ("prefill", 40)]
        step = await tier.plan("decode", [new_request("d", tokens, 2, BLOCK)])
        (plan,) = step.requests
        assert plan.hit_tokens == 40
        for group, page in enumerate(plan.state_pages):              # the restore copy ran
            assert torch.equal(view.kda_view(page), family.state[group])
            assert torch.equal(view.conv_view(page), family.conv[group])
        for pos in range(40):
            row = view.mla_view(plan.mla_pages[0][pos // PAGE])[:, pos % PAGE]
            assert bool((row == float(tokens[pos])).all()), pos
        await tier.release("decode", ["d"])
        await no_pins(redis, "prefill", family.prefill)
        await no_pins(redis, "decode", family.decode)


async def half_a_stream(conn: socket.socket) -> None:
    """What a page server sends before it fails: the acceptance and half of the first stream."""
    frame = await read_frame(conn, 2**20)
    streams = frame["streams"]
    _, slot, _, nbytes, page, offset = streams[0]
    accepted = StreamsAccepted(len(streams), sum(row[3] for row in streams))
    await send_buffers(conn, [encode_frame(ok_frame(frame["id"], accepted)),
                              STREAM_HEADER.pack(page, slot, offset, nbytes), bytes(nbytes // 2)])


async def dying_source(self: PageServer, conn: socket.socket) -> None:
    """A page server that accepts, sends half of the first stream and dies."""
    await half_a_stream(conn)


async def test_a_source_dying_mid_stream_fails_retryably_and_leaves_nothing(redis, redis_url,
                                                                           monkeypatch):
    tokens = DOC[:42]
    hashes = chain_hashes(tokens, ROOT, BLOCK)
    monkeypatch.setattr(PageServer, "_serve", dying_source)   # every agent's page server
    async with cluster(redis_url) as (tier, prefill_agents, decode_agent):
        views = [PagedPool.attach(a.handle()) for a in prefill_agents]
        await prefill(tier, views, tokens)
        with pytest.raises(RemoteError) as err:
            await tier.handoff("prefill", "decode", len(tokens), hashes)
        assert err.value.retryable and err.value.code == ErrorCode.TRANSFER_FAILED
        probes = await tier.route(["decode"], len(tokens), hashes)
        assert probes[0].hit_tokens == 0                           # no entry on partial data
        await no_pins(redis, "prefill", PREFILL)
        await no_pins(redis, "decode", DECODE)


async def test_a_destination_dying_mid_stream_fails_retryably_and_leaves_nothing(redis, redis_url,
                                                                                monkeypatch):
    """The decode agent dies while its pull is half done (the source stalls after half a stream,
    so the death lands mid-transfer): retryable error, the decode pool starts a new epoch (no
    entry can point to the half-written pages), and the prefill pool's pins are gone."""
    tokens = DOC[:42]
    hashes = chain_hashes(tokens, ROOT, BLOCK)
    midway = asyncio.Event()

    async def stalling_source(self: PageServer, conn: socket.socket) -> None:
        await half_a_stream(conn)
        midway.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(PageServer, "_serve", stalling_source)   # before the servers start
    async with running_service(redis_url, config=PREFILL, pool_configs={"decode": DECODE}) as svc:
        async with contextlib.AsyncExitStack() as stack:
            prefill_agents = [await stack.enter_async_context(running_agent(
                svc.url, pool="prefill", rank=r, tp_degree=2)) for r in range(2)]
            decode = Agent(AgentSettings((svc.url,), "decode", agent_token("decode"),
                                         reconnect_max_s=60))
            decode_run = asyncio.create_task(decode.run())
            await asyncio.wait_for(decode.registered.wait(), 10)
            tier = await stack.enter_async_context(CacheTierClient(svc.url, token=TOKEN,
                                                                   timeout=10))
            await prefill(tier, [PagedPool.attach(a.handle()) for a in prefill_agents], tokens)
            epoch = (await tier.stats("decode")).epoch
            handoff = asyncio.create_task(tier.handoff("prefill", "decode", len(tokens), hashes))
            await asyncio.wait_for(midway.wait(), 10)
            decode_run.cancel()                                        # the decode agent dies
            await asyncio.gather(decode_run, return_exceptions=True)
            with pytest.raises(RemoteError) as err:
                await handoff
            assert err.value.retryable
            assert (await tier.stats("decode")).epoch > epoch
            assert (await tier.route(["decode"], len(tokens), hashes))[0].hit_tokens == 0
            await no_pins(redis, "prefill", PREFILL)
            await no_pins(redis, "decode", DECODE)
