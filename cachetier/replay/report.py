"""What `cachetier replay` prints and draws: the `--json` objects, the tables and the sweep plot.

The JSON keys of the issue (`trace`, `requests`, `budget_bytes`, `policies` and, per policy,
`hit_ratio`, `checkpoints_written`, `checkpoints_alive`, `checkpoint_bytes`, `evictions`) are a
contract; the others are extras.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachetier.replay.replayer import BudgetResult, PolicyResult

_SIZE_UNITS = (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_size(budget_bytes: int | None) -> str:
    """`400GB`, `1.6TB`: the form `parse_budget` reads back."""
    if budget_bytes is None:
        return "unlimited"
    for unit, scale in _SIZE_UNITS:
        if budget_bytes >= scale:
            return f"{budget_bytes / scale:.4g}{unit}"
    return f"{budget_bytes}B"


def policy_json(result: PolicyResult) -> dict[str, Any]:
    c = result.counters
    return {"hit_ratio": round(result.hit_ratio, 4), "checkpoints_written": c.checkpoints_written,
            "checkpoints_alive": c.checkpoints_alive, "checkpoint_bytes": c.checkpoint_bytes,
            "evictions": c.evictions, "hit_tokens": result.hit_tokens,
            "input_tokens": result.input_tokens,
            "refused": sum(s.refused for s in result.served),
            "budget_pages": result.budget_pages, "wall_s": round(result.wall_s, 1)}


def _policies_json(result: BudgetResult) -> dict[str, Any]:
    return {name: policy_json(p) for name, p in result.policies.items()}


def replay_json(trace: str, requests: int, result: BudgetResult, preset: str,
                chunk_tokens: int) -> dict[str, Any]:
    return {"trace": trace, "requests": requests, "budget_bytes": result.budget_bytes,
            "policies": _policies_json(result), "preset": preset, "chunk_tokens": chunk_tokens,
            "wall_s": round(result.wall_s, 1)}


def sweep_json(trace: str, requests: int, results: list[BudgetResult], preset: str,
               chunk_tokens: int, plot: Path) -> dict[str, Any]:
    return {"trace": trace, "requests": requests,
            "sweep": [{"budget_bytes": r.budget_bytes, "policies": _policies_json(r),
                       "wall_s": round(r.wall_s, 1)} for r in results],
            "preset": preset, "chunk_tokens": chunk_tokens, "plot": str(plot)}


def format_table(trace: str, requests: int, result: BudgetResult) -> str:
    header = (f"{trace}: {requests} requests, budget {format_size(result.budget_bytes)}, "
              f"{result.wall_s:.1f} s")
    columns = ("policy", "hit_ratio", "hit_tokens", "ck_written", "ck_alive", "ck_GB",
               "evictions", "refused", "wall_s")
    rows = [columns]
    for name, p in result.policies.items():
        c = p.counters
        rows.append((name, f"{p.hit_ratio:.4f}", f"{p.hit_tokens:,}", str(c.checkpoints_written),
                     str(c.checkpoints_alive), f"{c.checkpoint_bytes / 1e9:.1f}",
                     str(c.evictions), str(sum(s.refused for s in p.served)), f"{p.wall_s:.1f}"))
    return "\n".join([header, *_align(rows)])


def format_sweep(trace: str, requests: int, results: list[BudgetResult]) -> str:
    """Hit ratio per policy (rows) and budget (columns)."""
    names = list(dict.fromkeys(n for r in results for n in r.policies))
    rows = [("policy", *(format_size(r.budget_bytes) for r in results))]
    for name in names:
        rows.append((name, *(f"{r.policies[name].hit_ratio:.4f}" if name in r.policies else ""
                             for r in results)))
    return "\n".join([f"{trace}: {requests} requests, hit ratio by budget", *_align(rows)])


def _align(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]


def write_sweep_plot(results: list[BudgetResult], path: Path, title: str) -> None:
    """Hit ratio against capacity, one line per policy; budgets are evenly spaced in the order
    given (unlimited has no position on a byte axis)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(dict.fromkeys(n for r in results for n in r.policies))
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name in names:
        ax.plot(x, [r.policies[name].hit_ratio if name in r.policies else float("nan")
                    for r in results], marker="o", label=name)
    ax.set_xticks(list(x), [format_size(r.budget_bytes) for r in results])
    ax.set(xlabel="cache capacity (bytes of unified pages, padding included)",
           ylabel="prefix hit ratio (token-weighted)", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
