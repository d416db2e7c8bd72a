"""The index's one face (`index.face.Index`) and its counters (`stats.lua`).

`PrefixIndex`, `ReferenceIndex` and `TierPool` must be drivable by the same code: same verbs, same
parameter names, all async. `stats()` reads counters the scripts keep (O(1)); these tests recount
them from a snapshot of every record after flows that register checkpoints of every class,
re-class them, roll them back on release, evict them and invalidate the pool, on Redis and on the
reference alike, and through a running service (fixtures of tests/conftest.py).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from cachetier.client import CacheTierClient, TierPool
from index.errors import PoolConflict, StaleEpoch
from index.face import Index
from index.meta import CORE_FIELD, CORE_FIELDS, decode_core
from index.records import CommitItem, IndexStats, StepPlan, StepRequest
from index.reference import PoolState, ReferenceIndex
from index.snapshot import read_pool, recount, sanity_check
from index.store import PrefixIndex
from tests.cluster_harness import BLOCK as TINY_BLOCK
from tests.cluster_harness import TINY
from tests.index_harness import new_request, only, small_config

FACE_VERBS = ("plan_step", "commit", "confirm", "release", "probe", "stats")
POOL_VERBS = ("create", "evict", "reweigh", "invalidate")  # beyond the face, Redis and model alike
CONFIG = small_config(kda_groups=2, num_pages=64)  # 4-token blocks, 16-token pages
DOC = list(range(100, 160))
OTHER = list(range(500, 530))
Snapshot = Callable[[], Awaitable[PoolState]]


@pytest.mark.parametrize("cls", [PrefixIndex, ReferenceIndex, TierPool])
def test_every_face_has_the_protocols_signatures(cls) -> None:
    for verb in FACE_VERBS:
        method = getattr(cls, verb)
        assert inspect.iscoroutinefunction(method), f"{cls.__name__}.{verb} is not async"
        assert inspect.signature(method) == inspect.signature(getattr(Index, verb)), (
            f"{cls.__name__}.{verb}{inspect.signature(method)} is not the face's")


def test_the_reference_has_the_pool_verbs_of_prefix_index() -> None:
    for verb in POOL_VERBS:
        assert inspect.iscoroutinefunction(getattr(ReferenceIndex, verb))
        assert (inspect.signature(getattr(ReferenceIndex, verb))
                == inspect.signature(getattr(PrefixIndex, verb))), verb


def test_every_face_is_an_index_with_an_epoch() -> None:
    faces = [PrefixIndex(Redis(), "p", CONFIG), ReferenceIndex(CONFIG),
             TierPool(CacheTierClient("tcp://127.0.0.1:1", token="t"), "p")]
    for face in faces:
        assert isinstance(face, Index)
        assert face.epoch == 0  # nothing seen yet


async def redis_face(redis: Redis) -> tuple[PrefixIndex, Snapshot]:
    index = PrefixIndex(redis, "f", CONFIG)
    await index.create()
    return index, lambda: read_pool(redis, index.keys)


async def reference_face() -> tuple[ReferenceIndex, Snapshot]:
    index = ReferenceIndex(CONFIG, pool_id="f")
    await index.create()

    async def snapshot() -> PoolState:
        return index.s
    return index, snapshot


def classes(state: PoolState) -> Counter[str]:
    return Counter(state.pages[lead]["cls"] for lead in state.ck.values())


async def counted(index: PrefixIndex | ReferenceIndex, snapshot: Snapshot) -> IndexStats:
    """`stats()`, which must equal the recount of the records (and the records be sane)."""
    stats, state = await index.stats(), await snapshot()
    assert stats == recount(state, CONFIG.cache.num_pages)
    if isinstance(index, PrefixIndex):
        sanity_check(state, CONFIG.cache.num_pages, CONFIG.cache.blocks_per_page)
    return stats


async def steps(index: Index, rid: str, kinds: list[str], first: StepRequest | None = None,
                chunk: int = 8, confirm_last: bool = True) -> None:
    """One step per kind, each committed with its checkpoint of that class at the step's stop;
    the first step is `first` (a new request) or a continuation of `rid`."""
    step = first or StepRequest(rid, chunk)
    for n, kind in enumerate(kinds):
        plan = await index.plan_step([step])
        await index.confirm(plan.ticket)
        stop = only(plan).stop
        committed = await index.commit([CommitItem(rid, stop, stop, kind=kind)])
        if confirm_last or n < len(kinds) - 1:
            await index.confirm(committed.ticket)
        step = StepRequest(rid, chunk)


async def flow(index: PrefixIndex | ReferenceIndex, snapshot: Snapshot) -> list[IndexStats]:
    seen: list[IndexStats] = [await counted(index, snapshot)]
    assert seen[0] == IndexStats(1, 64, 64, 0, 0, 0, 0, 0)

    await steps(index, "a", ["intermediate"], new_request("a", DOC[:40], 8, 4))
    seen.append(await counted(index, snapshot))
    assert (seen[-1].checkpoints, seen[-1].durable_checkpoints) == (1, 0)
    await steps(index, "a", ["rung", "spec", "branch", "turn"])
    await index.release(["a"])
    seen.append(await counted(index, snapshot))
    assert classes(await snapshot()) == Counter(["rung", "spec", "branch", "turn"])  # 8 recycled
    assert (seen[-1].checkpoints, seen[-1].durable_checkpoints, seen[-1].requests) == (4, 4, 0)

    # resuming from the turn end and going past it supersedes it (still kept)
    r = only(await index.plan_step([new_request("b", DOC[:48], 8, 4)]))
    assert r.hit_tokens == 40
    await index.confirm((await index.commit([CommitItem("b", 48, 48, kind="turn")])).ticket)
    await index.release(["b"])
    seen.append(await counted(index, snapshot))
    assert classes(await snapshot())["superseded"] == 1 and seen[-1].durable_checkpoints == 5

    # two requests of one step compute the same boundary: a kept duplicate promotes the
    # intermediate first registered there
    plan = await index.plan_step([new_request(rid, OTHER[:24], 12, 4) for rid in ("c", "d")])
    assert isinstance(plan, StepPlan)
    committed = await index.commit([CommitItem("c", 12, 12, kind="intermediate"),
                                    CommitItem("d", 12, 12, kind="rung")])
    assert [c.checkpoint for c in committed.requests] == ["registered", "duplicate"]
    seen.append(await counted(index, snapshot))
    now = seen[-1]
    assert (now.checkpoints, now.durable_checkpoints, now.pending_tickets) == (6, 6, 2)
    await index.confirm(committed.ticket)
    await index.release(["c", "d"])

    # a commit never confirmed is rolled back by the release, its checkpoint with it
    await steps(index, "e", ["branch"], new_request("e", OTHER[:20] + [7] * 4, 24, 4),
                confirm_last=False)
    seen.append(await counted(index, snapshot))
    assert (seen[-1].checkpoints, seen[-1].durable_checkpoints, seen[-1].requests) == (7, 7, 1)
    rolled_back = await index.release(["e"])
    assert [x.kind for x in rolled_back.removed] == ["ck"]
    seen.append(await counted(index, snapshot))
    assert (seen[-1].checkpoints, seen[-1].durable_checkpoints) == (6, 6)

    evicted = await index.evict(3)
    assert "ck" in [x.kind for x in evicted.removed]
    seen.append(await counted(index, snapshot))
    assert seen[-1].checkpoints < 6 and seen[-1].evictable_pages < seen[-2].evictable_pages

    await index.invalidate()
    seen.append(await counted(index, snapshot))
    assert seen[-1] == IndexStats(2, 64, 64, 0, 0, 0, 0, 0)
    return seen


async def test_stats_are_the_records_counted_on_redis_and_on_the_reference(redis) -> None:
    on_redis = await flow(*await redis_face(redis))
    on_reference = await flow(*await reference_face())
    assert on_redis == on_reference


@pytest.mark.parametrize("face", ["redis", "reference"])
async def test_a_face_voided_by_another_is_told_once_then_carries_on(redis, face) -> None:
    if face == "redis":
        index, _ = await redis_face(redis)
        other: PrefixIndex | ReferenceIndex = PrefixIndex(redis, "f", CONFIG)
    else:
        index, _ = await reference_face()
        other = ReferenceIndex(CONFIG, pool_id="f", pool=index.pool)
    only(await index.plan_step([new_request("a", DOC[:20], 8, 4)]))
    assert await other.invalidate() == 2 and index.epoch == 1
    with pytest.raises(StaleEpoch):
        await index.commit([CommitItem("a", 8)])
    assert index.epoch == 2
    assert (await index.release(["a"])).unknown == ["a"]  # its pins went with the epoch
    assert await other.invalidate(seen_epoch=1) == 2  # an epoch already gone: no second bump
    assert only(await index.plan_step([new_request("a", DOC[:20], 8, 4)])).hit_tokens == 0


async def stored_as_layout_2(redis, key: str, *missing: str) -> dict[str, float]:
    """Rewrites the pool's meta as layout 2 kept it (geometry and counters as fields of their
    own, no `core`), without the `missing` fields (a pool stored before they existed); returns
    what `core` held."""
    core = decode_core(await redis.hget(key, CORE_FIELD))
    await redis.hset(key, mapping={f: v for f, v in core.items() if f not in missing})
    await redis.hset(key, "layout", 2)
    await redis.hdel(key, CORE_FIELD)
    return core


@pytest.mark.parametrize("missing", [(), ("durable_cks", "wc")], ids=["layout-2", "before-counters"])
async def test_a_pool_stored_with_an_older_layout_goes_on_from_its_counters_and_starts_over_if_it_has_pages(
        redis, missing) -> None:
    """A pool stored before the packed `core` (its counters as fields, pins inside its records,
    maybe no durable or write count) would be misread: create_pool takes its epoch, tickets
    and write count over, so that none is issued twice, and starts it over in the next epoch
    if it holds a page set."""
    index, snapshot = await redis_face(redis)
    key = index.keys[0]
    await index.create()
    before = await stored_as_layout_2(redis, key, *missing)
    assert await index.create() == 1 and await redis.hget(key, "epoch") is None
    assert decode_core(await redis.hget(key, CORE_FIELD)) == before
    await steps(index, "a", ["intermediate", "turn"], new_request("a", DOC[:40], 8, 4))
    assert (await index.stats()).checkpoints == 1
    before = await stored_as_layout_2(redis, key, *missing)
    index = PrefixIndex(redis, "f", CONFIG)  # a new service: a pool before `wc` had no view of it
    assert await index.create() == 2
    after = decode_core(await redis.hget(key, CORE_FIELD))
    assert after["ticket"] == before["ticket"] > 0 and after["tick"] == before["tick"]
    assert after["wc"] == (0 if missing else before["wc"])
    assert int(await redis.hget(key, "layout")) == 3
    assert not set(await redis.hgetall(key)) & {f.encode() for f in CORE_FIELDS}
    assert await index.stats() == IndexStats(2, 64, 64, 0, 0, 0, 0, 0)
    await counted(index, snapshot)
    assert only(await index.plan_step([new_request("b", DOC[:40], 8, 4)])).hit_tokens == 0


async def test_a_pool_of_another_geometry_conflicts_in_every_layout(redis) -> None:
    index, _ = await redis_face(redis)
    await index.create()
    await stored_as_layout_2(redis, index.keys[0])
    other = PrefixIndex(redis, "f", small_config(kda_groups=2, num_pages=65))
    with pytest.raises(PoolConflict, match="num_pages=64, not 65"):
        await other.create()
    await index.create()
    with pytest.raises(PoolConflict, match="num_pages=64, not 65"):
        await other.create()


async def test_the_service_answers_the_counters_of_the_index(agent, tier, redis) -> None:
    """`TierPool.stats()` (the wire's PoolStats) equals `PrefixIndex.stats()` on the same pool,
    and both the recount of its records, mid-flow (a request held, a commit pending)."""
    pool = tier.pool("p")
    doc = [11 + (7 * i) % 1000 for i in range(5 * TINY_BLOCK)]
    step = new_request("a", doc, 2 * TINY_BLOCK, TINY_BLOCK)
    r = only(await pool.plan_step([step]))
    first = await pool.commit([CommitItem("a", r.stop, r.stop, kind="intermediate")])
    await pool.confirm(first.ticket)
    r = only(await pool.plan_step([StepRequest("a", 2 * TINY_BLOCK)]))
    await pool.commit([CommitItem("a", r.stop, r.stop, kind="rung")])  # left pending
    direct = PrefixIndex(redis, "p", TINY)
    stats = await pool.stats()
    assert stats == await direct.stats()
    assert stats == recount(await read_pool(redis, direct.keys), TINY.cache.num_pages)
    assert (stats.requests, stats.pending_tickets, stats.checkpoints,
            stats.durable_checkpoints) == (1, 1, 1, 1)
    assert pool.epoch == stats.epoch and isinstance(stats, IndexStats)
    await pool.release(["a"])
    assert await pool.stats() == await direct.stats()

