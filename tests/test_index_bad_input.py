"""Bad input gets a clear, typed error and leaves Redis exactly as it was.

The scripts validate everything before their first write; these tests bypass the Python store's
own checks where needed (raw script calls) so that the scripts' validation is what is tested.
"""

from __future__ import annotations

import msgpack
import pytest

from eviction.policy import EvictionWeights, lru
from index.errors import (BadRequest, PoolConflict, StorageRollback, UnknownEntity,
                          UnknownPool)
from index.hashing import chain_hashes
from index.records import StepPlan, StepRequest
from index.execution import Staged
from index.store import PrefixIndex, decode_step, stage_key
from index.tickets import split
from tests.index_harness import ROOT, make, new_request, serve, small_config
from tests.redis_harness import dump

CONFIG = small_config()


@pytest.fixture
async def warm(redis):
    """A pool with cached content and one request mid-prefill (planned, not committed)."""
    d = await make(redis, CONFIG)
    await serve(d, "cached", list(range(40)), chunk=40)
    plan = await d.plan([new_request("mid", list(range(100, 140)), 8, 4)], {"mid": list(range(100, 140))})
    await d.confirm(plan.ticket)
    return d


def packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=False)


async def raw(d, script: str, *args):
    return await d.index._scripts.call(script, d.index.keys, [d.index.epoch, *args])


GOOD_HASHES = chain_hashes(list(range(12)), ROOT, 4)
NONCE = 12345  # a new ticket's nonce: plan_step's last argument, commit's third


def new_item(rid="x", compute=1, tokens=12, hashes=1, ckpt=1, **flags) -> dict:
    return {"rid": rid, "compute": compute, "ckpt": ckpt, "tokens": tokens, "hashes": hashes, **flags}


RAW_PLAN_CASES = {
    "not msgpack": (b"\xc1\xc1", [GOOD_HASHES]),
    "rid not a string": (packed([new_item(rid=5)]), [GOOD_HASHES]),
    "compute a string": (packed([new_item(compute="many")]), [GOOD_HASHES]),
    "compute zero": (packed([new_item(compute=0)]), [GOOD_HASHES]),
    "tokens fractional": (packed([new_item(tokens=12.5)]), [GOOD_HASHES]),
    "hashes short": (packed([new_item()]), [GOOD_HASHES[:-1]]),
    "hashes for the wrong length": (packed([new_item(tokens=16)]), [GOOD_HASHES]),
    "hashes argument missing": (packed([new_item(hashes=2)]), [GOOD_HASHES]),
    "hashes inline": (packed([new_item(hashes=GOOD_HASHES)]), []),
    "ckpt not 0/1": (packed([new_item(ckpt=2)]), [GOOD_HASHES]),
    "at_last not 0/1": (packed([new_item(at_last=3)]), [GOOD_HASHES]),
    "at_resend not 0/1": (packed([new_item(at_resend=3)]), [GOOD_HASHES]),
    "turn_end intermediate": (packed([new_item(turn_end="intermediate")]), [GOOD_HASHES]),
    "lease a string": (packed([new_item(lease="soon")]), [GOOD_HASHES]),
    "valid then a bad lease": (packed([new_item(rid="ok", compute=4, lease=5),
                                       new_item(hashes=2, lease=[1])]), [GOOD_HASHES] * 2),
    "duplicate rid": (packed([new_item(), new_item(hashes=2)]), [GOOD_HASHES] * 2),
    "over max_batch": (packed([new_item(rid=f"x{i}", hashes=i + 1) for i in range(CONFIG.cache.max_batch + 1)]),
                       [GOOD_HASHES] * (CONFIG.cache.max_batch + 1)),
    "continue uncommitted": (packed([{"rid": "mid", "compute": 1, "ckpt": 1}]), []),
    "valid then bad": (packed([new_item(rid="ok", compute=4), {"rid": "bad", "compute": -1, "ckpt": 1}]),
                       [GOOD_HASHES]),
}


@pytest.mark.parametrize("case", sorted(RAW_PLAN_CASES))
async def test_bad_plan_is_refused_without_a_write(redis_operator, warm, redis, case):
    batch, blobs = RAW_PLAN_CASES[case]
    before = await dump(redis_operator)
    with pytest.raises(BadRequest) as err:
        await raw(warm, "plan_step", batch, *blobs, NONCE)
    assert str(err.value) and "script" not in str(err.value)
    assert await dump(redis_operator) == before


async def raw_staged(d, batch: bytes, staged: bytes):
    """plan_step with `staged` as its staged hashes (index.execution.Staged), as a big step."""
    stage = Staged(stage_key(d.index.keys, "test"), staged)
    return await d.index._scripts.call("plan_step", d.index.keys, [d.index.epoch, batch, NONCE],
                                       stage)


STAGED_PLAN_CASES = {
    "staged hashes short": (packed([new_item()]), GOOD_HASHES[:-1]),
    "staged hashes beyond the step's": (packed([new_item()]), GOOD_HASHES * 2),
    "staged hashes for the wrong length": (packed([new_item(tokens=16)]), GOOD_HASHES),
    "staged out of batch order": (packed([new_item(rid="a", hashes=2), new_item(rid="b")]),
                                  GOOD_HASHES * 2),
    "staged and in an argument": (packed([new_item(hashes=2)]), GOOD_HASHES),
    "staged valid then bad": (packed([new_item(rid="ok"), new_item(compute=0, hashes=2)]),
                              GOOD_HASHES * 2),
}


@pytest.mark.parametrize("case", sorted(STAGED_PLAN_CASES))
async def test_bad_staged_plan_is_refused_without_a_write_or_its_key_left(warm, redis, case,
                                                                          redis_operator):
    """The staged key is gone afterwards too: the call's pipeline unlinks it, refused or not."""
    batch, staged = STAGED_PLAN_CASES[case]
    before = await dump(redis_operator)
    with pytest.raises(BadRequest):
        await raw_staged(warm, batch, staged)
    assert await dump(redis_operator) == before


async def test_the_staged_cases_are_valid_once_fixed(warm, redis_operator):
    _, plan = decode_step(await raw_staged(warm, packed([new_item(rid="a"), new_item(
        rid="b", hashes=2)]), GOOD_HASHES * 2), CONFIG.model.mla_groups)
    assert isinstance(plan, StepPlan) and [r.rid for r in plan.requests] == ["a", "b"]
    assert not await redis_operator.keys("*:stage:*")


async def test_the_raw_plan_cases_are_valid_once_fixed(warm):
    """The cases above fail for the reason they name: the same call with good values succeeds."""
    _, plan = decode_step(await raw(warm, "plan_step", packed([new_item()]), GOOD_HASHES, NONCE),
                          CONFIG.model.mla_groups)
    assert isinstance(plan, StepPlan) and split(plan.ticket)[1] == NONCE


COMMIT_CASES = {
    "checkpoint off the hash block": ([{"rid": "mid", "stop": 8, "ckpt_tokens": 6, "kind": "turn"}], BadRequest),
    "checkpoint beyond stop": ([{"rid": "mid", "stop": 4, "ckpt_tokens": 8, "kind": "turn"}], BadRequest),
    "stop beyond the plan": ([{"rid": "mid", "stop": 9, "ckpt_tokens": 0, "kind": "turn"}], BadRequest),
    "stop not after start": ([{"rid": "mid", "stop": 0, "ckpt_tokens": 0, "kind": "turn"}], BadRequest),
    "stop a string": ([{"rid": "mid", "stop": "8", "ckpt_tokens": 0, "kind": "turn"}], BadRequest),
    "kind unknown": ([{"rid": "mid", "stop": 8, "ckpt_tokens": 0, "kind": "forever"}], BadRequest),
    "kind superseded": ([{"rid": "mid", "stop": 8, "ckpt_tokens": 8, "kind": "superseded"}], BadRequest),
    "kind missing": ([{"rid": "mid", "stop": 8, "ckpt_tokens": 8}], BadRequest),
    "unknown request": ([{"rid": "nobody", "stop": 8, "ckpt_tokens": 0, "kind": "turn"}], UnknownEntity),
    "good then unknown": ([{"rid": "mid", "stop": 8, "ckpt_tokens": 8, "kind": "turn"},
                           {"rid": "nobody", "stop": 8, "ckpt_tokens": 0, "kind": "turn"}], UnknownEntity),
}


@pytest.mark.parametrize("case", sorted(COMMIT_CASES))
async def test_bad_commit_is_refused_without_a_write(redis_operator, warm, redis, case):
    batch, error = COMMIT_CASES[case]
    before = await dump(redis_operator)
    with pytest.raises(error):
        await raw(warm, "commit", packed(batch), NONCE)
    assert await dump(redis_operator) == before


async def test_other_bad_calls_leave_redis_unchanged(redis_operator, warm, redis):
    before = await dump(redis_operator)
    with pytest.raises(UnknownEntity):
        await warm.index.confirm(10**9)
    with pytest.raises(BadRequest):
        await raw(warm, "confirm", "not-a-number", NONCE)
    for nonce in ([], ["x"], [-1], [1 << 24], [0.5]):  # a ticket's nonce missing or out of range
        with pytest.raises(BadRequest):
            await raw(warm, "plan_step", packed([new_item()]), GOOD_HASHES, *nonce)
        with pytest.raises(BadRequest):
            await raw(warm, "commit", packed([{"rid": "mid", "stop": 8, "ckpt_tokens": 0,
                                                "kind": "turn"}]), *nonce)
        with pytest.raises(BadRequest):
            await raw(warm, "confirm", 1, *nonce)
    turn = {"rid": "mid", "stop": 8, "ckpt_tokens": 0, "kind": "turn"}
    for groups in ([{**turn, "g": 2}], [{**turn, "g": 0}], [{**turn, "g": "1"}], [turn]):
        with pytest.raises(BadRequest):  # out of order, or the second group left empty
            await raw(warm, "commit", packed(groups), NONCE, NONCE)
    with pytest.raises(BadRequest):
        await raw(warm, "confirm", *[1, NONCE] * (CONFIG.cache.max_batch + 1))
    with pytest.raises(BadRequest):
        await raw(warm, "release", packed([1, 2]))
    with pytest.raises(BadRequest):
        await raw(warm, "evict", -3)
    for reaper in (["later", 10], [10**13, 0], [10**13, 10001], [10**13]):  # now, count
        with pytest.raises(BadRequest):
            await raw(warm, "release", packed(["mid"]), *reaper)
    with pytest.raises(BadRequest):
        await raw(warm, "pin_prefix", "reader", 40, chain_hashes(list(range(40)), ROOT, 4), "x")
    ahead = PrefixIndex(redis, "p", CONFIG)  # a caller that saw later epochs: a rollback
    ahead.epoch = warm.index.epoch + 7
    with pytest.raises(StorageRollback):
        await ahead.release(["mid"])
    with pytest.raises(UnknownPool):
        await PrefixIndex(redis, "never-created", CONFIG).release(["mid"])
    with pytest.raises(PoolConflict):
        await PrefixIndex(redis, "p", small_config(num_pages=999)).create()
    for args in ([0, 10], [0, 0, *weight_args(lru())], [-1, 10, *weight_args(lru())],
                 [0, 10, *weight_args(lru())[:-2]], [0, 10, *weight_args(lru()), "w_forever", 1],
                 [0, 10, *weight_args(lru())[:-1], "inf"]):
        with pytest.raises(BadRequest):
            await raw(warm, "reweigh", *args)
    assert await dump(redis_operator) == before


def weight_args(weights: EvictionWeights) -> list:
    return [x for name, value in weights.as_pool_fields().items() for x in (name, repr(value))]


async def test_client_side_checks_name_the_problem(warm):
    with pytest.raises(ValueError, match=r"2\*\*32"):
        chain_hashes([1, 2**32, 3, 4], ROOT, 4)
    with pytest.raises(ValueError, match="hash bytes"):
        await warm.index.plan_step([StepRequest("z", 1, 12, GOOD_HASHES[:-1])])
    with pytest.raises(ValueError, match="max_batch"):
        await warm.index.plan_step([new_request(f"z{i}", list(range(12)), 1, 4) for i in range(9)])
    with pytest.raises(ValueError, match="twice"):
        await warm.index.plan_step([new_request("z", list(range(12)), 1, 4)] * 2)
    with pytest.raises(ValueError, match="pool id"):
        PrefixIndex(warm.index.redis, "bad{tag}", CONFIG)


async def test_release_of_unknown_requests_is_reported_not_fatal(warm):
    result = await warm.release(["mid", "ghost"])
    assert result.released == 1 and result.unknown == ["ghost"]
    assert (await warm.release(["mid"])).unknown == ["mid"]
