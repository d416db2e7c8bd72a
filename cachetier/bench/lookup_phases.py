"""`cachetier bench lookup --phases`: where plan_step's server time goes, phase by phase.

`plan_step.lua` marks where each of its phases ends with a `-- phase end: <name>` line (and its
origin with `-- phase start`), comments in the library cachetier loads. Here a copy of that
library is built in which every marker reads the server's clock (`TIME`, in microseconds) into a
trace the library keeps between calls, and one more function hands the trace back and clears it.
The copy's library and function names carry the digest of its own source, so it never replaces or
shadows cachetier's library, and it is deleted after the run.

A phase's time is the clock at its marker minus the clock at the marker before it, summed over
one call: the markers inside the per-request loops add up over the batch. Every phase holds one
clock reading, whose cost (`phase_probe_us`: the origin takes PROBE_READINGS readings back to
back) is subtracted. That is an estimate: one reading cost 1-2 us back to back here and up to
twice that amid the script's work, so a small phase reads high or low by a microsecond or so
per marker it holds, and one near a microsecond per request can read 0. The phases say where
the time goes; `server_us_per_request`, measured without probes, says how much there is.

The same steps also time the client's own work on either side of the call, which no phase sees:
building the step's arguments (`PrefixIndex.step_arguments`) and decoding its reply
(`decode_step`), the two parts of `plan_step` besides the call itself.
"""

from __future__ import annotations

import hashlib
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from cachetier.bench.script_stats import STEP_COMMAND, script_stats, stats_delta
from index.execution import LoadedLibrary, call_function
from index.records import StepPlan, StepRequest
from index.scripts import library
from index.store import PrefixIndex, decode_step

STEP_SCRIPT = "plan_step"
TRACE_SUFFIX = "phase_trace"
PROBE = "probe"
PROBE_READINGS = 16
_START = re.compile(r"^([ \t]*)-- phase start[ \t]*$", re.M)
_END = re.compile(r"^([ \t]*)-- phase end: ([a-z_]+)[ \t]*$", re.M)
_TRACE = """
-- bench lookup --phases: the clock at every phase marker of the last call, name then microseconds
local PHASE_TRACE = {}
local function phase_mark(name)
  local now = redis.call("TIME")
  PHASE_TRACE[#PHASE_TRACE + 1] = name
  PHASE_TRACE[#PHASE_TRACE + 1] = now[1] * 1000000 + now[2]
end
"""


@dataclass(frozen=True)
class PhaseLibrary:
    """The instrumented copy: its source, its name, its step function and its trace reader."""

    source: str
    name: str
    step_function: str
    trace_function: str

    @property
    def loaded(self) -> LoadedLibrary:
        """As `call_function` sends a library's function (loaded where missing)."""
        return LoadedLibrary(self.source, {self.step_function: self.step_function}, frozenset())


def phase_library() -> PhaseLibrary:
    """cachetier's library with its step's phase markers made clock readings."""
    loaded = library()
    named = re.match(r"#!lua name=cachetier_([0-9a-f]{40})\n", loaded.source)
    if named is None:
        raise RuntimeError("cachetier's library no longer starts with its name and digest")
    digest = named[1]
    body = loaded.source.split("\n", 1)[1]
    start, end = _step_body(body, f'"{loaded.functions[STEP_SCRIPT]}"')
    step = _START.sub(lambda m: f'{m[1]}phase_mark("start") for _ = 1, {PROBE_READINGS} do '
                      f'phase_mark("{PROBE}") end', body[start:end])
    step = _END.sub(lambda m: f'{m[1]}phase_mark("{m[2]}")', step)
    if step.count("phase_mark(") < 3:
        raise RuntimeError(f"{STEP_SCRIPT}.lua has lost its phase markers")
    trace = (f'redis.register_function("ct_{digest}_{TRACE_SUFFIX}", function(keys, args) '
             f"local trace = PHASE_TRACE; PHASE_TRACE = {{}}; return trace end)")
    body = "\n".join([_TRACE, body[:start] + step + body[end:], trace])
    fresh = hashlib.sha1(body.encode()).hexdigest()
    body = body.replace(digest, fresh)
    name = f"cachetier_phases_{fresh}"
    return PhaseLibrary(f"#!lua name={name}\n{body}", name, f"ct_{fresh}_{STEP_SCRIPT}",
                        f"ct_{fresh}_{TRACE_SUFFIX}")


def _step_body(body: str, function_name: str) -> tuple[int, int]:
    """Where the step function's registration starts and the next one begins."""
    start = body.index(function_name)
    end = body.find("redis.register_function", start)
    return start, len(body) if end < 0 else end


def phase_times(trace: Sequence[Any]) -> dict[str, int]:
    """One call's trace (name, microseconds, ...) as microseconds per phase name, summed."""
    names = [n.decode() if isinstance(n, bytes) else n for n in trace[0::2]]
    clocks = [int(t) for t in trace[1::2]]
    if not names or names[0] != "start":
        raise RuntimeError(f"the phase trace does not start at the step's origin: {names[:3]}")
    out: dict[str, int] = {}
    for name, before, after in zip(names[1:], clocks, clocks[1:]):
        out[name] = out.get(name, 0) + after - before
    return out


@dataclass
class PhaseSamples:
    """Per timed call: microseconds per phase, and the server's own time in the whole call
    (command stats: the probed span plus what lies outside it, such as the arguments made Lua
    tables); `counts`: how many markers of each phase a call passes."""

    calls: list[dict[str, int]] = field(default_factory=list)
    call_us: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    arguments_ns: list[int] = field(default_factory=list)
    decode_ns: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TracedStep:
    """One step through the instrumented copy: its phase times, how often each marker was
    passed, the server's time in the call, and the client's on either side of it."""

    times: dict[str, int]
    counts: dict[str, int]
    call_us: int
    arguments_ns: int
    decode_ns: int


async def instrumented_step(client: Redis, lib: PhaseLibrary, index: PrefixIndex,
                            requests: list[StepRequest], hit: int) -> TracedStep:
    """One step through the instrumented copy, undone as the timed steps are (confirm, release)."""
    start = time.perf_counter_ns()
    keys, args, staged = index.step_arguments(requests)
    arguments_ns = time.perf_counter_ns() - start
    before = await script_stats(client)
    raw = await call_function(client, lib.loaded, lib.step_function, keys, args, staged=staged)
    _, call_us = stats_delta(before, await script_stats(client), [STEP_COMMAND])
    trace = await client.execute_command("FCALL", lib.trace_function, 0)
    start = time.perf_counter_ns()
    _, plan = decode_step(raw, index.config.model.mla_groups)
    decode_ns = time.perf_counter_ns() - start
    if not isinstance(plan, StepPlan):
        raise RuntimeError(f"phases: the pool refused the step: {plan.reason}")
    misses = [r.hit_tokens for r in plan.requests if r.hit_tokens != hit]
    if misses:
        raise RuntimeError(f"phases: expected every request to hit at {hit} tokens, got {misses[:4]}")
    await index.confirm(plan.ticket)
    await index.release([r.rid for r in requests])
    names = [n.decode() for n in trace[0::2]]
    return TracedStep(phase_times(trace), {n: names.count(n) for n in set(names)}, call_us,
                      arguments_ns, decode_ns)


async def measure_phases(client: Redis, lib: PhaseLibrary, index: PrefixIndex,
                         requests: list[StepRequest], hit: int, steps: int,
                         warmup: int) -> PhaseSamples:
    samples = PhaseSamples()
    for rep in range(warmup + steps):
        step = await instrumented_step(client, lib, index, requests, hit)
        if rep >= warmup:
            samples.calls.append(step.times)
            samples.call_us.append(step.call_us)
            samples.counts = step.counts
            samples.arguments_ns.append(step.arguments_ns)
            samples.decode_ns.append(step.decode_ns)
    return samples


def summarize_phases(samples: PhaseSamples, batch: int) -> dict[str, Any]:
    """Per request, the median microseconds of each phase less the clock readings it holds (the
    origin's probes give the cost of one), their sum, and the same calls' server time less every
    reading: what it leaves over the sum was spent outside the markers (before the origin and
    after the reply: the arguments made Lua tables, the call's set-up, the reply handed back);
    and the client's median time per request building the arguments and decoding the reply."""
    probe = statistics.median(c.get(PROBE, 0) for c in samples.calls) / PROBE_READINGS
    names = [n for n in samples.calls[0] if n != PROBE]
    phases = {}
    for name in names:
        spent = statistics.median(c.get(name, 0) for c in samples.calls)
        phases[name] = round(max(0.0, spent - probe * samples.counts.get(name, 1)) / batch, 2)
    readings = sum(samples.counts.values())
    call = max(0.0, statistics.median(samples.call_us) - probe * readings)
    return {"phases_us_per_request": phases, "phase_probe_us": round(probe, 2),
            "phases_sum_us_per_request": round(sum(phases.values()), 2),
            "phases_call_us_per_request": round(call / batch, 2),
            "client_us_per_request": {
                "arguments": round(statistics.median(samples.arguments_ns) / 1e3 / batch, 2),
                "decode": round(statistics.median(samples.decode_ns) / 1e3 / batch, 2)}}
