"""Agents forked from a warm process, so that starting one costs milliseconds, not a torch import.

`cachetier chaos` restarts an agent after every kill; `python -m cachetier.cli agent` spends
seconds of CPU importing torch each time, more than the rest of a kill round. The zygote
(`cachetier zygote`, a command the help does not list) imports the agent's modules once, then reads
one JSON line per agent (`[argv, log path]`) and forks a child running the CLI's `main(argv)`
(handed to `serve_forks`: this room does not import the CLI), its output in
that log, in a session of its own, with SIGTERM as its parent-death signal (the zygote's own
death takes every agent with it, as `up`'s death takes the zygote). It answers each line with
the child's pid. It runs no thread and imports nothing per agent, so a fork is safe and cheap.
Its children are reaped by the kernel (SIGCHLD ignored): their exit codes are not known.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cachetier.run.servers import parent_death_hook

_POLL_S = 0.005
_STOP_TIMEOUT_S = 5.0
UNKNOWN_CODE = -255  # what `ForkedProcess.poll` reports for an exited child


class ForkedProcess:
    """A child of the zygote, with the part of `subprocess.Popen`'s face that stopping uses
    (`servers.terminate`): it is not our child, so it is watched by signal 0, not waited for."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = UNKNOWN_CODE
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                self.returncode = UNKNOWN_CODE

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(_POLL_S)
        return code


class AgentZygote:
    """`with AgentZygote(log, env) as zygote:` `zygote.fork(argv, log)` starts an agent."""

    def __init__(self, log: Path, env: dict[str, str], startup_timeout_s: float = 60.0) -> None:
        self.log = log
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._ready = False

    def __enter__(self) -> AgentZygote:
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "cachetier.cli", "zygote"], text=True, env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True, preexec_fn=parent_death_hook())  # noqa: PLW1509
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self._running().pid

    def fork(self, argv: list[str], log: Path) -> ForkedProcess:
        """Start `cachetier <argv>` (the first call waits for the zygote's imports)."""
        proc = self._running()
        if not self._ready:
            if self._read_line() != "ready":
                raise RuntimeError(f"the agent zygote did not start; see {self.log}")
            self._ready = True
        assert proc.stdin is not None
        proc.stdin.write(json.dumps([argv, str(log)]) + "\n")
        proc.stdin.flush()
        return ForkedProcess(int(self._read_line()))

    def _running(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"the agent zygote is not running; see {self.log}")
        return self._proc

    def _read_line(self) -> str:
        """One line of the zygote's answer, within the startup timeout (a select on its pipe)."""
        import select
        proc = self._running()
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.startup_timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the agent zygote did not answer; see {self.log}")
        return line.strip()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_forks(main: Callable[[list[str]], int]) -> None:
    """The zygote's loop (see the module docstring); `main` is the CLI's."""
    import torch  # noqa: F401  (the point: imported once, before any fork)

    import cachetier.run.nodes  # noqa: F401
    import gpu_pool.agent  # noqa: F401
    pdeath = parent_death_hook()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the agents
    print("ready", flush=True)
    for line in sys.stdin:
        argv, log = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                if pdeath is not None:
                    pdeath()
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                code = main(argv)
            finally:
                os._exit(code)
        print(pid, flush=True)
