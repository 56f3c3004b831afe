"""The capture writer: records calls in the database without blocking serving and without losing any.

Serving code calls ``CallWriter.submit(record)``: synchronous, O(1), no I/O. A background task drains the
queue in batches (``batch_size`` rows, or what arrived within ``flush_interval``) and writes each batch in one
transaction on a worker thread: rollouts first (an idempotent upsert), then calls in submission order (so a
parent is committed before its children) with each parent's ``next_call_id`` link to its first continuation (the
turn's next state), then rewards.

What can go wrong, and what happens:

- The database is unreachable, locked or not migrated yet (transient): the batch is retried forever with
  exponential backoff (capped at ``max_backoff``); the writer is ``degraded`` until a commit succeeds (one log
  line when that starts, a reminder a minute, one when it ends). Meanwhile the queue fills; at
  ``max_queue`` uncommitted rows ``submit`` raises ``CaptureFull`` so the gateway sheds calls it could
  not record instead of serving them unrecorded.
- A row is bad (constraint violation, bad data, unpackable tokens): the batch is retried row by row under
  savepoints; a row that still fails goes to ``<spool_dir>/dead-letter.jsonl`` with its error, is logged and
  counted, and the rest of the batch is committed.
- Shutdown with the database down: ``close(timeout)`` writes what it cannot commit to
  ``<spool_dir>/pending-<timestamp>.jsonl``; the next ``start()`` replays those files before anything else and
  deletes each only once its rows are committed.

Concurrent calls share a commit (group commit: what was queued while one commit ran goes in the next). The
writer holds one connection of its own (no pool checkout, no pre-ping per commit), and a batch is prepared and
committed in one hop to its thread. On Postgres that connection runs with ``synchronous_commit`` as configured
(``off`` by default, see Settings.capture_synchronous_commit): a durable call then waits for its commit to reach
Postgres, not the disk.

Calls and rollouts are idempotent (insert-or-ignore by id, upsert), so a replay of rows whose commit was in
doubt writes them once. Rewards have no natural key and could be written twice in that (rare) case. One spool
directory belongs to one writer process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.faults import Fault
from gateway.store import spool
from gateway.store.errors import (
    CAPTURE_CLOSED_RETRY_AFTER_S,
    CAPTURE_RETRY_AFTER_S,
    CaptureFull,
    describe_error,
    is_transient,
)
from gateway.store.records import Record, RolloutRecord
from gateway.store.rows import Prepared, Statements, next_state_link, prepare
from gateway.store.spool import DEAD_LETTER_FILE

log = logging.getLogger("clawgate.capture")


@dataclass
class WriterStats:
    queued: int = 0  # submitted (or replayed) and not yet committed or dead-lettered
    written: int = 0
    retries: int = 0
    dead_lettered: int = 0
    spooled: int = 0
    replayed: int = 0
    last_error: str | None = None


@dataclass
class _Outcome:
    written: int
    dead: list[tuple[Record, str]]


class CallWriter:
    """Batching, retrying, spooling writer of capture records (see the module docstring).

    Use from one event loop: ``await start()``, ``submit(...)`` from request handlers, ``await flush()`` to
    wait for everything submitted so far to be committed (or dead-lettered), ``await close(timeout)`` at
    shutdown.
    """

    def __init__(
        self,
        engine: sa.Engine,
        spool_dir: str | Path,
        *,
        max_queue: int = 100_000,
        batch_size: int = 256,
        flush_interval: float = 0.02,
        initial_backoff: float = 0.05,
        max_backoff: float = 5.0,
        synchronous_commit: str = "on",
    ) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be positive")
        if synchronous_commit not in ("on", "off"):
            raise ValueError("synchronous_commit must be 'on' or 'off'")
        self._engine = engine
        self._statements = Statements(engine.dialect.name)
        # Postgres only: set once on the writer's own connection (see _connect), so no other work on the pool
        # runs with it.
        self._session_setup = (
            f"SET synchronous_commit = {synchronous_commit}" if engine.dialect.name == "postgresql" else None
        )
        # The writer's own connection, used only on its thread (see _connect).
        self._connection: sa.Connection | None = None
        self._spool_dir = Path(spool_dir)
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._flush_interval = flush_interval
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff

        self._queue: deque[Record] = deque()
        self._inflight: list[Record] = []
        self._submitted = 0  # records ever queued (submitted or replayed)
        self._done = 0  # records committed or dead-lettered, in queue order
        self._reserved = 0  # room held for calls being served (see reserve)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        # Durable calls waiting for their commit: answered True once committed, False as soon as the writer is
        # degraded (see wait_committed).
        self._durable_waiters: list[tuple[int, asyncio.Future[bool]]] = []
        self._replay_files: list[tuple[Path, int]] = []  # a spool file and the _done count that covers it
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        # One dedicated thread: batches stay ordered, and capture never waits behind other to_thread work.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawgate-capture")
        self.stats = WriterStats()
        # The circuit breaker: active from a failed commit (or one slower than a durable call waits) until a commit
        # succeeds. Meanwhile durable calls do not wait for their commit (they stay queued and are spooled on
        # shutdown), and /health says the capture is degraded.
        self.fault = Fault(log, "capture: cannot write to the database")

    @property
    def degraded(self) -> bool:
        return self.fault.active

    @property
    def dead_letter_path(self) -> Path:
        return self._spool_dir / DEAD_LETTER_FILE

    # -- serving side ---------------------------------------------------------------------------------------

    def reserve(self, slots: int) -> None:
        """Admission control: hold room for ``slots`` records that a call will submit once it has been served.

        Called before the engine generates anything, so a call the gateway could not record is refused up front
        (503) rather than served and then lost. Each reserved slot is used by ``submit(..., reserved=True)`` or
        given back with ``release``.
        """
        if self._closing:
            raise CaptureFull(
                "capture writer is shut down", code="capture_closed", retry_after=CAPTURE_CLOSED_RETRY_AFTER_S
            )
        if self.stats.queued + self._reserved + slots > self._max_queue:
            raise CaptureFull(
                f"capture queue full ({self._max_queue} records waiting for the database): try again shortly",
                code="capture_queue_full",
                retry_after=CAPTURE_RETRY_AFTER_S,
            )
        self._reserved += slots

    def release(self, slots: int) -> None:
        """Give back reserved slots that were not used."""
        self._reserved = max(self._reserved - slots, 0)

    def submit(self, record: Record, *, reserved: bool = False) -> None:
        """Queue a record for writing. Never blocks. Raises CaptureFull when the queue is full, unless the
        record uses a slot held by ``reserve`` (then it is always queued, even at shutdown: it was served)."""
        if reserved:
            self._reserved = max(self._reserved - 1, 0)
            if self._closed:
                # Served after the writer closed (it waits for no one): spooled on its own, replayed at next start.
                self._spool([record])
                self.stats.spooled += 1
                return
        elif self._closing:
            raise CaptureFull(
                "capture writer is shut down", code="capture_closed", retry_after=CAPTURE_CLOSED_RETRY_AFTER_S
            )
        elif self.stats.queued + self._reserved >= self._max_queue:
            raise CaptureFull("capture queue full", code="capture_queue_full", retry_after=CAPTURE_RETRY_AFTER_S)
        self._queue.append(record)
        self._submitted += 1
        self.stats.queued += 1
        if len(self._queue) == 1 or len(self._queue) >= self._batch_size:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every record submitted so far is committed or dead-lettered (at shutdown: or spooled)."""
        target = self._submitted
        if self._done >= target:
            return
        if self._task is None or self._task.done():
            raise RuntimeError("the capture writer is not running")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        self._wake.set()
        await future

    async def wait_committed(self, timeout: float) -> bool:
        """Wait until everything submitted so far is committed: True; False as soon as the capture is degraded
        (a commit failed), or after ``timeout`` seconds (then the writer counts as degraded too)."""
        target = self._submitted
        if self._done >= target:
            return True
        if self.degraded:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._durable_waiters.append((target, future))
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            self.fault.failed(f"a commit took longer than {timeout:g}s: calls are served before they are committed")
            self._answer_durable_waiters(False)
            return False

    def _answer_durable_waiters(self, degraded: bool) -> None:
        still: list[tuple[int, asyncio.Future[bool]]] = []
        for target, future in self._durable_waiters:
            if future.done():
                continue
            if self._done >= target:
                future.set_result(True)
            elif degraded:
                future.set_result(False)
            else:
                still.append((target, future))
        self._durable_waiters = still

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Queue the rows of pending spool files ahead of everything else, then start writing."""
        if self._task is not None:
            raise RuntimeError("the capture writer was started already")
        loaded, unreadable = await asyncio.to_thread(spool.load_pending, self._spool_dir)
        self.stats.dead_lettered += unreadable
        replay: list[Record] = []
        for path, records in loaded:
            replay.extend(records)
            self._replay_files.append((path, self._done + len(replay)))
        self._queue.extendleft(reversed(replay))
        self._submitted += len(replay)
        self.stats.queued += len(replay)
        self.stats.replayed += len(replay)
        if replay:
            log.info("replaying %d capture records from %d spool files", len(replay), len(loaded))
        self._task = asyncio.create_task(self._run(), name="clawgate-capture-writer")
        self._task.add_done_callback(self._on_task_done)

    async def close(self, timeout: float = 10.0) -> None:
        """Write what can be written within ``timeout`` seconds; spool the rest to a pending file."""
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            except Exception:
                pass  # logged by _on_task_done; its rows are still queued and get spooled below
        self._closed = True
        leftovers = [*self._inflight, *self._queue]
        self._inflight, self._queue = [], deque()
        durable = True
        if leftovers:
            # The in-flight batch may still commit on its thread after this; replay is idempotent for calls.
            path = await asyncio.to_thread(self._spool, leftovers)
            if path is not None:
                self.stats.spooled += len(leftovers)
                self._delete_replay_files(all_files=True)
            else:
                durable = False
        else:
            self._delete_replay_files(all_files=True)
        self.stats.queued = 0
        for _, future in self._waiters:
            if future.done():
                continue
            if durable:
                # Spooled to disk (fsync'd) and replayed at the next start: as safe as committed, so a durable call
                # still waiting is answered, not failed.
                future.set_result(None)
            else:
                future.set_exception(RuntimeError("capture writer closed before these rows were committed"))
        self._waiters.clear()
        for _, waiting in self._durable_waiters:
            if not waiting.done():
                waiting.set_result(durable)
        self._durable_waiters.clear()
        # On the writer thread, after a commit still running there (if any): the connection is that thread's.
        self._executor.submit(self._disconnect)
        self._executor.shutdown(wait=False)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("capture writer stopped", exc_info=task.exception())
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(RuntimeError("capture writer stopped"))

    # -- the drain loop --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            someone_waits = bool(self._waiters or self._durable_waiters)
            if len(self._queue) < self._batch_size and not self._closing and not someone_waits:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._flush_interval)
            count = min(len(self._queue), self._batch_size)
            batch = [self._queue.popleft() for _ in range(count)]
            self._inflight = batch
            outcome = await self._write(batch)
            self._inflight = []
            self._done += count
            self.stats.queued -= count
            self.stats.written += outcome.written
            self.stats.dead_lettered += len(outcome.dead)
            self._release_waiters()
            self._delete_replay_files()

    async def _write(self, batch: list[Record]) -> _Outcome:
        loop = asyncio.get_running_loop()
        prepared: list[Prepared] = []  # filled on the first try, reused by the retries
        delay = self._initial_backoff
        while True:
            try:
                # One hop to the writer thread per try: the rows are prepared there on the first.
                outcome = await loop.run_in_executor(self._executor, self._prepare_and_commit, batch, prepared)
            except Exception as error:
                if not is_transient(error):
                    # _commit settles row errors itself, so this is unexpected; keep the rows and keep going.
                    log.exception("capture write of %d rows failed unexpectedly; dead-lettering them", len(batch))
                    dead = [(record, describe_error(error)) for record in batch]
                    await loop.run_in_executor(self._executor, self._dead_letter, dead)
                    return _Outcome(written=0, dead=dead)
                self.stats.retries += 1
                self.stats.last_error = describe_error(error)
                self.fault.failed(f"{self.stats.last_error}; {self.stats.queued} rows waiting", exc_info=error)
                self._answer_durable_waiters(True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
                continue
            self.fault.cleared()
            return outcome

    def _release_waiters(self) -> None:
        self._answer_durable_waiters(False)
        still: list[tuple[int, asyncio.Future[None]]] = []
        for target, future in self._waiters:
            if future.done():
                continue
            if self._done >= target:
                future.set_result(None)
            else:
                still.append((target, future))
        self._waiters = still

    # -- on the worker thread --------------------------------------------------------------------------------

    def _prepare_and_commit(self, batch: list[Record], prepared: list[Prepared]) -> _Outcome:
        if not prepared:
            prepared.append(prepare(batch))
        return self._commit(prepared[0], len(batch))

    def _connect(self) -> sa.Connection:
        """The writer's own connection, opened on first use and after a failure.

        Held across batches and taken out of the pool (``detach``: closing it closes it): a commit then pays for no
        pool checkout and no pre-ping round trip, and the session setting applies to this connection only (behind
        a pooler in transaction mode, set ``synchronous_commit`` on the database role instead). A connection that
        failed is dropped (``_disconnect``) and the retry opens a new one.
        """
        connection = self._connection
        if connection is not None and not connection.closed and not connection.invalidated:
            return connection
        self._disconnect()
        connection = self._engine.connect()
        try:
            connection.detach()
            if self._session_setup is not None:
                connection.exec_driver_sql(self._session_setup)
                connection.commit()
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    def _commit_batch(self, prepared: Prepared) -> None:
        reused = self._connection is not None
        try:
            self._write_once(prepared)
        except sa.exc.DBAPIError as error:
            if not (reused and error.connection_invalidated):
                raise
            # The held connection was closed while it was idle (a database restart, an idle timeout): once more on a
            # fresh one before this counts as a fault.
            self._disconnect()
            self._write_once(prepared)

    def _write_once(self, prepared: Prepared) -> None:
        connection = self._connect()
        with connection.begin():
            self._execute(connection, prepared)

    def _commit(self, prepared: Prepared, total: int) -> _Outcome:
        dead = list(prepared.dead)
        try:
            self._commit_batch(prepared)
        except Exception as error:
            if is_transient(error):
                self._disconnect()
                raise
            log.warning("capture batch failed (%s); retrying it row by row", describe_error(error))
            try:
                dead.extend(self._commit_row_by_row(prepared))
            except Exception as row_error:
                if is_transient(row_error):
                    self._disconnect()
                    raise
                # Not one row's fault (say, a failure at COMMIT): the whole batch is rejected, on record.
                reason = describe_error(row_error)
                dead.extend((record, reason) for _, record in [*prepared.calls, *prepared.rewards])
                dead.extend(
                    (source, reason)
                    for _, sources in prepared.rollouts.values()
                    for source in sources
                    if isinstance(source, RolloutRecord)
                )
        self._dead_letter(dead)
        return _Outcome(written=total - len(dead), dead=dead)

    def _execute(self, connection: sa.Connection, prepared: Prepared) -> None:
        statements = self._statements
        if prepared.rollouts:
            connection.execute(statements.rollouts, [row for row, _ in prepared.rollouts.values()])
        if prepared.calls:
            connection.execute(statements.calls, [row for row, _ in prepared.calls])
            links = [next_state_link(row) for row, _ in prepared.calls if row["parent_call_id"] is not None]
            if links:
                connection.execute(statements.next_state, links)
        if prepared.responses:
            connection.execute(statements.responses, [row for row, _ in prepared.responses])
        if prepared.rewards:
            connection.execute(statements.rewards, [row for row, _ in prepared.rewards])

    def _commit_row_by_row(self, prepared: Prepared) -> list[tuple[Record, str]]:
        statements = self._statements
        # A rollout row merges several records; only the RolloutRecords among them are dead-lettered with it.
        # A call that merely carried the rollout fails on its own foreign key and is dead-lettered with it.
        rows: list[tuple[list[tuple[Any, dict[str, Any]]], list[Record]]] = []
        for row, sources in prepared.rollouts.values():
            standalone: list[Record] = [s for s in sources if isinstance(s, RolloutRecord)]
            rows.append(([(statements.rollouts, row)], standalone))
        for row, record in prepared.calls:
            steps = [(statements.calls, row)]
            if row["parent_call_id"] is not None:
                steps.append((statements.next_state, next_state_link(row)))
            steps += [(statements.responses, r) for r, source in prepared.responses if source is record]
            rows.append((steps, [record]))
        rows.extend(([(statements.rewards, row)], [record]) for row, record in prepared.rewards)
        dead: list[tuple[Record, str]] = []
        connection = self._connect()
        with connection.begin():
            for steps, sources in rows:
                row = steps[0][1]
                try:
                    with connection.begin_nested():
                        for statement, values in steps:
                            connection.execute(statement, [values])
                except Exception as error:
                    if is_transient(error):
                        raise
                    reason = describe_error(error)
                    dead.extend((source, reason) for source in sources)
                    if not sources:
                        log.error("capture rollout row %s failed: %s", row.get("id"), reason)
        return dead

    def _dead_letter(self, dead: list[tuple[Record, str]]) -> None:
        spool.dead_letter(self._spool_dir, dead)

    def _spool(self, records: list[Record]) -> Path | None:
        return spool.spool(self._spool_dir, records)

    def _delete_replay_files(self, *, all_files: bool = False) -> None:
        keep: list[tuple[Path, int]] = []
        for path, covered_at in self._replay_files:
            if all_files or self._done >= covered_at:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            else:
                keep.append((path, covered_at))
        self._replay_files = keep
