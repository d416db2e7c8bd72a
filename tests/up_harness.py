"""`cachetier up` as a child process of a test: its command line, the pids it records, and
waiting for a line of its console."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
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


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen[bytes],
                  timeout_s: float) -> None:
    """Until the file `path` has a line matching `pattern` (AssertionError on timeout or exit)."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, path.read_text(), re.MULTILINE):
        assert proc.poll() is None, f"`up` ended (code {proc.returncode}): {path.read_text()}"
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s"
        time.sleep(0.05)
