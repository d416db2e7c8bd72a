"""Request leases (issue 14): a request whose scheduler disappeared is released after its lease.

A scheduler process is SIGKILLed between its plans and their release (a hit holding pins, a
request with an unconfirmed commit, a pinned reader): once the lease has run out the reaper has
released everything, and the pool holds no request, ticket, lease or pin. A scheduler that keeps
stepping keeps its lease; the reaper's work per call is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cachetier.cli import main
from cachetier.client import CacheTierClient
from cachetier.service.reaper import ReaperSettings, reap_pool
from cachetier.service.server import ServiceSettings
from index.records import StepRequest
from index.snapshot import read_pool
from index.store import PrefixIndex, pool_keys
from tests.cluster_harness import (BLOCK, SECRET, TOKEN, assert_no_pins, running_agent,
                                   running_service)
from tests.index_harness import commit_item, new_request, only, small_config

DOC = [3 + (17 * i) % 700 for i in range(200)]
FAST = ReaperSettings(every_s=0.05)

SCHEDULER = r"""
import asyncio, json, os, sys
from cachetier.client import CacheTierClient
from index.hashing import chain_hashes
from tests.index_harness import ROOT, commit_item, new_request

async def main(url, doc, block):
    async with CacheTierClient(url, token=os.environ["CACHETIER_TOKEN"]) as tier:
        hit = doc[:100] + [1]
        plan = await tier.plan("p", [new_request("hit", hit, len(hit), block),
                                     new_request("cold", doc[120:180], 60, block)])
        cold = [r for r in plan.requests if r.rid == "cold"][0]
        await tier.commit("p", [commit_item(cold, cold.stop, True, True, block)])  # unconfirmed
        pinned = await tier.pin("p", "reader", 100, bytes(chain_hashes(doc[:100], ROOT, block)))
        print(json.dumps([r.hit_tokens for r in plan.requests] + [pinned.hit_tokens]), flush=True)
        await asyncio.sleep(3600)  # SIGKILLed here, holding all of it

asyncio.run(main(*json.loads(sys.argv[1])))
"""


async def cache_doc(tier: CacheTierClient) -> None:
    tokens = DOC[:100]
    step = only(await tier.plan("p", [new_request("doc", tokens, len(tokens), BLOCK)]))
    done = await tier.commit("p", [commit_item(step, step.stop, True, True, BLOCK)])
    await tier.confirm("p", done.ticket)
    await tier.release("p", ["doc"])


async def test_a_scheduler_killed_between_plan_and_release_leaks_nothing_after_its_lease(
        redis, redis_url):
    lease = 1.5
    async with running_service(redis_url, request_lease_s=lease, reaper=FAST) as service, \
            running_agent(service.url), CacheTierClient(service.url, token=TOKEN) as tier:
        await cache_doc(tier)
        args = json.dumps([service.url, DOC, BLOCK])  # the token by environment, as ever
        scheduler = subprocess.Popen([sys.executable, "-c", SCHEDULER, args],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "CACHETIER_TOKEN": TOKEN})
        try:
            line = await asyncio.wait_for(asyncio.to_thread(scheduler.stdout.readline), 60)
            assert json.loads(line) == [96, 0, 96], line
            scheduler.send_signal(signal.SIGKILL)
            killed = time.monotonic()
        finally:
            scheduler.kill()
            scheduler.wait(10)
            scheduler.stdout.close()
        state = await read_pool(redis, pool_keys("p"))
        # its requests, under the ids the service scoped by their owner (`service.ownership`)
        assert {rid.split(":", 1)[1] for rid in state.req} == {"hit", "cold", "reader"}
        assert set(state.lease) == set(state.req)
        assert state.tix and any(rec["ref"] for rec in state.pages.values())
        async with asyncio.timeout(lease + 5):
            while (await read_pool(redis, pool_keys("p"))).req:
                await asyncio.sleep(0.02)
        assert time.monotonic() - killed >= lease - 0.5  # released by the lease, not before
        await assert_no_pins(redis)
        assert (await read_pool(redis, pool_keys("p"))).lease == {}
        hit = DOC[:100] + [2]  # the cached prefix is still served
        assert only(await tier.plan("p", [new_request("again", hit, 101, BLOCK)])).hit_tokens == 96
        await tier.release("p", ["again"])


async def test_a_request_that_keeps_stepping_keeps_its_lease(redis, redis_url):
    async with running_service(redis_url, request_lease_s=1.0, reaper=FAST) as service, \
            running_agent(service.url), CacheTierClient(service.url, token=TOKEN) as tier:
        tokens = DOC[:160]
        step = only(await tier.plan("p", [new_request("slow", tokens, 16, BLOCK)]))
        # a step every 0.25 s for about 2.5 s: two and a half leases, with 0.75 s of slack
        # for a loaded host between two steps (0.25 s of slack was short on one)
        while step.stop < len(tokens):
            await asyncio.sleep(0.25)
            done = await tier.commit("p", [commit_item(step, step.stop, True, True, BLOCK)])
            await tier.confirm("p", done.ticket)
            step = only(await tier.plan("p", [StepRequest("slow", 16)]))
        assert (await tier.release("p", ["slow"])).released == 1
        await assert_no_pins(redis)


async def test_the_reaper_releases_a_bounded_number_per_call_earliest_first(redis):
    now = [100.0]
    index = PrefixIndex(redis, "p", small_config(num_pages=256), lease_s=10.0,
                        clock=lambda: now[0])
    await index.create()
    for n in range(25):
        only(await index.plan_step([new_request(f"r{n:02}", DOC[n:n + 8], 8, 4)]))
        now[0] += 0.01
    now[0] = 110.095  # the first ten leases have run out (deadlines 10 ms apart)
    rounds = await reap_pool(index, ReaperSettings(batch=4, calls=2))
    assert [r.released for r in rounds] == [4, 4]  # bounded: two calls of four
    assert sorted((await read_pool(redis, index.keys)).req)[:2] == ["r08", "r09"]
    assert [r.released for r in await reap_pool(index, ReaperSettings(batch=4, calls=2))] == [2]
    assert len((await read_pool(redis, index.keys)).req) == 15
    now[0] = 200.0
    assert sum(r.released for r in await reap_pool(index, ReaperSettings(batch=100))) == 15
    state = await read_pool(redis, index.keys)
    assert state.req == {} and state.lease == {} and state.tix == {}


@pytest.mark.parametrize("flags, lease", [([], 300.0), (["--request-lease", "0"], None),
                                          (["--request-lease", "2.5"], 2.5)])
def test_serve_takes_its_request_lease_from_the_command_line(monkeypatch, flags, lease):
    settings: list[ServiceSettings] = []

    async def run_service(given: ServiceSettings, *_: object) -> None:
        settings.append(given)

    monkeypatch.setattr("cachetier.run.nodes.run_service", run_service)
    monkeypatch.setenv("CACHETIER_SECRET", SECRET)
    assert main(["serve", "--redis", "redis://127.0.0.1:1", *flags]) == 0
    assert [s.request_lease_s for s in settings] == [lease]


def test_a_negative_request_lease_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("CACHETIER_SECRET", SECRET)
    assert main(["serve", "--redis", "redis://127.0.0.1:1", "--request-lease", "-1"]) == 2
    assert "cachetier: --request-lease:" in capsys.readouterr().err
