"""The capture writer's database side: a prepared batch committed on the writer's own connection.

``BatchCommitter`` is used only on the writer's one thread (``CallWriter`` hands it each batch there). A batch is
committed in one transaction; a transient failure (the database is unreachable, locked, not migrated) drops the
connection and is raised for the writer to retry; a batch with a bad row is retried row by row under savepoints,
and what still fails is dead-lettered to ``<spool_dir>/dead-letter.jsonl`` with its error.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.store import spool
from gateway.store.errors import describe_error, is_transient
from gateway.store.models import Call
from gateway.store.records import CallRecord, Record, RolloutRecord
from gateway.store.rows import Prepared, Scanner, Statements, as_root, next_state_link, prepare

log = logging.getLogger("clawgate.capture")


@dataclass
class Outcome:
    written: int
    dead: list[tuple[Record, str]]


class BatchCommitter:
    """Commits capture batches on one connection of its own; use from one thread only (see the module docstring)."""

    def __init__(
        self, engine: sa.Engine, spool_dir: Path, synchronous_commit: str, scanner: Scanner | None = None
    ) -> None:
        self._engine = engine
        # Credentials are looked for here, on the writer's thread: off the request path, and in the transaction that
        # stores the call, so no reader ever sees a call without its findings.
        self._scanner = scanner
        self._statements = Statements(engine.dialect.name)
        # Postgres only: set once on the writer's own connection (see _connect), so no other work on the pool
        # runs with it.
        self._session_setup = (
            f"SET synchronous_commit = {synchronous_commit}" if engine.dialect.name == "postgresql" else None
        )
        # The writer's own connection, used only on its thread (see _connect).
        self._connection: sa.Connection | None = None
        self._spool_dir = spool_dir

    def prepare_and_commit(self, batch: list[Record], prepared: list[Prepared]) -> Outcome:
        if not prepared:
            prepared.append(prepare(batch, self._scanner))
        return self._commit(prepared[0], len(batch))

    def _connect(self) -> sa.Connection:
        """The writer's own connection, opened on first use and after a failure.

        Held across batches and taken out of the pool (``detach``: closing it closes it): a commit then pays for no
        pool checkout and no pre-ping round trip, and the session setting applies to this connection only (behind
        a pooler in transaction mode, set ``synchronous_commit`` on the database role instead). A connection that
        failed is dropped (``disconnect``) and the retry opens a new one.
        """
        connection = self._connection
        if connection is not None and not connection.closed and not connection.invalidated:
            return connection
        self.disconnect()
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

    def disconnect(self) -> None:
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
            self.disconnect()
            self._write_once(prepared)

    def _write_once(self, prepared: Prepared) -> None:
        connection = self._connect()
        with connection.begin():
            self._execute(connection, prepared)

    def _commit(self, prepared: Prepared, total: int) -> Outcome:
        dead = list(prepared.dead)
        try:
            self._commit_batch(prepared)
        except Exception as error:
            if is_transient(error):
                self.disconnect()
                raise
            log.warning("capture batch failed (%s); retrying it row by row", describe_error(error))
            try:
                dead.extend(self._commit_row_by_row(prepared))
            except Exception as row_error:
                if is_transient(row_error):
                    self.disconnect()
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
        self.dead_letter(dead)
        return Outcome(written=total - len(dead), dead=dead)

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
        if prepared.findings:
            connection.execute(statements.findings, [row for row, _ in prepared.findings])
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
            steps += [(statements.findings, r) for r, source in prepared.findings if source is record]
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
                    if self._stored_as_root(connection, steps, sources):
                        continue
                    reason = describe_error(error)
                    dead.extend((source, reason) for source in sources)
                    if not sources:
                        log.error("capture rollout row %s failed: %s", row.get("id"), reason)
        return dead

    def _stored_as_root(
        self, connection: sa.Connection, steps: list[tuple[Any, dict[str, Any]]], sources: list[Record]
    ) -> bool:
        """A call whose parent was deleted (a forget or prune ran while it was served) is stored whole, as the first
        call of its conversation, instead of dead-lettered; True when that worked."""
        record = sources[0] if len(sources) == 1 else None
        if not isinstance(record, CallRecord) or record.parent_call_id is None:
            return False
        calls = Call.__table__
        parent_there = connection.execute(
            sa.select(sa.literal(1)).select_from(calls).where(calls.c.id == record.parent_call_id)
        ).first()
        root = None if parent_there is not None else as_root(record)
        if root is None:
            return False
        try:
            with connection.begin_nested():
                connection.execute(self._statements.calls, [root])
                for statement, values in steps[1:]:
                    if statement is not self._statements.next_state:
                        connection.execute(statement, [values])
        except Exception as error:
            if is_transient(error):
                raise
            return False
        log.info("call %s stored whole: its parent call %s was deleted meanwhile", record.id, record.parent_call_id)
        return True

    def dead_letter(self, dead: list[tuple[Record, str]]) -> None:
        spool.dead_letter(self._spool_dir, dead)
