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

This module is the queue, its waiters and the writer's lifecycle; ``batch_commit.py`` commits a batch on the
writer's thread (the connection, the row-by-row retry, the dead letters).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from gateway.faults import Fault
from gateway.store import spool
from gateway.store.batch_commit import BatchCommitter, Outcome
from gateway.store.errors import (
    CAPTURE_CLOSED_RETRY_AFTER_S,
    CAPTURE_RETRY_AFTER_S,
    CaptureFull,
    describe_error,
    is_transient,
)
from gateway.store.records import Record
from gateway.store.rows import Prepared, Scanner
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
        scanner: Scanner | None = None,
    ) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be positive")
        if synchronous_commit not in ("on", "off"):
            raise ValueError("synchronous_commit must be 'on' or 'off'")
        self._spool_dir = Path(spool_dir)
        # The database side, used only on the writer's thread (``self._executor``).
        self._committer = BatchCommitter(engine, self._spool_dir, synchronous_commit, scanner)
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

    async def clean_spool(
        self, *, cutoff: dt.datetime | None = None, ids: frozenset[str] = frozenset()
    ) -> tuple[int, int]:
        """Remove old or forgotten lines from this writer's own spool directory (``spool.clean_dir``), on the writer's
        thread, so no dead-letter append runs meanwhile. Lines and files removed."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: spool.clean_dir(self._spool_dir, cutoff=cutoff, ids=ids)
        )

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
        self._executor.submit(self._committer.disconnect)
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

    async def _write(self, batch: list[Record]) -> Outcome:
        loop = asyncio.get_running_loop()
        prepared: list[Prepared] = []  # filled on the first try, reused by the retries
        delay = self._initial_backoff
        while True:
            try:
                # One hop to the writer thread per try: the rows are prepared there on the first.
                outcome = await loop.run_in_executor(
                    self._executor, self._committer.prepare_and_commit, batch, prepared
                )
            except Exception as error:
                if not is_transient(error):
                    # the committer settles row errors itself, so this is unexpected; keep the rows and keep going.
                    log.exception("capture write of %d rows failed unexpectedly; dead-lettering them", len(batch))
                    dead = [(record, describe_error(error)) for record in batch]
                    await loop.run_in_executor(self._executor, self._committer.dead_letter, dead)
                    return Outcome(written=0, dead=dead)
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
