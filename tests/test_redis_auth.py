"""The Redis the project starts (`cachetier.run.redis_auth`): no default user, the service's own
user with the commands it uses only, and the service working through it.

The red-team finding this guards: Redis ran with the default user, no password, `+@all`. The Redis
Cluster of `up --redis-cluster` (replicas logging in to their masters as `replica`) is checked by
tests/test_cluster.py, which serves a prompt on it.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from importlib import resources

import pytest
import redis

from cachetier.client import CacheTierClient
from cachetier.run.redis_auth import SCRIPT_COMMANDS, RedisAcl
from cachetier.run.servers import RedisServer
from index.lifecycle import RequestLifecycle
from tests.cluster_harness import BLOCK, TOKEN, running_agent, running_service
from tests.index_harness import commit_item, new_request, only
from tests.redis_harness import AofRedis

ACL = RedisAcl(service="service-pw", replica="replica-pw", operator="operator-pw")


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(acl=ACL) as started:
        yield started


def login(server: RedisServer, username: str | None = None,
          password: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(server.url, username=username, password=password,
                                socket_timeout=2.0)


def test_the_default_user_and_wrong_passwords_are_refused(server):
    for username, password in ((None, None), ("default", ""), ("cachetier", "wrong"),
                               ("operator", "service-pw")):
        with pytest.raises(redis.AuthenticationError):
            login(server, username, password).ping()


def test_a_script_write_survives_a_kill_and_restart_on_the_append_only_file(tmp_path):
    """Redis replays its AOF as the default user: with the default user stripped of commands, a
    script's MULTI/EXEC block was refused at load (NOPERM) and the index came back empty."""
    script = ("redis.call('HSET', KEYS[1], 'f', 'v') redis.call('ZADD', KEYS[2], 1, 'm') "
              "redis.call('HINCRBY', KEYS[1], 'n', 1) return 1")
    server = AofRedis(tmp_path, acl=ACL)
    with server:
        login(server, "cachetier", "service-pw").eval(script, 2, "ct:{p}:a", "ct:{p}:b")
        os.kill(server.pid, signal.SIGKILL)
        server.stop()
        server.start()
        service = login(server, "cachetier", "service-pw")
        assert service.hgetall("ct:{p}:a") == {b"f": b"v", b"n": b"1"}
        assert service.zscore("ct:{p}:b", "m") == 1


def test_every_command_a_script_calls_is_granted_to_the_service():
    """A script runs with its caller's permissions: a command one of them calls that the ACL
    lacks fails only where the ACL is on (GETRANGE of a staged step did, on every cluster `up`
    starts)."""
    called = set()
    for script in (resources.files("index") / "lua").iterdir():
        called |= {name.lower() for name in re.findall(r'redis\.p?call\("(\w+)"',
                                                         script.read_text())}
    assert called and called <= set(SCRIPT_COMMANDS), sorted(called - set(SCRIPT_COMMANDS))


def test_the_service_user_may_stage_a_big_step(server):
    """`index.execution.Staged`: the service SETs a step's hashes with an expiry and UNLINKs them
    (both refused by the ACL once: every step of 1,024 new blocks failed as `internal`)."""
    service = login(server, "cachetier", "service-pw")
    assert service.execute_command("SET", "ct:{p}:stage:x", b"h" * 16, "PX", 1000)
    assert service.execute_command("UNLINK", "ct:{p}:stage:x") == 1


@pytest.mark.parametrize("command", [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"),
                                     ("SCRIPT", "FLUSH"), ("SET", "ct:{p}:meta", "x"),
                                     ("SET", "other:stage:x", "x"),
                                     ("HGET", "other", "f"), ("ACL", "LIST"),
                                     ("EVAL", "return redis.call('FLUSHALL')", "0")])
def test_the_service_user_runs_nothing_it_does_not_need(server, command):
    with pytest.raises(redis.ResponseError, match="(?i)permission|can't run this command"):
        login(server, "cachetier", "service-pw").execute_command(*command)


async def test_the_service_serves_through_its_own_user(server):
    tokens = list(range(6 * BLOCK))
    async with running_service(server.url, redis_user="cachetier",
                               redis_password="service-pw") as service, \
            running_agent(service.url), CacheTierClient(service.url, token=TOKEN) as tier:
        hits = []
        for rid, prompt in (("a", tokens), ("b", tokens + [1])):
            async with RequestLifecycle(tier.pool("p")) as steps:
                step = only(await steps.plan([new_request(rid, prompt, len(prompt), BLOCK)]))
                await steps.finish([commit_item(step, len(prompt), True, True, BLOCK)])
            hits.append(step.hit_tokens)
        assert hits == [0, len(tokens)]
        assert (await tier.health()).redis
        assert (await tier.stats("p")).requests == 0
    with server.client() as operator:
        assert operator.keys("ct:*")  # the pool is there, written by the service's user
        operator.flushall()
