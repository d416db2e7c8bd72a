"""A progress bar for long commands (demo, replay), on stderr so stdout stays machine-readable.

On a terminal it redraws one line in place; into a file or a pipe (CI logs) it writes a plain line
at most every `log_every_s`, so a log shows progress without thousands of carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, label: str, *, stream: TextIO | None = None,
                 width: int = 30, log_every_s: float = 5.0, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.log_every_s = log_every_s
        self.enabled = enabled
        self.done = 0
        self._tty = self.stream.isatty()
        self._started = time.monotonic()
        self._last_draw = 0.0

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        due = now - self._last_draw >= (0.1 if self._tty else self.log_every_s)
        if self.enabled and (due or self.done == self.total):
            self._last_draw = now
            self._draw(note, final=self.done == self.total)

    def _draw(self, note: str, final: bool) -> None:
        fraction = self.done / self.total
        filled = int(fraction * self.width)
        elapsed = time.monotonic() - self._started
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} {fraction:4.0%} {elapsed:5.1f}s {note}").rstrip()
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
