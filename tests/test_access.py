"""Roles on the service link (`cachetier.credentials`, `cachetier.service.access`).

The red-team findings this guards: with one token for every role, a scheduler created pools,
took over ranks (two invalidations each) and registered as an agent to acknowledge copies it
never ran (411 of 893 hits served wrong bytes). Each refusal here is non-retryable, names the
credential and what it may not do, and changes nothing: no pool, no epoch, the real agent stays.
"""

from __future__ import annotations

import pytest

from cachetier import credentials
from cachetier.client import CacheTierClient
from cachetier.credentials import Principal, Role, issue, verify
from cachetier.errors import ErrorCode, RemoteError, Unauthorized
from cachetier.wire.channel import exchange
from cachetier.wire.framing import Endpoint
from cachetier.wire.protocol import PROTOCOL_VERSION, Hello, Register
from index.records import StepPlan
from index.store import pool_keys
from tests.cluster_harness import BLOCK, SECRET, TOKEN, agent_token
from tests.index_harness import new_request

ADMIN = issue(SECRET, Principal(Role.ADMIN))
OBSERVER = issue(SECRET, Principal(Role.OBSERVER))
DOC = list(range(5 * BLOCK))


def test_a_token_proves_its_principal_and_no_other():
    token = agent_token("p", 0)
    assert verify(SECRET, token) == credentials.agent("p", 0)
    assert verify(SECRET, issue(SECRET, credentials.agent("a.b:c", 3))).pool == "a.b:c"
    mac = token.rpartition(".")[2]
    forged = [f"agent/1/p.{mac}", f"admin.{mac}", f"{token}0", token.replace("p.", "q."), "",
              "client", issue("another secret", Principal(Role.CLIENT))]
    for bad in forged:
        with pytest.raises(Unauthorized, match="^bad credential$"):
            verify(SECRET, bad)


async def refusal(url: str, token: str, role: str, *then: object) -> RemoteError:
    """The error the service answers to a hello (then each message of `then`) with `token`."""
    stream = await Endpoint.parse(url).connect()
    try:
        with pytest.raises(RemoteError) as err:
            hello = Hello(PROTOCOL_VERSION, token, role)  # type: ignore[arg-type]
            await exchange(stream, 0, hello)
            for i, message in enumerate(then, 1):
                await exchange(stream, i, message)
        assert not err.value.retryable
        return err.value
    finally:
        await stream.close()


async def test_a_scheduler_cannot_register_create_or_take_over(service, agent, tier, redis):
    epoch = (await tier.stats("p")).epoch
    err = await refusal(service.url, TOKEN, "agent")
    assert (err.code, str(err)) == (ErrorCode.FORBIDDEN,
                                    "a client credential cannot open an agent connection")
    # an agent's credential serves its own pool and rank: not another rank, not another pool
    err = await refusal(service.url, agent_token("p", 1), "agent", Register("p", 0, 1, "fake"))
    assert str(err) == "an agent credential (pool p, rank 1) cannot register for pool p, rank 0"
    err = await refusal(service.url, agent_token("p", 0), "agent", Register("q", 0, 1, "fake"))
    assert err.code == ErrorCode.FORBIDDEN and "cannot register for pool q, rank 0" in str(err)
    err = await refusal(service.url, agent_token("p", 0), "client")
    assert str(err) == "an agent credential (pool p, rank 0) cannot open a client connection"
    # nothing moved: the real agent still serves rank 0 in the same epoch, pool q does not exist
    assert (await tier.health()).pools == {"p": [0]}
    assert (await tier.stats("p")).epoch == epoch
    assert await redis.exists(*pool_keys("q")) == 0
    assert isinstance(await tier.plan("p", [new_request("a", DOC, len(DOC), BLOCK)]), StepPlan)


async def test_each_role_does_only_its_own_ops(service, agent, tier):
    epoch = (await tier.stats("p")).epoch
    with pytest.raises(RemoteError) as err:
        await tier.invalidate("p")
    assert (err.value.code, str(err.value), err.value.retryable) == (
        ErrorCode.FORBIDDEN, "a client credential may not invalidate", False)
    async with CacheTierClient(service.url, token=ADMIN) as admin:
        assert await admin.invalidate("p") == epoch + 1
        assert (await admin.stats("p")).epoch == epoch + 1
    async with CacheTierClient(service.url, token=OBSERVER) as observer:
        assert (await observer.health()).pools == {"p": [0]}
        for call in (observer.stats("p"), observer.invalidate("p"),
                     observer.plan("p", [new_request("a", DOC, len(DOC), BLOCK)])):
            with pytest.raises(RemoteError, match="^an observer credential may not "):
                await call
    err = await refusal(service.url, issue(SECRET, Principal(Role.SERVICE)), "client")
    assert str(err) == "a service credential cannot open a client connection"
