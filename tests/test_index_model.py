"""Hypothesis state machine: the Lua scripts on a real redis-server against the in-memory reference.

Both are driven through the same face (`index.face.Index`, no adapter): random steps (new and
continuing requests, batched), commits at random chunk ends with or without checkpoints of every
class, confirms in any order, releases, explicit evictions, probes, switches of the eviction
weights (LRU tiers, GreedyDual value, odd fractions) rescored in small batches, and pool
invalidations, by the faces under test or by another replica's (theirs then answer StaleEpoch once
and carry on in the new epoch). After every operation both must have answered the same (page ids
included), the whole Redis state must equal the reference's, both `stats()` must equal the
counters recounted from the records, `sanity_check` must pass (refcounts = holders, never
negative, no page both free and referenced, leaf-first tree intact, checkpoints anchored, kept
counters in step), and the byte model must show that every hit's pages hold exactly the declared
prefix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from cachetier.config import Config
from eviction.policy import CLASSES, COMMIT_KINDS, EvictionWeights, PerClass, lru, recency, value
from index.errors import CacheIndexError
from index.execution import ReplicaAcks
from index.hashing import chain_hashes
from index.records import CommitItem, StepPlan, StepRequest
from index.redis_link import RedisTarget, close, connect
from index.reference import ReferenceIndex
from index.snapshot import read_pool, recount, sanity_check
from index.store import STAGE_BYTES, PrefixIndex
from index.tickets import NONCE_BITS
from tests.cluster_harness import OPERATOR_LOGIN, SERVICE_LOGIN
from tests.index_harness import ROOT, Driver, new_request, small_config


LEASE_S = 5.0  # the requests' lease in the model, on the machine's own clock (`time_passes`)
KEPT = [kind for kind in COMMIT_KINDS if kind != "intermediate"]  # what a turn end may be kept as
ODD = st.sampled_from([0.0, 1.0, 0.1, 1 / 3, 2.5, 1e-3, 2.0**40])
WEIGHTS = st.sampled_from([lru(), recency(), value()]) | st.builds(
    EvictionWeights, recency=ODD, clock=ODD, mla=ODD, depth=ODD,
    bonus=st.builds(PerClass, *[ODD] * len(CLASSES)),
    value=st.builds(PerClass, *[ODD] * len(CLASSES)))


def prompt(doc: int, length: int, branch: int | None, variant: int) -> list[int]:
    tokens = [doc * 1000 + i for i in range(length)]
    if branch is not None and branch < length:
        tokens[branch] = 90000 + variant
    return tokens


class IndexMachine(RuleBasedStateMachine):
    config: Config
    target: RedisTarget  # the service's Redis user, as the index runs in production
    operator_target: RedisTarget | None = None  # empties and inspects; None: `target` may
    acks: ReplicaAcks | None = None  # a cluster: every write script pipelined with its WAIT
    stage_bytes: int = STAGE_BYTES  # steps whose new hashes reach it stage them (none here)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis = connect(self.target)
        self.operator = connect(self.operator_target or self.target)
        self.loop.run_until_complete(self.operator.flushall())
        self.now = 1_000.0  # both faces' clock (s): leases run out as `time_passes` says
        self.call_nonce = 0  # both faces draw this nonce for the tickets of one operation
        real = PrefixIndex(self.redis, "m", self.config, acks=self.acks, lease_s=LEASE_S,
                           clock=self.clock, nonce=self.nonce, stage_bytes=self.stage_bytes)
        ref = ReferenceIndex(self.config, pool_id="m", lease_s=LEASE_S, clock=self.clock,
                             nonce=self.nonce)
        for index in (real, ref):
            self.loop.run_until_complete(index.create())
        self.real = Driver(real, self.config)
        self.ref = Driver(ref, self.config)
        self.status: dict[str, str] = {}
        self.tickets: list[int] = []
        self.serial = 0

    def clock(self) -> float:
        return self.now

    def nonce(self) -> int:
        return self.call_nonce

    def next_nonce(self) -> None:
        """A new nonce for the next operation on both faces (an LCG: the same on both)."""
        self.call_nonce = (self.call_nonce * 1103515245 + 12345) % (1 << NONCE_BITS)

    def teardown(self) -> None:
        self.loop.run_until_complete(close(self.redis))
        self.loop.run_until_complete(close(self.operator))
        self.loop.close()

    def both(self, op: str, *args):
        """Run one operation on both sides; they must agree on the result or on the error."""
        outcomes = []
        self.next_nonce()
        for driver in (self.real, self.ref):
            try:
                outcomes.append(self.loop.run_until_complete(getattr(driver, op)(*args)))
            except CacheIndexError as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1], f"{op}: redis {outcomes[0]!r} != reference {outcomes[1]!r}"
        return outcomes[0]

    def faces(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """One call straight on both faces (no driver); same agreement as `both`."""
        outcomes = []
        self.next_nonce()
        for index in (self.real.index, self.ref.index):
            try:
                outcomes.append(self.loop.run_until_complete(call(index)))
            except CacheIndexError as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1], f"redis {outcomes[0]!r} != reference {outcomes[1]!r}"
        return outcomes[0]

    @rule(data=st.data())
    def step(self, data) -> None:
        block = self.config.cache.hash_block_tokens
        requests, tokens = [], {}
        for _ in range(data.draw(st.integers(0, 2), label="new")):
            self.serial += 1
            rid = f"r{self.serial}"
            toks = prompt(data.draw(st.integers(0, 2)), data.draw(st.integers(1, 70)),
                          data.draw(st.none() | st.integers(0, 69)), data.draw(st.integers(0, 1)))
            requests.append(replace(new_request(rid, toks, data.draw(st.integers(1, 40)), block,
                                                data.draw(st.booleans())),
                                    stop_at_match=data.draw(st.booleans()),
                                    stop_at_page_end=data.draw(st.booleans()),
                                    stop_at_last_page_end=data.draw(st.booleans()),
                                    stop_at_resend_point=data.draw(st.booleans()),
                                    turn_end_kind=data.draw(st.none() | st.sampled_from(KEPT))))
            tokens[rid] = toks
        room = self.config.cache.max_batch - len(requests)  # no step over max_batch
        for rid, state in sorted(self.status.items()):
            if room == 0:
                break
            if state == "committed" and data.draw(st.booleans(), label=f"continue {rid}"):
                room -= 1
                requests.append(StepRequest(rid, data.draw(st.integers(1, 40)),
                                            stop_at_match=data.draw(st.booleans()),
                                            stop_at_page_end=data.draw(st.booleans()),
                                            stop_at_last_page_end=data.draw(st.booleans()),
                                            stop_at_resend_point=data.draw(st.booleans())))
        result = self.both("plan", requests, tokens)
        if isinstance(result, StepPlan):
            self.tickets.append(result.ticket)
            for r in result.requests:
                self.status[r.rid] = "planned"

    @rule(doc=st.integers(0, 2), length=st.integers(1, 70), branch=st.none() | st.integers(0, 69),
          variant=st.integers(0, 1), chunk=st.integers(1, 40), keep=st.booleans(),
          at_match=st.booleans(), at_page=st.booleans(), at_last=st.booleans(), spec=st.booleans(),
          at_resend=st.booleans())
    def serve(self, doc, length, branch, variant, chunk, keep, at_match, at_page, at_last,
              spec, at_resend) -> None:
        """A whole prefill the way an engine runs it, so later requests find a warm cache; with
        `at_match`/`at_page`/`at_last`/`at_resend` its steps stop at branch points, page ends and
        an aligned prompt's resend point, and the checkpoints there are kept, classed as a policy
        would (`spec`: rungs above the deepest)."""
        self.serial += 1
        rid = f"s{self.serial}"
        toks = prompt(doc, length, branch, variant)
        block, page = self.config.cache.hash_block_tokens, self.config.cache.page_tokens
        split = {"stop_at_match": at_match, "stop_at_page_end": at_page,
                 "stop_at_last_page_end": at_last, "stop_at_resend_point": at_resend}
        step = replace(new_request(rid, toks, chunk, block), turn_end_kind="turn", **split)
        while True:
            plan = self.both("plan", [step], {rid: toks})
            if not isinstance(plan, StepPlan):
                break
            self.both("confirm", plan.ticket)
            (r,) = plan.requests
            ck = r.stop // block * block
            if r.stop == length or (at_resend and r.stop == length - block and length % block == 0):
                kind = "turn"
            elif at_match and r.stop == r.match_tokens:
                kind = "branch"
            elif (at_page or at_last) and r.stop % page == 0:
                kind = "spec" if spec and r.stop < (length - 1) // page * page else "rung"
            else:
                kind = "intermediate"
            item = CommitItem(rid, r.stop, ck if r.checkpoint_pages else 0, kind=kind)
            self.both("confirm", self.both("commit", [item]).ticket)
            if r.stop == length:
                break
            step = StepRequest(rid, chunk, **split)
        if keep and isinstance(plan, StepPlan):
            self.status[rid] = "done" if r.stop == length else "committed"
        else:
            self.both("release", [rid])

    def draw_commit(self, data, rids: list[str]) -> list[CommitItem]:
        """A commit item per planned request: a stop inside its plan, a checkpoint or not."""
        block = self.config.cache.hash_block_tokens
        items = []
        for rid in rids:
            plan = self.real.plans[rid]
            stop = data.draw(st.integers(plan.start + 1, plan.stop))
            ck = stop // block * block
            with_ck = bool(plan.checkpoint_pages) and ck > plan.start and data.draw(st.booleans())
            kind = data.draw(st.none() | st.sampled_from(COMMIT_KINDS))
            durable = kind is None and data.draw(st.booleans())
            items.append(CommitItem(rid, stop, ck if with_ck else 0, durable, kind))
        return items

    def committed(self, items: list[CommitItem], ticket: int) -> None:
        self.tickets.append(ticket)
        for item in items:
            done = item.stop == len(self.real.tokens[item.rid])
            self.status[item.rid] = "done" if done else "committed"

    def planned(self) -> list[str]:
        return sorted(rid for rid, s in self.status.items() if s == "planned")

    @rule(data=st.data())
    def commit(self, data) -> None:
        planned = self.planned()
        if not planned:
            return
        items = self.draw_commit(data, data.draw(st.lists(st.sampled_from(planned), min_size=1,
                                                          unique=True)))
        result = self.both("commit", items)
        if isinstance(result, type):  # refused whole (more than max_batch): nothing changed
            return
        self.committed(items, result.ticket)

    @rule(data=st.data())
    def commit_together(self, data) -> None:
        """Several callers' commits in one call (the service's merged commits): each group
        its own ticket, as if committed one after the other."""
        planned = self.planned()
        if len(planned) < 2:
            return
        items = self.draw_commit(data, data.draw(st.lists(st.sampled_from(planned), min_size=2,
                                                          unique=True)))
        cuts = sorted(data.draw(st.sets(st.integers(1, len(items) - 1), min_size=1)))
        groups = [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)])]
        results = self.both("commit_groups", groups)
        if isinstance(results, type):
            return
        assert len({r.ticket for r in results}) == len(groups)
        for group, result in zip(groups, results):
            assert [r.rid for r in result.requests] == [i.rid for i in group]
            self.committed(group, result.ticket)

    @rule(data=st.data())
    def confirm_together(self, data) -> None:
        """Several tickets in one call, an unknown or repeated one among them failing none of
        the others."""
        if not self.tickets:
            return
        tickets = data.draw(st.lists(st.sampled_from(self.tickets), min_size=1, max_size=4))
        if data.draw(st.booleans(), label="an unknown ticket too"):
            tickets.insert(data.draw(st.integers(0, len(tickets))), 10**9)
        for ticket in set(tickets) & set(self.tickets):
            self.tickets.remove(ticket)
        self.both("confirm_many", tickets)

    @rule(data=st.data())
    def confirm(self, data) -> None:
        if self.tickets:
            ticket = data.draw(st.sampled_from(self.tickets))
            self.tickets.remove(ticket)
            self.both("confirm", ticket)

    @rule(data=st.data())
    def release(self, data) -> None:
        if self.status:
            rids = data.draw(st.lists(st.sampled_from(sorted(self.status)), min_size=1, max_size=3,
                                      unique=True))
            self.both("release", rids)
            for rid in rids:
                del self.status[rid]

    @rule(seconds=st.sampled_from([0.001, 1.0, LEASE_S - 0.5, LEASE_S]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(count=st.integers(1, 3))
    def reap(self, count: int) -> None:
        """The lease reaper: the same requests go on both sides (the invariant compares the
        records and the leases), at most `count`, the earliest deadlines first."""
        before = set(self.ref.index.s.req)
        result = self.faces(lambda index: index.reap(count))
        gone = sorted(before - set(self.ref.index.s.req))
        if isinstance(result, type):  # both refused: another replica bumped the epoch
            assert not gone
            return
        assert result.released == len(gone) <= count, (result, gone)
        for driver in (self.real, self.ref):
            driver.forget(gone)
        for rid in gone:
            self.status.pop(rid, None)

    @rule(count=st.integers(1, 4))
    def evict(self, count: int) -> None:
        self.both("evict", count)

    @rule(weights=WEIGHTS, batch=st.integers(1, 8))
    def reweigh(self, weights: EvictionWeights, batch: int) -> None:
        """A policy switch: new weights, the eviction order rescored a few page ids per call
        (both must count the same calls)."""
        self.faces(lambda index: index.reweigh(weights, batch))

    @rule(doc=st.integers(0, 2), length=st.integers(1, 70), branch=st.none() | st.integers(0, 69),
          variant=st.integers(0, 1))
    def probe(self, doc, length, branch, variant) -> None:
        """What a router would be told of a prompt now: the same on both, and nothing changes."""
        hashes = chain_hashes(prompt(doc, length, branch, variant), ROOT,
                              self.config.cache.hash_block_tokens)
        self.faces(lambda index: index.probe(length, hashes))

    @rule(data=st.data())
    def continue_uncommitted_is_refused(self, data) -> None:
        planned = sorted(rid for rid, s in self.status.items() if s == "planned")
        if planned:
            outcome = self.both("plan", [StepRequest(data.draw(st.sampled_from(planned)), 1)], {})
            assert isinstance(outcome, type) and issubclass(outcome, ValueError)

    @rule()
    def release_everything(self) -> None:
        """Once every request is released, no pin and no private page may be left anywhere."""
        if self.status:
            self.both("release", sorted(self.status))
            self.status.clear()
        state = self.loop.run_until_complete(read_pool(self.redis, self.real.index.keys))
        leads = [rec for rec in state.pages.values() if "pages" in rec]
        assert all(rec["ref"] == 0 for rec in leads), "a pin outlived every request"
        assert all(rec["st"] != "private" for rec in leads), "a private page outlived its request"
        assert state.req == {} and state.reqh == {}
        assert state.tix == {}, "a ticket outlived every request it spoke for"

    @rule(elsewhere=st.booleans(), seen=st.none() | st.sampled_from([0, -1]))
    def invalidate(self, elsewhere: bool, seen: int | None) -> None:
        """The pool's bytes are lost. `elsewhere`: another replica's face invalidates it, so the
        faces under test hold a voided epoch; `seen`: only if the pool is still in the epoch the
        face under test saw (-1: one already gone, which must change nothing)."""
        seen_epoch = None if seen is None else self.real.index.epoch + seen
        if elsewhere:
            faces = [PrefixIndex(self.redis, "m", self.config, lease_s=LEASE_S, clock=self.clock),
                     ReferenceIndex(self.config, pool_id="m", pool=self.ref.index.pool)]
        else:
            faces = [self.real.index, self.ref.index]
        before = self.ref.index.s.epoch
        bumps = seen_epoch is None or seen_epoch == before
        epochs = [self.loop.run_until_complete(face.invalidate(seen_epoch)) for face in faces]
        assert epochs == [before + bumps] * 2, f"epoch {before}, seen {seen_epoch}: {epochs}"
        if not bumps:
            return
        for driver in (self.real, self.ref):
            driver.invalidated()
        self.status.clear()
        self.tickets.clear()

    @invariant()
    def redis_equals_reference_and_is_sane(self) -> None:
        state = self.loop.run_until_complete(read_pool(self.redis, self.real.index.keys))
        expected = self.ref.index.s
        for name in ("epoch", "tick", "ticket", "clock", "fresh", "free", "ep", "ck", "lru", "reqh",
                     "tix", "pages", "req", "durable_cks", "lease"):
            assert getattr(state, name) == getattr(expected, name), f"{name} differs"
        assert self.real.index.epoch == self.ref.index.epoch, "the faces saw different epochs"
        stats = self.faces(lambda index: index.stats())
        assert stats == recount(state, self.config.cache.num_pages), "stats() != the records"
        sanity_check(state, self.config.cache.num_pages, self.config.cache.blocks_per_page)
        staged = self.loop.run_until_complete(self.operator.keys("ct:*:stage:*"))
        assert not staged, f"staged hashes outlived their call: {staged}"


@pytest.mark.parametrize("config, stage_bytes", [
    pytest.param(small_config(num_pages=64), STAGE_BYTES, id="kda3-mla1"),
    # a step's new hashes staged from 10 blocks' worth on: some steps staged, some not
    pytest.param(small_config(num_pages=64), 160, id="kda3-mla1-staged"),
    pytest.param(small_config(kda_groups=2, mla_groups=2, num_pages=56), STAGE_BYTES,
                 id="kda2-mla2"),
    pytest.param(small_config(kda_groups=0, num_pages=24), STAGE_BYTES, id="full-attention"),
    pytest.param(small_config(num_pages=64, family="gdn-gqa"), STAGE_BYTES, id="gdn3-gqa1"),
])
def test_scripts_match_reference(redis_url, operator_url, config, stage_bytes) -> None:
    machine = type("Machine", (IndexMachine,), {
        "config": config, "target": RedisTarget(redis_url, max_connections=4),
        "operator_target": RedisTarget(operator_url), "stage_bytes": stage_bytes})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_scripts_match_reference_on_a_redis_cluster(redis_cluster) -> None:
    """The same machine through the cluster client, every write acknowledged by a replica, every
    step's new hashes staged. WAIT answers as soon as the replica has the write: the long
    timeout only spares the machine a replica lagging past the default 100 ms on a loaded
    2-core host, which no rule expects (it failed a run so)."""
    nodes = redis_cluster.startup_nodes
    target = RedisTarget.cluster(nodes, max_connections=4, **SERVICE_LOGIN)
    machine = type("Machine", (IndexMachine,), {"config": small_config(num_pages=64),
                                                "target": target,
                                                "operator_target": RedisTarget.cluster(
                                                    nodes, **OPERATOR_LOGIN),
                                                "acks": ReplicaAcks(timeout_ms=2000),
                                                "stage_bytes": 0})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=20, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_a_hit_exactly_at_the_turn_end_promotes_the_restored_intermediate_alike(redis_url,
                                                                                operator_url) -> None:
    """The rule the random machine reaches only rarely, step by step on both sides: `b` hits `a`'s
    intermediate checkpoint at its own turn end (8) with a `turn_end_kind`, and the plan promotes
    it (`a`'s commit in the same step would recycle it otherwise)."""
    machine = type("Machine", (IndexMachine,), {"config": small_config(num_pages=64),
                                                 "target": RedisTarget(redis_url),
                                                 "operator_target": RedisTarget(operator_url)})()
    try:
        def run(op, *args):
            out = machine.both(op, *args)
            machine.redis_equals_reference_and_is_sane()
            return out
        a = prompt(0, 40, None, 0)
        step = run("plan", [new_request("a", a, 8, 4)], {"a": a})
        run("confirm", step.ticket)
        run("confirm", run("commit", [CommitItem("a", 8, 8, kind="intermediate")]).ticket)
        b = a[:10] + [7]
        step = run("plan", [StepRequest("a", 8), replace(new_request("b", b, 8, 4),
                                                         turn_end_kind="rung")], {"b": b})
        assert [r.hit_tokens for r in step.requests] == [0, 8]
        run("confirm", step.ticket)
        run("confirm", run("commit", [CommitItem("a", 16, 16, kind="turn"),
                                      CommitItem("b", 11)]).ticket)
        run("release", ["b"])
        state = machine.ref.index.s
        assert sorted(state.pages[lead]["cls"] for lead in state.ck.values()) == ["rung", "turn"]
        run("release", ["a"])
    finally:
        machine.teardown()
