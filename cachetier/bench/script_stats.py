"""The server's own view of the scripts a benchmark runs: `INFO commandstats` per EVAL-type command."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

SCRIPT_COMMANDS = ("cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha", "cmdstat_evalsha_ro",
                   "cmdstat_eval", "cmdstat_eval_ro")
STEP_COMMAND = "cmdstat_fcall"  # plan_step's and the no-op's; the bare round trip is EVALSHA_RO

ScriptStats = dict[str, tuple[int, int]]


async def script_stats(client: Redis) -> ScriptStats:
    """Per EVAL-type command, the scripts the server has run so far and the microseconds it spent
    in them: the server's own view of a step's round trips (the commands a script runs inside are
    not round trips and are not counted here) and of the share of its latency spent in Lua."""
    stats = await client.info("commandstats")
    return {name: (int(stats[name]["calls"]), int(stats[name]["usec"]))
            for name in SCRIPT_COMMANDS if name in stats}


def stats_delta(before: ScriptStats, after: ScriptStats,
                names: Sequence[str] = SCRIPT_COMMANDS) -> tuple[int, int]:
    """Scripts run and microseconds spent between two snapshots, over the commands `names`."""
    calls = usec = 0
    for name in names:
        (c0, u0), (c1, u1) = before.get(name, (0, 0)), after.get(name, (0, 0))
        calls, usec = calls + c1 - c0, usec + u1 - u0
    return calls, usec
