"""The service's Prometheus metrics scraped while the demo runs, and `cachetier chaos` with a
few faults of each kind, on one local cluster (`run.cluster`: real redis-server, mosquitto,
service and agent processes, the agents forked from the zygote the campaign restarts them with).

The demo's report is the oracle of the counters: every request it served is one lookup, its
tokens the requested tokens, its hit tokens the hit tokens. The campaign's report must show no
wrong hit, no error that is not retryable and no pin or page left.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cachetier.config import load_config
from cachetier.engine.sessions import SessionSpec
from cachetier.run.chaos import KINDS, Campaign, ChaosOptions
from cachetier.run.cluster import POOL, Cluster, ClusterSettings
from cachetier.run.demo import DemoOptions, _serve

pytestmark = pytest.mark.slow  # a campaign of faults

AGENTS = 2
COPY_TIMEOUT_S = 1.0
LEASE_S = 1.0  # the chaos kind `lease_expiry` stalls a scheduler past it

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    overrides = {"model.tp_degree": str(AGENTS)}
    settings = ClusterSettings(
        run_dir=tmp_path_factory.mktemp("cluster"), secret="metrics-chaos-secret",
        config=load_config("tiny", overrides=overrides),
        serve_config_args=("--preset", "tiny", f"--set=model.tp_degree={AGENTS}"),
        agents=AGENTS, port=0, metrics_port=0, agent_zygote=True,
        serve_args=("--copy-timeout", str(COPY_TIMEOUT_S), "--request-lease", str(LEASE_S)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `demo` and `chaos` run the tiny model (10x faster here)
    try:
        with Cluster(settings) as running:
            yield running
    finally:
        torch.set_num_threads(threads)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    return sum(v for (n, have), v in samples.items()
               if n == name and set(labels.items()) <= set(have))


async def test_metrics_move_as_the_demo_reports_while_it_runs(cluster):
    url = cluster.metrics_url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert url in (cluster.run_dir / "cluster.json").read_text()
    before = await asyncio.to_thread(scrape, url)
    demo = asyncio.create_task(_serve(cluster, DemoOptions(SessionSpec(sessions=6, turns=3),
                                                           plot=cluster.run_dir / "demo.png")))
    seen = []
    while not demo.done():
        now = await asyncio.to_thread(scrape, url)
        seen.append(total(now, "cachetier_lookups_total", kind="plan"))
        await asyncio.sleep(0.1)
    report = await demo
    await asyncio.sleep(1.1)  # past the pool gauges' refresh interval
    after = await asyncio.to_thread(scrape, url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    plan = {"pool": POOL, "kind": "plan"}
    assert moved("cachetier_lookups_total", **plan) == report.requests
    assert moved("cachetier_requested_tokens_total", **plan) == report.tokens
    assert moved("cachetier_hit_tokens_total", **plan) == report.hit_tokens > 0
    assert moved("cachetier_hits_total", **plan) == report.hit_requests
    first, last = total(before, "cachetier_lookups_total", kind="plan"), seen[-1]
    assert seen == sorted(seen) and any(first < s < last for s in seen), seen  # it moved live
    plans = value(after, "cachetier_request_seconds_count", op="plan")
    assert plans > 0 and value(after, "cachetier_request_seconds_count", op="commit") > 0
    assert value(after, "cachetier_request_seconds_bucket", op="plan", le="+Inf") == plans
    async with cluster.client() as tier:
        stats = await tier.stats(POOL)
    assert value(after, "cachetier_pool_free_pages", pool=POOL) == stats.free_pages
    assert value(after, "cachetier_pool_evictable_pages", pool=POOL) == stats.evictable_pages
    assert value(after, "cachetier_pool_pins_held", pool=POOL) == stats.requests == 0
    assert value(after, "cachetier_pool_pages", pool=POOL) == stats.num_pages
    assert value(after, "cachetier_pool_epoch", pool=POOL) == stats.epoch


async def test_chaos_campaign_serves_no_wrong_byte_and_leaks_nothing(cluster):
    before = await asyncio.to_thread(scrape, cluster.metrics_url)
    started = time.monotonic()
    options = ChaosOptions(kills=2 * len(KINDS), clients=3, model_every=5, storm_messages=40,
                           copy_timeout_s=COPY_TIMEOUT_S, lease_s=LEASE_S)
    report = await Campaign(cluster, options).run()
    assert report.per_kind == {kind: 2 for kind in KINDS}, report
    assert report.kills == 2 * len(KINDS)
    assert report.hits_checked > 0 and report.model_runs >= 2 and report.model_hit_requests > 0
    assert (report.wrong_hits, report.model_mismatches, report.non_retryable_errors) == (0, 0, 0), \
        report.problems
    assert (report.leaked_pins, report.leaked_pages, report.sanity) == (0, 0, "ok"), report
    assert report.not_serving_again == 0, report.problems
    # the broker authenticates: the anonymous storm is refused, the observer's is taken and
    # dropped by the topic ACL; neither moves the epoch
    assert (report.storm_refused, report.storm_published) == (1, options.storm_messages), report
    assert report.storm_epoch_bumps == 0, report
    # the stalled schedulers' late passes: refused where their pages were handed on (and no
    # hit read them: wrong_hits above), or harmless where nobody had them yet
    assert report.late_writes_refused + report.late_writes_landed <= 2, report
    assert 0 < report.restart_p50_s < 10
    assert report.retryable_errors.get("agent_lost", 0) > 0, report
    assert time.monotonic() - started < 60
    after = await asyncio.to_thread(scrape, cluster.metrics_url)
    bumps = (value(after, "cachetier_epoch_bumps_total", pool=POOL)
             - value(before, "cachetier_epoch_bumps_total", pool=POOL))
    assert bumps >= 2 * 2  # every agent killed or frozen started a new epoch
    assert total(after, "cachetier_errors_total", code="agent_lost", retryable="true") > 0


async def test_pool_gauges_read_each_pool_at_most_once_per_interval_whatever_the_scrapes():
    from cachetier.service.metrics import ServiceMetrics
    from index.records import IndexStats

    class Pool:
        reads = 0

        async def stats(self) -> IndexStats:
            Pool.reads += 1
            await asyncio.sleep(0.01)  # concurrent scrapes overlap this read
            return IndexStats(7, 256, 100 + Pool.reads, 5, 0, 0, 0, 0)

    series = ServiceMetrics(refresh_s=0.2)
    series.watch(lambda: {"a": Pool(), "b": Pool()})
    bodies = await asyncio.gather(*(series.exposition() for _ in range(10)))
    assert Pool.reads == 2 and len(set(bodies)) == 1  # one read per pool for ten scrapes
    await series.exposition()
    assert Pool.reads == 2
    await asyncio.sleep(0.25)
    assert b'cachetier_pool_free_pages{pool="a"} 10' in await series.exposition()
    assert Pool.reads == 4
