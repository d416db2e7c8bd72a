"""Tickets cannot be guessed or replayed (`index.tickets`): a ticket is its pool's counter and a
nonce its caller drew, and `confirm` settles nothing unless it names both.

Confirming a ticket that is not one's own makes pages matchable before their bytes exist: the next
counter value (a guess), a ticket of a voided epoch, or one of an earlier life of the pool whose
counter came back (storage that forgot it unnoticed) must each be an unknown ticket, change
nothing, and leave the pending registrations unmatched; the real ticket still confirms them.
"""

from __future__ import annotations

import pytest

from index.errors import StaleEpoch, UnknownEntity
from index.hashing import chain_hashes
from index.reference import ReferenceIndex
from index.store import PrefixIndex
from index.tickets import NONCE_BITS, compose, split
from tests.index_harness import ROOT, commit_item, new_request, only, small_config
from tests.redis_harness import dump

CONFIG = small_config()
BLOCK = CONFIG.cache.hash_block_tokens
DOC = list(range(100, 140))


async def committed(index, rid: str, tokens: list[int]) -> int:
    """A whole prompt planned, its plan confirmed and its forward pass committed: the commit's
    ticket, not yet confirmed (its pages pending, never matched)."""
    plan = await index.plan_step([new_request(rid, tokens, len(tokens), BLOCK)])
    await index.confirm(plan.ticket)
    done = await index.commit([commit_item(only(plan), len(tokens), True, True, BLOCK)])
    return done.ticket


async def hit(index, tokens: list[int]) -> int:
    return (await index.probe(len(tokens) + 1, chain_hashes(tokens + [0], ROOT, BLOCK))).hit_tokens


def forgeries(ticket: int) -> list[int]:
    """The next counter value with the same or another nonce, the same counter with others."""
    number, nonce = split(ticket)
    mask = (1 << NONCE_BITS) - 1
    return [compose(number + 1, nonce), compose(number + 1, 0), compose(number, nonce ^ 1),
            compose(number, (nonce + 1) & mask), number]


@pytest.fixture(params=["redis", "reference"])
async def face(request, redis):
    index = (PrefixIndex(redis, "p", CONFIG) if request.param == "redis"
             else ReferenceIndex(CONFIG, pool_id="p"))
    await index.create()
    return index


async def test_a_forged_ticket_is_refused_and_confirms_nothing(redis_operator, face, redis):
    ticket = await committed(face, "a", DOC)
    before = await dump(redis_operator)
    for forged in forgeries(ticket):
        with pytest.raises(UnknownEntity):
            await face.confirm(forged)
    assert await dump(redis_operator) == before  # the reference face leaves Redis empty alike
    assert await hit(face, DOC) == 0 and (await face.stats()).pending_tickets == 1
    assert await face.confirm(ticket) == 1
    assert await hit(face, DOC) == 40


async def test_a_ticket_of_a_voided_epoch_is_refused_in_the_next(face):
    old = await committed(face, "a", DOC)
    other = ReferenceIndex(CONFIG, pool=face.pool) if isinstance(face, ReferenceIndex) else \
        PrefixIndex(face.redis, "p", CONFIG)
    await other.invalidate()  # another replica: the face under test holds a voided epoch
    with pytest.raises(StaleEpoch):
        await face.confirm(old)
    new = await committed(face, "b", DOC)
    assert split(new)[0] == split(old)[0] + 2  # the counter went on; the old ticket is still no
    with pytest.raises(UnknownEntity):  # good in the new epoch
        await face.confirm(old)
    assert await hit(face, DOC) == 0
    assert await face.confirm(new) == 1 and await hit(face, DOC) == 40


async def test_a_ticket_of_an_earlier_life_of_the_pool_is_refused_when_its_counter_comes_back(
        redis, redis_operator):
    """The pool is dropped and created again and nobody noticed (no view to tell: a fresh
    caller), so its counters are issued again; a ticket kept from the first life names the
    counter of a second-life ticket, and must not settle it (on main it did)."""
    first = PrefixIndex(redis, "p", CONFIG, nonce=lambda: 111)
    await first.create()
    old = await committed(first, "a", DOC)
    await first.drop()
    second = PrefixIndex(redis, "p", CONFIG, nonce=lambda: 222)
    await second.create()
    new = await committed(second, "b", DOC)
    assert split(new)[0] == split(old)[0] and new != old
    replayer = PrefixIndex(redis, "p", CONFIG)
    replayer.epoch = second.epoch
    before = await dump(redis_operator)
    with pytest.raises(UnknownEntity):
        await replayer.confirm(old)
    assert await dump(redis_operator) == before and await hit(second, DOC) == 0
    assert await second.confirm(new) == 1 and await hit(second, DOC) == 40
