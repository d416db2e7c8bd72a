"""`cachetier up` stopped every way its caller can stop it: SIGINT, SIGTERM or SIGHUP, its parent
killed outright, `up` itself killed outright. Each time every process it started (its whole tree,
read from /proc) is gone within a bound, the info file of `up --vllm-model` with them, and the logs
stay in the run directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.up_harness import children, running

pytestmark = pytest.mark.slow  # `up` as processes, signalled

UP = [sys.executable, "-m", "cachetier.cli", "up", "--port", "0", "--agents", "1"]
READY_S = 120  # `up --vllm-model` imports vLLM: ~35 s on an idle 2-core host
STOP_S = 30  # `up` stops each child with SIGTERM, then SIGKILL after 5 s
LOGS = ("service.log", "agent-0.log", "redis.log", "mosquitto.log")
STOPPED = "cachetier up: interrupted\ncachetier up: stopped\n"


def tree(root: int) -> set[int]:
    """`root` and every process descending from it, whatever session each runs in."""
    by_parent: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        by_parent.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += by_parent.get(pid, [])
    return found


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc (a command name may hold spaces and parentheses: the
    fields are read after its last closing parenthesis)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # gone meanwhile
            continue
    return found


def left_running(pids: set[int], timeout_s: float = STOP_S) -> set[int]:
    """The processes of `pids` still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := {pid for pid in pids if running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@dataclass
class Started:
    """A command run as a caller runs `up`, its output in `console`; `pids`: what runs below it."""

    proc: subprocess.Popen[bytes]
    console: Path
    pids: set[int] = field(default_factory=set)

    def wait_for(self, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + READY_S
        while not condition():
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}): {self.output}"
            assert time.monotonic() < deadline, f"not ready in {READY_S} s: {self.output}"
            time.sleep(0.1)

    def collect(self, run_dir: Path) -> set[int]:
        """Every process below the command, `up`'s children among them (as in pids.json)."""
        self.pids = tree(self.proc.pid) - {self.proc.pid}
        assert set(children(run_dir).values()) <= self.pids
        return self.pids

    @property
    def output(self) -> str:
        return self.console.read_text()


@contextmanager
def started(command: list[str], console: Path) -> Iterator[Started]:
    """`command` with its output in `console`; whatever of it outlives the test is stopped
    (SIGTERM, as an operator would, then SIGKILL), so a failing test leaves no cluster behind."""
    with open(console, "wb") as out:
        run = Started(subprocess.Popen(command, stdout=out, stderr=out), console)
    try:
        yield run
    finally:
        below = tree(run.proc.pid) if run.proc.poll() is None else set()  # else: pid reusable
        leftovers = left_running(run.pids | below, 0)
        for pid in leftovers:
            os.kill(pid, signal.SIGTERM)
        for pid in left_running(leftovers, 10):
            os.kill(pid, signal.SIGKILL)
        run.proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda sig: sig.name)
def test_a_stop_signal_stops_every_process_in_order(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    with started([*UP, "--run-dir", str(run_dir)], tmp_path / "console.txt") as up:
        up.wait_for(lambda: "ready; Ctrl-C to stop" in up.output)
        pids = up.collect(run_dir)
        up.proc.send_signal(sig)
        assert up.proc.wait(STOP_S) == 0, up.output
        assert not left_running(pids, 0)
        assert STOPPED in up.output
    assert all((run_dir / log).is_file() for log in LOGS)


def test_up_killed_outright_takes_every_child_with_it(tmp_path: Path) -> None:
    """Each child's parent-death signal (SIGTERM): nothing outlives even a SIGKILLed `up`."""
    run_dir = tmp_path / "run"
    with started([*UP, "--run-dir", str(run_dir)], tmp_path / "console.txt") as up:
        up.wait_for(lambda: "ready; Ctrl-C to stop" in up.output)
        pids = up.collect(run_dir)
        up.proc.kill()
        assert up.proc.wait(STOP_S) == -signal.SIGKILL
        assert not left_running(pids)


def test_the_death_of_its_parent_stops_up_and_removes_the_info_file(model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A shell runs `up --vllm-model` and is SIGKILLed (a harness's timeout, a closed session):
    `up` stops as on SIGTERM, the info file and every process gone."""
    info, run_dir = tmp_path / "tier.json", tmp_path / "run"
    command = [*UP, "--vllm-model", str(model_dir), "--info", str(info), "--run-dir",
               str(run_dir), "--kv-events-endpoint", f"ipc://{tmp_path / 'events.ipc'}"]
    with started(["bash", "-c", '"$@" & wait', "bash", *command],
                 tmp_path / "console.txt") as shell:
        shell.wait_for(info.exists)
        pids = shell.collect(run_dir)
        assert "vllm-events" in children(run_dir)
        shell.proc.kill()
        shell.proc.wait()
        assert not left_running(pids), shell.output
        assert not info.exists(), "the info file outlived the cluster"
        assert STOPPED in shell.output
    assert all((run_dir / log).is_file() for log in LOGS)


def test_a_second_stop_signal_cannot_cut_the_stop_short() -> None:
    """`timeout` sends SIGTERM twice (to `up`, then to its group): the first unwinds `up`, any
    later one is ignored until `up` is done, so it cannot skip the info file or the stop."""
    from cachetier.run.cluster import _signal_handlers, _stop_handlers
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.getsignal(sig) for sig in stops}
    with _signal_handlers(_stop_handlers()):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        for sig in stops:
            signal.raise_signal(sig)
    assert {sig: signal.getsignal(sig) for sig in before} == before


FOLLOW_PARENT = """
import ctypes, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == "nohup" else signal.SIG_DFL)
from cachetier.run.cluster import _follow_parent, _stop_handlers
_follow_parent()
death_signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(death_signal))  # PR_GET_PDEATHSIG
print(death_signal.value, *(int(sig) for sig in sorted(_stop_handlers())))
"""


@pytest.mark.parametrize("start, expected", [
    ("shell", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGTERM]),
    ("nohup", [0, signal.SIGINT, signal.SIGTERM])])
def test_under_nohup_up_outlives_its_terminal_and_its_parent(start: str,
                                                             expected: list[int]) -> None:
    """nohup asks `up` to outlive the shell that started it: neither SIGHUP nor that shell's
    death stops it then; otherwise both do (SIGTERM at the parent's death)."""
    done = subprocess.run([sys.executable, "-c", FOLLOW_PARENT, start], capture_output=True,
                          text=True, timeout=60, check=True)
    assert [int(word) for word in done.stdout.split()] == expected
