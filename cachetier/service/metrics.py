"""The service's Prometheus series: a `ServiceObserver` counting what the service answers, and
the pools' page gauges read from the index's O(1) `stats` at scrape time.

Counters move on the hot path (a dictionary update each, no I/O). The gauges that need Redis
(free, evictable and held pages per pool) are never read per step: a scrape reads every pool's
`stats` at most once per `refresh_s` (concurrent scrapes share one read), so the cost Redis
sees is bounded by the number of pools whatever the scrape rate. Labels are bounded too: a pool
label only ever names a pool that answered a plan (pools are registered by agents), errors are
labelled by operation and code, never by pool (a client may name any pool), refusal reasons by
the fixed words before the figures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cachetier.errors import ErrorInfo
from cachetier.service.observer import ServiceObserver
from cachetier.wire.protocol import Pin, Plan, PlanReply
from index.prefix import PinnedPrefix
from index.records import IndexStats, StepPlan

logger = logging.getLogger("cachetier.service.metrics")


class StatsReader(Protocol):
    async def stats(self) -> IndexStats: ...


Indexes = Callable[[], Mapping[str, StatsReader]]  # `CacheTierService.indexes`

# a step is 1-3 ms on one server, tens of ms under load or with WAIT, seconds when an agent
# times out
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                   10.0)

_POOL_GAUGES = (  # (series, IndexStats field, help)
    ("cachetier_pool_pages", "num_pages", "Page ids of the pool."),
    ("cachetier_pool_free_pages", "free_pages", "Page ids free in the pool's current epoch."),
    ("cachetier_pool_evictable_pages", "evictable_pages",
     "Page ids held by cached entries nobody pins (what eviction may free)."),
    ("cachetier_pool_pins_held", "requests",
     "Requests and readers of the pool holding pins until they are released."),
    ("cachetier_pool_pending_tickets", "pending_tickets", "Tickets planned or committed, "
                                                          "not confirmed yet."),
    ("cachetier_pool_checkpoints", "checkpoints", "Checkpoints registered in the pool."),
    ("cachetier_pool_epoch", "epoch", "The pool's epoch (it moves at every invalidation)."),
)


def refusal_reason(reason: str) -> str:
    """The fixed part of a refusal's reason ("pool exhausted: the step needs 5 pages, ...")."""
    return reason.split(":", 1)[0].strip().replace(" ", "_") or "unknown"


class PoolGauges(Collector):
    """The last pool counters read, as gauges; `refresh` reads them again when they are older
    than `refresh_s`. A pool whose read fails (Redis down, recovering) is left out of that
    scrape and counted in `cachetier_pool_stats_failures`."""

    def __init__(self, refresh_s: float) -> None:
        self.indexes: Indexes = dict
        self.refresh_s = refresh_s
        self.stats: Mapping[str, IndexStats] = {}
        self.read_at = float("-inf")
        self.failures = 0
        self._reading: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        if time.monotonic() - self.read_at < self.refresh_s:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(self._reading)

    async def _read(self) -> None:
        indexes = self.indexes()
        read = await asyncio.gather(*(index.stats() for index in indexes.values()),
                                    return_exceptions=True)
        self.stats = {}
        for pool, stats in zip(indexes, read):
            if isinstance(stats, IndexStats):
                self.stats[pool] = stats
            else:
                logger.warning("pool %s: stats for the metrics failed: %s", pool, stats)
                self.failures += 1
        self.read_at = time.monotonic()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, attr, doc in _POOL_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, stats in sorted(self.stats.items()):
                family.add_metric([pool], getattr(stats, attr))
            yield family
        failures = GaugeMetricFamily("cachetier_pool_stats_failures",
                                     "Reads of a pool's stats for the metrics that failed.")
        failures.add_metric([], self.failures)
        yield failures


class ServiceMetrics(ServiceObserver):
    """See the module docstring. `watch(service.indexes)` names the pools whose gauges it
    reads; `exposition()` is one scrape's body (text format)."""

    def __init__(self, refresh_s: float = 1.0) -> None:
        self.registry = CollectorRegistry()  # one per service: tests run several in one process
        r = self.registry
        self.lookups = Counter("cachetier_lookups", "New requests looked up (plan: a first step; "
                               "pin: a reader's prefix).", ["pool", "kind"], registry=r)
        self.hits = Counter("cachetier_hits", "Lookups that hit (a prefix of at least one hash "
                            "block).", ["pool", "kind"], registry=r)
        self.requested_tokens = Counter("cachetier_requested_tokens", "Prompt tokens of the "
                                        "lookups.", ["pool", "kind"], registry=r)
        self.hit_tokens = Counter("cachetier_hit_tokens", "Prompt tokens served from the cache.",
                                  ["pool", "kind"], registry=r)
        self.refusals = Counter("cachetier_refusals", "Steps the index refused (nothing changed).",
                                ["pool", "reason"], registry=r)
        self.evictions = Counter("cachetier_evictions", "Entries (endpoints and checkpoints) "
                                 "steps evicted.", ["pool"], registry=r)
        self.epoch_bumps = Counter("cachetier_epoch_bumps", "Pool invalidations (a lost agent, "
                                   "a recovery): everything cached before is gone.", ["pool"],
                                   registry=r)
        self.errors = Counter("cachetier_errors", "Client requests answered with an error.",
                              ["op", "code", "retryable"], registry=r)
        self.quota_rejections = Counter("cachetier_quota_rejections", "Requests refused at a "
                                        "client's quota, by limit.", ["limit"], registry=r)
        self.latency = Histogram("cachetier_request_seconds", "Time from dispatch to answer, by "
                                 "operation (plan includes its copies and confirm).", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.pools = PoolGauges(refresh_s)
        r.register(self.pools)

    def watch(self, indexes: Indexes) -> None:
        self.pools.indexes = indexes

    async def exposition(self) -> bytes:
        await self.pools.refresh()
        return generate_latest(self.registry)

    def answered(self, request: Any, reply: Any, error: ErrorInfo | None, seconds: float) -> None:
        op = getattr(request, "op", type(request).__name__)
        self.latency.labels(op).observe(seconds)
        if error is not None:
            self.errors.labels(op, error.code, str(error.retryable).lower()).inc()
        elif isinstance(request, Plan) and isinstance(reply, PlanReply):
            self._planned(request, reply)
        elif isinstance(request, Pin) and isinstance(reply, PinnedPrefix):
            self._looked_up(request.pool, "pin", request.prompt_tokens, reply.hit_tokens)

    def _planned(self, request: Plan, reply: PlanReply) -> None:
        if reply.refusal is not None:
            self.refusals.labels(request.pool, refusal_reason(reply.refusal.reason)).inc()
            return
        plan: StepPlan | None = reply.plan
        if plan is None:
            return
        new = {r.rid: r for r in request.requests if r.is_new}
        for step in plan.requests:
            if step.rid in new:
                self._looked_up(request.pool, "plan", new[step.rid].prompt_tokens or 0,
                                step.hit_tokens)
        if plan.evicted:
            self.evictions.labels(request.pool).inc(plan.evicted)

    def _looked_up(self, pool: str, kind: str, prompt_tokens: int, hit_tokens: int) -> None:
        self.lookups.labels(pool, kind).inc()
        self.requested_tokens.labels(pool, kind).inc(prompt_tokens)
        if hit_tokens:
            self.hits.labels(pool, kind).inc()
            self.hit_tokens.labels(pool, kind).inc(hit_tokens)

    def invalidated(self, pool: str, epoch: int) -> None:
        self.epoch_bumps.labels(pool).inc()

    def quota_rejected(self, pool: str | None, limit: str) -> None:
        self.quota_rejections.labels(limit).inc()
