"""`cachetier up` as a child process of a test: its command line, the pids it records, and
waiting for a line of its console."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

UP = [sys.executable, "-m", "cachetier.cli", "up", "--port", "0"]


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is dead: only its exit status is left)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def children(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "pids.json").read_text())


@contextlib.contextmanager
def ready_up(run_dir: Path, console: Path, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """`up FLAGS --run-dir RUN_DIR` until ready, its output in `console`; killed at the end if
    the block did not stop it."""
    with open(console, "wb") as out:
        proc = subprocess.Popen([*UP, *flags, "--run-dir", str(run_dir)], stdout=out,
                                stderr=out)
    try:
        wait_for_line(console, r"ready; Ctrl-C to stop$", proc, 90)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen[bytes],
                  timeout_s: float) -> None:
    """Until the file `path` has a line matching `pattern` (AssertionError on timeout or exit)."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, path.read_text(), re.MULTILINE):
        assert proc.poll() is None, f"`up` ended (code {proc.returncode}): {path.read_text()}"
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s"
        time.sleep(0.05)
