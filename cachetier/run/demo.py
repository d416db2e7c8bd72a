"""`cachetier demo`: the whole system doing its job, checked, on this machine.

It brings up the local cluster (`cachetier.run.cluster`), attaches to the agent's pool like a
co-located inference worker, and serves agentic multi-turn sessions (`cachetier.engine.sessions`)
through the tiny hybrid model with `PrefillScheduler`: every forward pass reads and writes pool
pages only, and every request's outputs are compared with a cold recompute. The report says how
much prefill the cache saved and whether anything it served was wrong; the plot shows the hit
ratio as the cache warms up.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cachetier.engine.checkpoint_placement import PLACEMENTS
from cachetier.engine.scheduler import PrefillScheduler, RequestResult
from cachetier.engine.sessions import SessionSpec, make_sessions
from cachetier.run.cluster import POOL, Cluster, ClusterError
from cachetier.run.progress import ProgressBar
from gpu_pool.pool import PagedPool
from tinymodel import TinyHybrid

_HANDLE_WAIT_S = 30.0


@dataclass(frozen=True)
class DemoOptions:
    sessions: SessionSpec
    policy: str = "branch"
    chunk_tokens: int = 48
    json: bool = False
    plot: Path | None = None  # default: demo-hit-ratio.png in the run directory


@dataclass(frozen=True)
class DemoReport:
    """The `--json` keys up to `checkpoint_bytes` are a contract; the rest are extras."""

    requests: int
    hit_requests: int
    tokens: int
    hit_tokens: int
    verified: int
    mismatches: int
    checkpoints: int
    checkpoint_bytes: int
    hit_ratio: float
    durable_checkpoints: int
    sessions: int
    steps: int
    policy: str
    seconds: float
    plot: str

    @classmethod
    def build(cls, results: list[RequestResult], checkpoints: int, durable: int,
              checkpoint_bytes: int, steps: int, policy: str, seconds: float,
              plot: Path) -> DemoReport:
        tokens = sum(r.prompt_tokens for r in results)
        hit_tokens = sum(r.hit_tokens for r in results)
        return cls(requests=len(results), hit_requests=sum(r.hit_tokens > 0 for r in results),
                   tokens=tokens, hit_tokens=hit_tokens,
                   verified=sum(r.verified is True for r in results),
                   mismatches=sum(r.verified is False for r in results),
                   checkpoints=checkpoints, checkpoint_bytes=checkpoint_bytes,
                   hit_ratio=round(hit_tokens / tokens, 4) if tokens else 0.0,
                   durable_checkpoints=durable, sessions=len({r.session for r in results}),
                   steps=steps, policy=policy, seconds=round(seconds, 1), plot=str(plot))

    def table(self) -> str:
        rows = [("requests", f"{self.requests} ({self.hit_requests} hit) in {self.sessions} "
                             f"sessions, {self.steps} steps"),
                ("tokens requested", f"{self.tokens:,}"),
                ("tokens served from cache", f"{self.hit_tokens:,}"),
                ("hit ratio (token-weighted)", f"{self.hit_ratio:.1%}"),
                ("checkpoints kept", f"{self.checkpoints} ({self.durable_checkpoints} durable), "
                                     f"{self.checkpoint_bytes:,} bytes pooled"),
                ("outputs verified vs recompute", f"{self.verified} of {self.requests}"),
                ("mismatches", f"{self.mismatches}"),
                ("policy / time", f"{self.policy}, {self.seconds} s"),
                ("plot", self.plot)]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run_demo(cluster: Cluster, options: DemoOptions) -> None:
    """The job `cachetier.run.cluster.up` runs once the cluster is up; prints the report. The tiny
    model's matrices are far too small for a thread pool: under load, threads only wait on
    each other (measured 10x slower), hence one torch thread."""
    torch.set_num_threads(1)
    report = asyncio.run(_serve(cluster, options))
    print(json.dumps(asdict(report)) if options.json else report.table(), flush=True)


async def _serve(cluster: Cluster, options: DemoOptions) -> DemoReport:
    config = cluster.settings.config
    ranks = [PagedPool.attach(_read_handle(cluster.handle_file(rank)))
             for rank in range(cluster.settings.agents)]
    model = TinyHybrid(config.model)
    sessions = make_sessions(options.sessions)
    bar = ProgressBar(sum(len(s.prompts) for s in sessions), "demo")
    results: list[RequestResult] = []

    def on_result(result: RequestResult) -> None:
        results.append(result)
        verdict = {True: "ok", False: "MISMATCH", None: "unchecked"}[result.verified]
        bar.advance(note=f"{result.rid}: hit {result.hit_tokens}/{result.prompt_tokens} {verdict}")

    started = time.monotonic()
    async with cluster.client() as tier:
        scheduler = PrefillScheduler(tier, POOL, config, PLACEMENTS[options.policy], model, ranks,
                                     chunk_tokens=options.chunk_tokens, on_result=on_result)
        await scheduler.run(sessions)
        stats = await tier.stats(POOL)
    plot = options.plot or cluster.run_dir / "demo-hit-ratio.png"
    write_plot(results, plot, options.policy)
    pooled = config.model.kda_groups * config.geometry.page_id_bytes
    return DemoReport.build(results, stats.checkpoints, stats.durable_checkpoints,
                            stats.checkpoints * pooled, scheduler.step_count, options.policy,
                            time.monotonic() - started, plot)


def _read_handle(path: Path) -> object:
    """The agent writes its handle once its pool exists, atomically (a rename)."""
    deadline = time.monotonic() + _HANDLE_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"no pool handle at {path} within {_HANDLE_WAIT_S:g} s")
        time.sleep(0.05)
    return pickle.loads(path.read_bytes())


def write_plot(results: list[RequestResult], path: Path, policy: str) -> None:
    """Cumulative token-weighted hit ratio, and each request's own, in the order they finished."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    served = requested = 0
    cumulative, own = [], []
    for r in results:
        served += r.hit_tokens
        requested += r.prompt_tokens
        cumulative.append(served / requested)
        own.append(r.hit_tokens / r.prompt_tokens)
    x = range(1, len(results) + 1)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.scatter(x, own, s=12, alpha=0.5, label="request")
    ax.plot(x, cumulative, linewidth=2, label="cumulative (token-weighted)")
    ax.set(xlabel="requests finished", ylabel="prefix cache hit ratio", ylim=(0, 1),
           title=f"cachetier demo: tiny hybrid model, checkpoint placement {policy}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
