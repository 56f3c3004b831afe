"""One log line when a background fault starts, a reminder at most every minute, one line when it clears.

Background loops (the capture writer, the policy follower, the session closer, the trainer's waits, the reward
worker) retry every few seconds while something they need is down; logging each attempt would bury the one line
that matters under thousands (a 30 s database outage once produced 3,700 lines of tracebacks). ``Fault`` keeps
the state of one such condition, logs its changes, and reports it for ``/health``: whether it is active, the last
error and when it happened, and when it last recovered. Tracebacks go to the debug level only.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any


def describe(error: BaseException) -> str:
    """``Type: first line of the message`` (database drivers put pages of context after the first line)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class Fault:
    def __init__(
        self, log: logging.Logger, what: str, *, remind_every: float = 60.0, traceback_once: bool = False
    ) -> None:
        self.log = log
        self.what = what
        self.remind_every = remind_every
        # Log the traceback of a fault's first failure (a failure that may be a bug rather than an outage).
        self.traceback_once = traceback_once
        self.since: dt.datetime | None = None  # when the current fault started (None: no fault)
        self.last_error: str | None = None
        self.last_error_at: dt.datetime | None = None
        self.recovered_at: dt.datetime | None = None
        self.occurrences = 0  # failures in the current fault
        self._started = 0.0
        self._reminded = 0.0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, error: str, exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        self.last_error = error
        self.last_error_at = dt.datetime.now(dt.UTC)
        if self.since is None:
            self.since = self.last_error_at
            self._started = self._reminded = now
            self.occurrences = 1
            first_trace = exc_info if self.traceback_once else None
            self.log.warning("%s: %s", self.what, error, exc_info=first_trace)
            if exc_info is not None and first_trace is None:
                self.log.debug("%s: %s", self.what, error, exc_info=exc_info)
            return
        if exc_info is not None:
            self.log.debug("%s: %s", self.what, error, exc_info=exc_info)
        self.occurrences += 1
        if now - self._reminded >= self.remind_every:
            self._reminded = now
            self.log.warning(
                "%s, for %.0fs now (%d failures): %s", self.what, now - self._started, self.occurrences, error
            )

    def cleared(self) -> None:
        if self.since is None:
            return
        self.log.warning(
            "%s: recovered after %.0fs (%d failures)", self.what, time.monotonic() - self._started, self.occurrences
        )
        self.since = None
        self.recovered_at = dt.datetime.now(dt.UTC)

    def snapshot(self) -> dict[str, Any]:
        """For /health: the state now, and the last error and recovery with their times."""
        return {
            "state": "degraded" if self.active else "ok",
            "since": _iso(self.since),
            "last_error": self.last_error,
            "last_error_at": _iso(self.last_error_at),
            "recovered_at": _iso(self.recovered_at),
        }
