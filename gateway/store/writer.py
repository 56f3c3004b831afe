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
  ``max_queue`` uncommitted rows ``submit`` raises ``EngineUnavailable`` so the gateway sheds calls it could
  not record instead of serving them unrecorded.
- A row is bad (constraint violation, bad data, unpackable tokens): the batch is retried row by row under
  savepoints; a row that still fails goes to ``<spool_dir>/dead-letter.jsonl`` with its error, is logged and
  counted, and the rest of the batch is committed.
- Shutdown with the database down: ``close(timeout)`` writes what it cannot commit to
  ``<spool_dir>/pending-<timestamp>.jsonl``; the next ``start()`` replays those files before anything else and
  deletes each only once its rows are committed.

Calls and rollouts are idempotent (insert-or-ignore by id, upsert), so a replay of rows whose commit was in
doubt writes them once. Rewards have no natural key and could be written twice in that (rare) case. One spool
directory belongs to one writer process.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite

from gateway.errors import EngineUnavailable
from gateway.faults import Fault
from gateway.store import codec
from gateway.store.models import Call, Reward, Rollout, utcnow

log = logging.getLogger("clawgate.capture")

DEAD_LETTER_FILE = "dead-letter.jsonl"
# What a refusal for a full capture queue tells clients to wait (Retry-After, seconds).
CAPTURE_RETRY_AFTER_S = 2
PENDING_GLOB = "pending-*.jsonl"


@dataclass(slots=True)
class RolloutRecord:
    """A rollout to create, or to touch: an existing row gets ``updated_at`` and its still-null fields filled.

    ``status`` other than "open" overrides the stored status (that is how a rollout is finished through the
    writer, in order after its calls); "open" never reopens a finished rollout.
    """

    id: str
    kind: str = "implicit"
    task_id: str | None = None
    harness: str | None = None
    group_key: str | None = None
    status: str = "open"
    metadata: dict[str, Any] | None = None
    api_key_hash: str | None = None
    created_at: dt.datetime = field(default_factory=utcnow)
    updated_at: dt.datetime = field(default_factory=utcnow)
    finished_at: dt.datetime | None = None


@dataclass(slots=True)
class CallRecord:
    """One call as the gateway saw it. Fields mirror ``models.Call``; the writer packs them.

    ``request`` is the body as received, full message list included; the writer stores it without its first
    ``request_prefix_messages`` messages, which must equal the first messages of the parent call's full list.
    ``prompt_delta`` is the prompt after its first ``prompt_prefix_len`` tokens, which must equal the first
    tokens of the parent call's full prompt + completion. ``rollout``, when given, is upserted before the
    call.
    """

    id: str
    request_id: str
    rollout_id: str
    api: str
    model: str
    engine: str
    render_mode: str
    request: dict[str, Any]
    started_at: dt.datetime
    ended_at: dt.datetime
    choice_index: int = 0
    status: str = "ok"
    adapter: str | None = None
    policy_version: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    is_subagent: bool = False
    agent_id: str | None = None
    request_prefix_messages: int = 0
    parent_call_id: str | None = None
    prompt_prefix_len: int = 0
    prompt_delta: Sequence[int] = field(default_factory=list)
    completion_ids: Sequence[int] = field(default_factory=list)
    completion_logprobs: Sequence[float] = field(default_factory=list)
    tail_hash: str | None = None
    ttft_ms: float | None = None
    engine_ms: float | None = None
    gateway_ms: float | None = None
    rollout: RolloutRecord | None = None

    @property
    def prompt_len(self) -> int:
        return self.prompt_prefix_len + len(self.prompt_delta)

    @property
    def completion_len(self) -> int:
        return len(self.completion_ids)


@dataclass(slots=True)
class RewardRecord:
    rollout_id: str
    value: float
    call_id: str | None = None
    source: str | None = None
    details: dict[str, Any] | None = None
    created_at: dt.datetime = field(default_factory=utcnow)


Record: TypeAlias = RolloutRecord | CallRecord | RewardRecord

_RECORD_TYPES: dict[str, type[RolloutRecord] | type[CallRecord] | type[RewardRecord]] = {
    "rollout": RolloutRecord,
    "call": CallRecord,
    "reward": RewardRecord,
}
_TYPE_NAMES = {cls: name for name, cls in _RECORD_TYPES.items()}
_DATETIME_FIELDS = {"created_at", "updated_at", "finished_at", "started_at", "ended_at"}


def _json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, RolloutRecord):
        return record_to_json(value)
    if hasattr(value, "tolist"):  # numpy arrays of ids or logprobs
        return value.tolist()
    return value


def record_to_json(record: Record) -> dict[str, Any]:
    """A JSON-ready dict of a record (datetimes as ISO strings, bytes as base64), tagged with its type."""
    out: dict[str, Any] = {"type": _TYPE_NAMES[type(record)]}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        out[f.name] = _json_value(list(value) if isinstance(value, tuple) else value)
    return out


def record_from_json(data: dict[str, Any]) -> Record:
    data = dict(data)
    cls = _RECORD_TYPES[data.pop("type")]
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in names:
            raise ValueError(f"unknown {cls.__name__} field {name!r}")
        if name in _DATETIME_FIELDS and isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        elif name == "rollout" and isinstance(value, dict):
            value = record_from_json(value)
        elif isinstance(value, dict) and set(value) == {"base64"}:
            value = base64.b64decode(value["base64"])
        kwargs[name] = value
    return cls(**kwargs)


@dataclass
class WriterStats:
    queued: int = 0  # submitted (or replayed) and not yet committed or dead-lettered
    written: int = 0
    retries: int = 0
    dead_lettered: int = 0
    spooled: int = 0
    replayed: int = 0
    last_error: str | None = None


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


def _describe(error: BaseException) -> str:
    text = str(error.orig) if isinstance(error, sa_exc.DBAPIError) else str(error)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}"


@dataclass
class _Prepared:
    """A batch as rows, each with the records it came from (rollout rows merge several records)."""

    rollouts: dict[str, tuple[dict[str, Any], list[Record]]] = field(default_factory=dict)
    calls: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    rewards: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    dead: list[tuple[Record, str]] = field(default_factory=list)


_ROLLOUT_FILL = ("task_id", "harness", "group_key", "metadata", "api_key_hash", "finished_at")


def _rollout_row(record: RolloutRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "kind": record.kind,
        "task_id": record.task_id,
        "harness": record.harness,
        "group_key": record.group_key,
        "status": record.status,
        "metadata": record.metadata,
        "api_key_hash": record.api_key_hash,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "finished_at": record.finished_at,
    }


def _merge_rollout(into: dict[str, Any], row: dict[str, Any]) -> None:
    """Two records of one rollout in a batch become one row (an upsert may touch a row once per statement)."""
    for key in _ROLLOUT_FILL:
        if into[key] is None:
            into[key] = row[key]
    into["created_at"] = min(into["created_at"], row["created_at"])
    into["updated_at"] = max(into["updated_at"], row["updated_at"])
    if row["status"] != "open":
        into["status"] = row["status"]


def _call_row(record: CallRecord) -> dict[str, Any]:
    if len(record.completion_logprobs) != len(record.completion_ids):
        raise ValueError(
            f"{len(record.completion_logprobs)} logprobs for {len(record.completion_ids)} completion tokens"
        )
    if record.prompt_prefix_len < 0 or (record.prompt_prefix_len > 0 and record.parent_call_id is None):
        raise ValueError(f"prompt_prefix_len={record.prompt_prefix_len} needs a parent call")
    if record.request_prefix_messages > 0 and record.parent_call_id is None:
        raise ValueError(f"request_prefix_messages={record.request_prefix_messages} needs a parent call")
    return {
        "id": record.id,
        "request_id": record.request_id,
        "choice_index": record.choice_index,
        "rollout_id": record.rollout_id,
        "api": record.api,
        "model": record.model,
        "adapter": record.adapter,
        "policy_version": record.policy_version,
        "engine": record.engine,
        "status": record.status,
        "error": record.error,
        "finish_reason": record.finish_reason,
        "render_mode": record.render_mode,
        "is_subagent": record.is_subagent,
        "agent_id": record.agent_id,
        "request": codec.pack_request(codec.trim_request(record.request, record.request_prefix_messages)),
        "request_prefix_messages": record.request_prefix_messages,
        "parent_call_id": record.parent_call_id,
        "prompt_prefix_len": record.prompt_prefix_len,
        "prompt_delta": codec.pack_ids(record.prompt_delta),
        "prompt_len": record.prompt_len,
        "completion_ids": codec.pack_ids(record.completion_ids),
        "completion_logprobs": codec.pack_logprobs(record.completion_logprobs),
        "completion_len": record.completion_len,
        "tail_hash": record.tail_hash,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "ttft_ms": record.ttft_ms,
        "engine_ms": record.engine_ms,
        "gateway_ms": record.gateway_ms,
    }


def _next_state_link(call_row: dict[str, Any]) -> dict[str, Any]:
    return {"b_parent": call_row["parent_call_id"], "b_child": call_row["id"]}


def _reward_row(record: RewardRecord) -> dict[str, Any]:
    return {
        "rollout_id": record.rollout_id,
        "call_id": record.call_id,
        "value": float(record.value),
        "source": record.source,
        "details": record.details,
        "created_at": record.created_at,
    }


def _prepare(batch: Iterable[Record]) -> _Prepared:
    prepared = _Prepared()

    def add_rollout(rollout: RolloutRecord, source: Record) -> None:
        row = _rollout_row(rollout)
        existing = prepared.rollouts.get(rollout.id)
        if existing is None:
            prepared.rollouts[rollout.id] = (row, [source])
        else:
            _merge_rollout(existing[0], row)
            existing[1].append(source)

    for record in batch:
        try:
            if isinstance(record, CallRecord):
                row = _call_row(record)
                if record.rollout is not None:
                    add_rollout(record.rollout, record)
                prepared.calls.append((row, record))
            elif isinstance(record, RolloutRecord):
                add_rollout(record, record)
            elif isinstance(record, RewardRecord):
                prepared.rewards.append((_reward_row(record), record))
            else:
                raise TypeError(f"not a capture record: {type(record).__name__}")
        except Exception as error:  # a record that cannot even be turned into a row
            prepared.dead.append((record, _describe(error)))
    return prepared


def _table(model: type[Rollout | Call | Reward]) -> sa.Table:
    table = model.__table__
    assert isinstance(table, sa.Table)
    return table


class _Statements:
    """The batch statements for one dialect, built once."""

    def __init__(self, dialect_name: str) -> None:
        rollouts, calls, rewards = _table(Rollout), _table(Call), _table(Reward)
        insert: Any
        greatest: Any
        if dialect_name == "postgresql":
            insert, greatest = postgresql.insert, sa.func.greatest
        elif dialect_name == "sqlite":
            insert, greatest = sqlite.insert, sa.func.max  # SQLite's two-argument max() is scalar
        else:
            raise ValueError(f"the capture writer supports sqlite and postgresql, not {dialect_name}")
        upsert = insert(rollouts)
        excluded = upsert.excluded
        fill = {key: sa.func.coalesce(rollouts.c[key], excluded[key]) for key in _ROLLOUT_FILL}
        self.rollouts = upsert.on_conflict_do_update(
            index_elements=["id"],
            set_={
                **fill,
                "updated_at": greatest(rollouts.c.updated_at, excluded.updated_at),
                "status": sa.case((excluded.status != "open", excluded.status), else_=rollouts.c.status),
            },
        )
        # Insert-or-ignore makes replaying a batch whose commit was in doubt write each call once.
        self.calls = insert(calls).on_conflict_do_nothing(index_elements=["id"])
        # A call that continues another holds that turn's next state; the first such call is recorded on the
        # parent (idempotent: a replay or a later retry of the same request leaves the link as it is).
        self.next_state = (
            sa.update(calls)
            .where(calls.c.id == sa.bindparam("b_parent"), calls.c.next_call_id.is_(None))
            .values(next_call_id=sa.bindparam("b_child"))
        )
        self.rewards = sa.insert(rewards)


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
    ) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be positive")
        self._engine = engine
        self._statements = _Statements(engine.dialect.name)
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
            raise EngineUnavailable("capture writer is shut down", code="capture_closed", retry_after=5)
        if self.stats.queued + self._reserved + slots > self._max_queue:
            raise EngineUnavailable(
                f"capture queue full ({self._max_queue} records waiting for the database): try again shortly",
                code="capture_queue_full",
                retry_after=CAPTURE_RETRY_AFTER_S,
            )
        self._reserved += slots

    def release(self, slots: int) -> None:
        """Give back reserved slots that were not used."""
        self._reserved = max(self._reserved - slots, 0)

    def submit(self, record: Record, *, reserved: bool = False) -> None:
        """Queue a record for writing. Never blocks. Raises EngineUnavailable when the queue is full, unless the
        record uses a slot held by ``reserve`` (then it is always queued, even at shutdown: it was served)."""
        if reserved:
            self._reserved = max(self._reserved - 1, 0)
            if self._closed:
                # Served after the writer closed (it waits for no one): spooled on its own, replayed at next start.
                self._spool([record])
                self.stats.spooled += 1
                return
        elif self._closing:
            raise EngineUnavailable("capture writer is shut down", code="capture_closed", retry_after=5)
        elif self.stats.queued + self._reserved >= self._max_queue:
            raise EngineUnavailable("capture queue full", code="capture_queue_full", retry_after=CAPTURE_RETRY_AFTER_S)
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
        loaded = await asyncio.to_thread(self._load_spool)
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
        prepared = await loop.run_in_executor(self._executor, _prepare, batch)
        delay = self._initial_backoff
        while True:
            try:
                outcome = await loop.run_in_executor(self._executor, self._commit, prepared, len(batch))
            except Exception as error:
                if not is_transient(error):
                    # _commit settles row errors itself, so this is unexpected; keep the rows and keep going.
                    log.exception("capture write of %d rows failed unexpectedly; dead-lettering them", len(batch))
                    dead = [(record, _describe(error)) for record in batch]
                    await loop.run_in_executor(self._executor, self._dead_letter, dead)
                    return _Outcome(written=0, dead=dead)
                self.stats.retries += 1
                self.stats.last_error = _describe(error)
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

    def _commit(self, prepared: _Prepared, total: int) -> _Outcome:
        dead = list(prepared.dead)
        try:
            with self._engine.begin() as connection:
                self._execute(connection, prepared)
        except Exception as error:
            if is_transient(error):
                raise
            log.warning("capture batch failed (%s); retrying it row by row", _describe(error))
            try:
                dead.extend(self._commit_row_by_row(prepared))
            except Exception as row_error:
                if is_transient(row_error):
                    raise
                # Not one row's fault (say, a failure at COMMIT): the whole batch is rejected, on record.
                reason = _describe(row_error)
                dead.extend((record, reason) for _, record in [*prepared.calls, *prepared.rewards])
                dead.extend(
                    (source, reason)
                    for _, sources in prepared.rollouts.values()
                    for source in sources
                    if isinstance(source, RolloutRecord)
                )
        self._dead_letter(dead)
        return _Outcome(written=total - len(dead), dead=dead)

    def _execute(self, connection: sa.Connection, prepared: _Prepared) -> None:
        statements = self._statements
        if prepared.rollouts:
            connection.execute(statements.rollouts, [row for row, _ in prepared.rollouts.values()])
        if prepared.calls:
            connection.execute(statements.calls, [row for row, _ in prepared.calls])
            links = [_next_state_link(row) for row, _ in prepared.calls if row["parent_call_id"] is not None]
            if links:
                connection.execute(statements.next_state, links)
        if prepared.rewards:
            connection.execute(statements.rewards, [row for row, _ in prepared.rewards])

    def _commit_row_by_row(self, prepared: _Prepared) -> list[tuple[Record, str]]:
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
                steps.append((statements.next_state, _next_state_link(row)))
            rows.append((steps, [record]))
        rows.extend(([(statements.rewards, row)], [record]) for row, record in prepared.rewards)
        dead: list[tuple[Record, str]] = []
        with self._engine.begin() as connection:
            for steps, sources in rows:
                row = steps[0][1]
                try:
                    with connection.begin_nested():
                        for statement, values in steps:
                            connection.execute(statement, [values])
                except Exception as error:
                    if is_transient(error):
                        raise
                    reason = _describe(error)
                    dead.extend((source, reason) for source in sources)
                    if not sources:
                        log.error("capture rollout row %s failed: %s", row.get("id"), reason)
        return dead

    def _dead_letter(self, dead: list[tuple[Record, str]]) -> None:
        if not dead:
            return
        now = utcnow().isoformat()
        lines = [
            json.dumps({"failed_at": now, "error": reason, "record": record_to_json(record)}) + "\n"
            for record, reason in dead
        ]
        for record, reason in dead:
            log.error("capture record %s dead-lettered: %s", getattr(record, "id", "?"), reason)
        try:
            self._spool_dir.mkdir(parents=True, exist_ok=True)
            with open(self.dead_letter_path, "a", encoding="utf-8") as file:
                file.writelines(lines)
                file.flush()
                os.fsync(file.fileno())
        except OSError:
            # The rows are committed-or-rejected already; the log is their last record.
            log.exception("cannot write the dead-letter file; the rejected rows follow:\n%s", "".join(lines))

    def _spool(self, records: list[Record]) -> Path | None:
        stamp = utcnow().strftime("%Y%m%dT%H%M%S%fZ")
        path = self._spool_dir / f"pending-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        lines = [json.dumps(record_to_json(record)) + "\n" for record in records]
        try:
            self._spool_dir.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + ".tmp")
            with open(temporary, "w", encoding="utf-8") as file:
                file.writelines(lines)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
            _fsync_dir(self._spool_dir)
        except OSError:
            log.exception("cannot spool %d unwritten capture records; they follow:\n%s", len(records), "".join(lines))
            return None
        log.warning("spooled %d unwritten capture records to %s", len(records), path)
        return path

    def _load_spool(self) -> list[tuple[Path, list[Record]]]:
        if not self._spool_dir.is_dir():
            return []
        loaded: list[tuple[Path, list[Record]]] = []
        for path in sorted(self._spool_dir.glob(PENDING_GLOB)):
            records: list[Record] = []
            unreadable: list[str] = []
            with open(path, encoding="utf-8") as file:
                for line in file:
                    if not line.strip():
                        continue
                    try:
                        records.append(record_from_json(json.loads(line)))
                    except (ValueError, KeyError, TypeError) as error:
                        entry = {"failed_at": utcnow().isoformat(), "error": _describe(error), "line": line}
                        unreadable.append(json.dumps(entry) + "\n")
            if unreadable:
                log.error("%d unreadable lines in %s go to the dead-letter file", len(unreadable), path)
                with open(self.dead_letter_path, "a", encoding="utf-8") as file:
                    file.writelines(unreadable)
                self.stats.dead_lettered += len(unreadable)
            loaded.append((path, records))
        return loaded

    def _delete_replay_files(self, *, all_files: bool = False) -> None:
        keep: list[tuple[Path, int]] = []
        for path, covered_at in self._replay_files:
            if all_files or self._done >= covered_at:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            else:
                keep.append((path, covered_at))
        self._replay_files = keep


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
