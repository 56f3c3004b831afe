"""One log line when a background fault starts, a reminder at most every minute, one line when it clears.

Background loops (a judge that cannot be reached, a database that is down) retry every few seconds; logging each
attempt would bury the one line that matters under thousands. ``Fault`` keeps the state of one such condition.
"""

from __future__ import annotations

import logging
import time


class Fault:
    def __init__(self, log: logging.Logger, what: str, *, remind_every: float = 60.0) -> None:
        self.log = log
        self.what = what
        self.remind_every = remind_every
        self.since: float | None = None
        self.last_error: str | None = None
        self.occurrences = 0
        self._reminded = 0.0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, error: str) -> None:
        now = time.monotonic()
        self.occurrences += 1
        self.last_error = error
        if self.since is None:
            self.since = self._reminded = now
            self.occurrences = 1
            self.log.warning("%s: %s", self.what, error)
        elif now - self._reminded >= self.remind_every:
            self._reminded = now
            self.log.warning("%s for %.0fs now (%d failures): %s", self.what, now - self.since, self.occurrences, error)

    def cleared(self) -> None:
        if self.since is None:
            return
        self.log.warning(
            "%s: recovered after %.0fs (%d failures)", self.what, time.monotonic() - self.since, self.occurrences
        )
        self.since = None
