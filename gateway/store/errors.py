"""How the store fails: ``CaptureFull`` when the writer takes no more records, ``RecordNotFound`` and
``InvalidInput`` when a request names a record that does not exist or asks for something the store refuses, and
which database errors pass.

``is_transient`` separates "the database is not usable right now" (retry the same write later) from "this row
is bad" (retry row by row, dead-letter what still fails). The store knows nothing about HTTP: the service maps
``CaptureFull`` to its 503 answer, and the app maps a transient database error to one, ``RecordNotFound`` to a
404 and ``InvalidInput`` to a 400 (same message, same ``param``).
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

# What a refusal for a full capture queue tells clients to wait (Retry-After, seconds).
CAPTURE_RETRY_AFTER_S = 2
# What a refusal from a writer that is shutting down tells clients to wait (Retry-After, seconds).
CAPTURE_CLOSED_RETRY_AFTER_S = 5


class CaptureFull(Exception):
    """The capture writer cannot take a record now: its queue is full, or it is shutting down.

    ``code`` names which (``capture_queue_full`` or ``capture_closed``); ``retry_after`` is how many seconds a
    caller should wait before trying again.
    """

    def __init__(self, message: str, *, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after = retry_after


class RecordNotFound(LookupError):
    """A record named by the caller (a rollout, a call) does not exist; ``param`` names the argument that named it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidInput(ValueError):
    """An argument the store refuses (an unknown status, a rollout already finished otherwise, a bad cursor);
    ``param`` names the argument."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# SQLSTATE classes (Postgres) that say "the database is not usable right now", not "this row is bad":
# connection (08), transaction rollback (40), missing schema or privileges (42, 3D, 3F, 28: a migration or
# grant pending), resources (53), object state / lock not available (55), operator intervention (57),
# system (58).
_TRANSIENT_SQLSTATE_CLASSES = {"08", "28", "3D", "3F", "40", "42", "53", "55", "57", "58"}


def is_transient(error: BaseException) -> bool:
    """Whether a failed write should be retried as it is (True) or retried row by row (False)."""
    if isinstance(error, (sa_exc.IntegrityError, sa_exc.DataError)):
        return False
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated or isinstance(error, sa_exc.OperationalError):
            return True  # SQLite: locked, read-only, missing table; Postgres: cannot connect
        sqlstate = getattr(error.orig, "sqlstate", None)
        return isinstance(sqlstate, str) and sqlstate[:2] in _TRANSIENT_SQLSTATE_CLASSES
    return isinstance(error, (sa_exc.TimeoutError, sa_exc.DisconnectionError, ConnectionError, TimeoutError))


def describe_error(error: BaseException) -> str:
    """One line for logs and spool files: the error's class and the first line of its message."""
    text = str(error.orig) if isinstance(error, sa_exc.DBAPIError) else str(error)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}"
