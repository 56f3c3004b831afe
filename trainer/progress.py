"""Progress of a train step on the terminal: a bar redrawn in place on a TTY, a line every few seconds in logs.

A step on a real model runs for minutes over many packed batches; without this the daemon would be silent until
the step's metrics line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class StepProgress:
    def __init__(self, stream: TextIO | None = None, *, width: int = 30, log_every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.log_every = log_every
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = self._last = time.monotonic()
        self._drawn = False  # a line of this phase was logged

    def __call__(self, phase: str, done: int, total: int) -> None:
        if total <= 0:
            return
        now = time.monotonic()
        if done == 1:
            self._t0 = self._last = now
            self._drawn = False
        elapsed = now - self._t0
        if self.tty:
            filled = int(self.width * done / total)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r  {phase:6s} [{bar}] {done}/{total} batches  {elapsed:5.1f}s")
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
        elif now - self._last >= self.log_every or (done == total and self._drawn):
            # In a log: quiet for quick steps, a line every `log_every` seconds (and the last one) for long ones.
            self.stream.write(f"  {phase}: {done}/{total} batches, {elapsed:.0f}s\n")
            self.stream.flush()
            self._last = now
            self._drawn = True
