"""Request ownership (`cachetier.service.ownership`): a request is its scheduler's alone.

The red-team finding this guards: every scheduler holds the same `client` credential and request
ids were global to a pool, so a second scheduler's `release(["victim"])` answered `released=1`,
the next request was handed three of the victim's pages, and the victim's forward pass, still in
the same epoch, wrote into them (5 of 5 later hits on that prefix served wrong bytes). Two engines
passing through the same user-supplied id did the same without malice.
"""

from __future__ import annotations

import stat

import pytest

from cachetier.client import CacheTierClient
from cachetier.credentials import Principal, Role, issue, verify
from cachetier.run.credential_files import ClusterCredentials
from cachetier.errors import ErrorCode, RemoteError
from cachetier.service.ownership import Owner
from index.lifecycle import RequestLifecycle
from index.records import CommitItem, RequestPlan
from tests.cluster_harness import BLOCK, PAGE, SECRET, TOKEN, assert_no_pins
from tests.index_harness import commit_item, new_request, only


def pages_of(plan: RequestPlan) -> set[int]:
    """Every page id a request's plan may write: its MLA pages from its start on, its state and
    checkpoint pages."""
    own = {page for group in plan.mla_pages for page in group[plan.start // PAGE:]}
    return own | set(plan.state_pages) | set(plan.checkpoint_pages)


def a_prompt(first: int, length: int = 3 * PAGE) -> list[int]:
    return list(range(first, first + length))


@pytest.fixture
async def second(service, agent):
    """Another scheduler: the same credential, its own client."""
    async with CacheTierClient(service.url, token=TOKEN, timeout=10) as tier:
        yield tier


async def test_another_schedulers_release_of_an_in_flight_request_changes_nothing(
        tier, second, redis):
    """The attack of the finding, step by step: after `second` releases the victim's id, the
    victim still holds every page it was planned (nobody else is handed one), and its commit
    goes through."""
    victim_prompt = a_prompt(0)
    victim = only(await tier.plan("p", [new_request("victim", victim_prompt, 2 * PAGE, BLOCK)]))
    released = await second.release("p", ["victim"])
    assert (released.released, released.unknown) == (0, ["victim"])
    assert (await tier.stats("p")).requests == 1
    third = only(await second.plan("p", [new_request("third", a_prompt(5000), 2 * PAGE,
                                                     BLOCK)]))
    assert not pages_of(victim) & pages_of(third), "the third request got the victim's pages"
    committed = await tier.commit("p", [commit_item(victim, victim.stop, True, True, BLOCK)])
    assert [r.rid for r in committed.requests] == ["victim"]
    assert await tier.confirm("p", committed.ticket) == 1
    await second.release("p", ["third"])
    assert (await tier.release("p", ["victim"])).released == 1
    await assert_no_pins(redis)


async def test_two_schedulers_may_hold_the_same_request_id(tier, second, redis):
    """Each scheduler's "r1" is its own request: both plan, commit and release it in turn,
    interleaved, and each sees only its own."""
    first = only(await tier.plan("p", [new_request("r1", a_prompt(0), PAGE, BLOCK)]))
    other = only(await second.plan("p", [new_request("r1", a_prompt(7000), PAGE, BLOCK)]))
    assert first.rid == other.rid == "r1"
    assert not pages_of(first) & pages_of(other)
    assert (await tier.stats("p")).requests == 2
    for client, plan in ((second, other), (tier, first)):
        committed = await client.commit("p", [commit_item(plan, plan.stop, True, True, BLOCK)])
        assert await client.confirm("p", committed.ticket) == 1
        assert (await client.release("p", ["r1"])).released == 1
    await assert_no_pins(redis)


async def test_a_ticket_confirms_nothing_for_another_scheduler(tier, second, redis):
    """A commit's ticket read off another scheduler (a shared log, a guess) is unknown to it: the
    pages stay unmatchable until their owner confirms them."""
    doc = a_prompt(0)
    plan = only(await tier.plan("p", [new_request("a", doc, PAGE, BLOCK)]))
    committed = await tier.commit("p", [commit_item(plan, plan.stop, True, True, BLOCK)])
    with pytest.raises(RemoteError) as refused:
        await second.confirm("p", committed.ticket)
    assert refused.value.code == ErrorCode.UNKNOWN
    probe = await second.route(["p"], len(doc), new_request("x", doc, 1, BLOCK).hashes)
    assert probe[0].hit_tokens == 0, "pages became matchable by another's confirm"
    assert await tier.confirm("p", committed.ticket) == 1
    await tier.release("p", ["a"])
    await assert_no_pins(redis)


async def test_a_reader_is_released_by_its_own_scheduler_only(tier, second, redis):
    doc = a_prompt(0, 2 * PAGE + 1)
    async with RequestLifecycle(tier.pool("p")) as steps:
        step = only(await steps.plan([new_request("w", doc, len(doc), BLOCK)]))
        await steps.finish([commit_item(step, len(doc), True, True, BLOCK)])
    hashes = new_request("x", doc, 1, BLOCK).hashes
    pinned = await tier.pin("p", "reader", len(doc), hashes)
    assert pinned.reader == "reader" and pinned.hit_tokens > 0
    assert (await second.release("p", ["reader"])).released == 0
    assert (await tier.stats("p")).requests == 1
    assert (await tier.release("p", ["reader"])).released == 1
    await assert_no_pins(redis)


async def test_a_scheduler_owns_its_requests_across_a_reconnection(tier, agent, redis):
    """The session is the client's, not its connection's: a scheduler whose connection dropped
    between plan and commit still commits and releases its request."""
    plan = only(await tier.plan("p", [new_request("a", a_prompt(0), PAGE, BLOCK)]))
    await tier.close()  # the next call opens a new connection
    committed = await tier.commit("p", [CommitItem("a", plan.stop, 0, True)])
    assert [r.rid for r in committed.requests] == ["a"]
    assert await tier.confirm("p", committed.ticket) == 1
    assert (await tier.release("p", ["a"])).released == 1
    await assert_no_pins(redis)


def test_scopes_differ_by_principal_and_session_and_tickets_round_trip():
    client, admin = Principal(Role.CLIENT), Principal(Role.ADMIN)
    scopes = {Owner.of(p, s, SECRET).scope for p in (client, admin) for s in ("s1", "s2")}
    assert len(scopes) == 4
    assert Owner.of(client, "", SECRET).scope != Owner.of(client, "", SECRET).scope
    owner = Owner.of(client, "s1", SECRET)
    ticket = 12345 << 24 | 678
    assert owner.ticket(owner.ticket(ticket)) == ticket != owner.ticket(ticket)
    assert owner.ticket(ticket) >> 24 == 12345  # the counter, so the order, is kept


@pytest.fixture
async def tenants(service, agent):
    """Schedulers of tenants `a` (two of them) and `b`."""
    clients = [CacheTierClient(service.url, token=issue(SECRET, Principal(Role.CLIENT,
                                                                          tenant=name)),
                               timeout=10) for name in ("a", "a", "b")]
    for client in clients:
        await client.__aenter__()
    try:
        yield clients
    finally:
        for client in clients:
            await client.close()


async def serve(tier: CacheTierClient, rid: str, tokens: list[int]) -> int:
    """The whole prompt served and committed with a checkpoint at its end; its hit."""
    async with RequestLifecycle(tier.pool("p")) as steps:
        step = only(await steps.plan([new_request(rid, tokens, len(tokens), BLOCK)]))
        await steps.finish([commit_item(step, len(tokens), True, True, BLOCK)])
    return step.hit_tokens


async def test_a_tenant_reaches_only_its_own_entries_even_for_the_same_prompts(tenants, tier,
                                                                               redis):
    """The finding: within the client role there was no tenant boundary (`route` told whether a
    prompt was cached, and a junk commit for a prefix others would send was served to them).
    Tenant `a` caches a prompt: its other scheduler hits it; tenant `b` and the default tenant
    neither route to it, nor pin it, nor hit it, and their own copies stay theirs."""
    a1, a2, b = tenants
    doc = a_prompt(0, 2 * PAGE + 1)
    hashes = new_request("x", doc, 1, BLOCK).hashes
    assert await serve(a1, "first", doc) == 0
    assert await serve(a2, "second", doc) == 2 * PAGE
    for other in (b, tier):
        assert (await other.route(["p"], len(doc), hashes))[0].hit_tokens == 0
        assert (await other.pin("p", "reader", len(doc), hashes)).hit_tokens == 0
        await other.release("p", ["reader"])
        assert await serve(other, "own", doc) == 0
    assert (await a1.route(["p"], len(doc), hashes))[0].hit_tokens == 2 * PAGE
    await assert_no_pins(redis)


def test_a_tenant_names_a_client_only():
    assert Principal.parse("client/team-1") == Principal(Role.CLIENT, tenant="team-1")
    for bad in ("client/", "client/Team", "client/a/b", "admin/a", "observer/x"):
        with pytest.raises(ValueError):
            Principal.parse(bad)
    with pytest.raises(ValueError):
        Principal(Role.ADMIN, tenant="a")


def test_up_writes_a_client_credential_per_tenant(tmp_path):
    directory = ClusterCredentials(SECRET, "p", 1, ("a", "team-2")).write(tmp_path)
    for tenant in ("a", "team-2"):
        path = directory / f"client-{tenant}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert verify(SECRET, path.read_text().strip()) == Principal(Role.CLIENT, tenant=tenant)
    assert verify(SECRET, (directory / "client").read_text().strip()) == Principal(Role.CLIENT)
