"""Retention and forgetting: delete captured conversations and everything derived from them.

``prune(db, older_than=…)`` deletes the rollouts with no activity since the cutoff (``rollouts.updated_at``);
``forget.forget(db, rollouts=…, sessions=…, calls=…)`` deletes what an operator names (``forget.py``). Both
delete, per rollout or call:

- the calls (their token ids, logprobs and request bodies) and, for a forgotten call, every call that continued
  it (``parent_call_id``, transitively, in any rollout): a continuation's prompt holds the forgotten text, and it
  cannot be rebuilt without its parent anyway;
- the rewards, judgements, credential findings, trained-turn and trained-rollout rows that name them, the
  Responses-API answers stored with them and the answers that continued those (``previous_id``);
- the rollout row itself, once it has no calls left (a rollout named whole always goes).

What stays: policy versions, adapters, train steps and promotion decisions (weights, metrics and counts, no
text). A version already trained on deleted data cannot be un-trained: the report lists those versions.

Prune keeps a rollout whose calls a newer, still-kept conversation continues (the child's prompt is stored as a
delta against them); it goes once that conversation ages out too. ``keep_trained_summaries`` keeps, for rollouts
that were trained on, the rollout row, its rollout-level rewards and its trained-rollout rows (what was trained,
when, with which advantage), and deletes their calls and everything per call.

Deletion runs in small transactions (``BATCH_CALLS`` calls at most), children before parents, so capture waits
for at most one of them (SQLite) or not at all (Postgres: row locks only). A transaction that a concurrent
capture made fail (a new call or reward naming a row being deleted) is retried with the batch read again; the
capture writer stores a call whose parent was deleted under it as a conversation of its own (``batch_commit``).
Running either twice deletes nothing the second time.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa

from gateway.store.models import (
    Call,
    Counterfactual,
    CounterfactualGroup,
    Judgement,
    Reward,
    Rollout,
    SecretFinding,
    StoredResponse,
    TrainedRollout,
    TrainedTurn,
    utcnow,
)

log = logging.getLogger("clawgate.retention")

# Rows named in one IN list (well under SQLite's 32,766 bound variables and Postgres's 65,535).
CHUNK = 500
# Calls deleted in one transaction at most (a rollout larger than this is still deleted in one).
BATCH_CALLS = 2000
# Tries of one batch that concurrent capture keeps making fail, before the error is raised.
MAX_TRIES = 5

# The tables in the report, in the order rows are deleted.
TABLES = (
    "counterfactuals",
    "counterfactual_groups",
    "rewards",
    "judgements",
    "secret_findings",
    "trained_turns",
    "trained_rollouts",
    "stored_responses",
    "calls",
    "rollouts",
)

T = TypeVar("T")


@dataclass
class Report:
    """What a prune or forget deleted, table by table, and what it could not undo."""

    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    # Versions trained on deleted calls or rollouts: their weights may still reflect that data.
    trained_versions: set[int] = field(default_factory=set)
    # Prune: rollouts older than the cutoff kept because a newer conversation continues them.
    kept_continued: int = 0
    # Forget: rollout and call ids asked for that were not there (already deleted, or never).
    not_found: list[str] = field(default_factory=list)
    # Responses-API answers deleted (a gateway drops them from its cache: ``ResponseStore.discard``).
    response_ids: set[str] = field(default_factory=set)
    # Forget: rollouts deleted or changed (a call of theirs deleted), to take out of export files
    # (``gateway/store/exports.py``, done by the caller).
    affected: set[str] = field(default_factory=set)
    # Export files rewritten without them, lines removed, exports on another host or no longer there.
    exports: dict[str, Any] = field(default_factory=dict)
    # Spool files: dead-letter lines and pending files removed.
    spool_lines: int = 0
    spool_files: int = 0
    seconds: float = 0.0

    def add(self, other: Report) -> None:
        """Count a committed batch's ``other`` in."""
        for name, n in other.deleted.items():
            self.deleted[name] += n
        self.trained_versions |= other.trained_versions
        self.response_ids |= other.response_ids
        self.affected |= other.affected
        self.kept_continued += other.kept_continued

    @property
    def rows(self) -> int:
        return sum(self.deleted.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "deleted": dict(self.deleted),
            "rows": self.rows,
            "trained_versions": sorted(self.trained_versions),
            "kept_continued": self.kept_continued,
            "not_found": self.not_found,
            "exports": self.exports,
            "spool_lines": self.spool_lines,
            "spool_files": self.spool_files,
            "seconds": round(self.seconds, 3),
        }


def _chunks(values: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _tables() -> dict[str, sa.Table]:
    models: Iterable[Any] = (
        Counterfactual,
        CounterfactualGroup,
        Reward,
        Judgement,
        SecretFinding,
        TrainedTurn,
        TrainedRollout,
        StoredResponse,
        Call,
        Rollout,
    )
    return {model.__tablename__: model.__table__ for model in models}


def _descendants(connection: sa.Connection, call_ids: set[str]) -> dict[str, str | None]:
    """``call_ids`` and every call that continues one of them, transitively: id → parent id."""
    calls = Call.__table__
    found: dict[str, str | None] = {}
    frontier = sorted(call_ids)
    for chunk in _chunks(frontier):
        for call_id, parent in connection.execute(
            sa.select(calls.c.id, calls.c.parent_call_id).where(calls.c.id.in_(chunk))
        ):
            found[call_id] = parent
    frontier = sorted(found)
    while frontier:
        children: list[str] = []
        for chunk in _chunks(frontier):
            for call_id, parent in connection.execute(
                sa.select(calls.c.id, calls.c.parent_call_id).where(calls.c.parent_call_id.in_(chunk))
            ):
                if call_id not in found:
                    found[call_id] = parent
                    children.append(call_id)
        frontier = children
    return found


def _deepest_first(parents: dict[str, str | None]) -> list[str]:
    """The calls ordered so that every call comes before its parent (a statement never deletes a parent whose
    child is still there)."""
    depth: dict[str, int] = {}

    def depth_of(call_id: str) -> int:
        chain: list[str] = []
        current: str | None = call_id
        while current is not None and current in parents and current not in depth:
            chain.append(current)
            current = parents[current]
        base = depth.get(current, -1) if current is not None else -1
        for node in reversed(chain):
            base += 1
            depth[node] = base
        return depth[call_id]

    for call_id in parents:
        depth_of(call_id)
    return sorted(parents, key=lambda c: depth[c], reverse=True)


def _count(result: sa.CursorResult[Any]) -> int:
    return max(result.rowcount or 0, 0)


def _trained_versions(connection: sa.Connection, calls: list[str], rollout_ids: Sequence[str]) -> set[int]:
    """The versions trained on these calls or rollouts (read before the rows that say so go)."""
    t = _tables()
    versions: set[int] = set()
    for chunk in _chunks(calls):
        versions.update(
            connection.scalars(sa.select(t["trained_turns"].c.version).where(t["trained_turns"].c.call_id.in_(chunk)))
        )
    for chunk in _chunks(list(rollout_ids)):
        versions.update(
            connection.scalars(
                sa.select(t["trained_rollouts"].c.version).where(t["trained_rollouts"].c.rollout_id.in_(chunk))
            )
        )
    return versions


def _unlink_parents(connection: sa.Connection, parents: dict[str, str | None]) -> None:
    """A kept call whose next state was a deleted call loses the link (its next state is forgotten too). Only a
    deleted call's parent can hold such a link (``next_call_id`` is its first continuation): found by id."""
    calls = _tables()["calls"]
    kept_parents = sorted({p for p in parents.values() if p is not None and p not in parents})
    for chunk in _chunks(kept_parents):
        linked = [
            call_id
            for call_id, next_id in connection.execute(
                sa.select(calls.c.id, calls.c.next_call_id).where(calls.c.id.in_(chunk))
            )
            if next_id in parents
        ]
        if linked:
            connection.execute(sa.update(calls).where(calls.c.id.in_(linked)).values(next_call_id=None))


def _responses_of(connection: sa.Connection, calls: list[str]) -> set[str]:
    """The Responses-API answers stored with these calls, and every answer continuing one (``previous_id``)."""
    table = _tables()["stored_responses"]
    found: set[str] = set()
    for chunk in _chunks(calls):
        found.update(connection.scalars(sa.select(table.c.id).where(table.c.call_id.in_(chunk))))
    frontier = sorted(found)
    while frontier:
        more: list[str] = []
        for chunk in _chunks(frontier):
            more.extend(
                r
                for r in connection.scalars(sa.select(table.c.id).where(table.c.previous_id.in_(chunk)))
                if r not in found
            )
        found.update(more)
        frontier = more
    return found


def _delete_where(connection: sa.Connection, name: str, column: str, values: Sequence[str]) -> int:
    """Delete the rows of table ``name`` whose ``column`` is one of ``values``; how many."""
    table = _tables()[name]
    return sum(
        _count(connection.execute(sa.delete(table).where(table.c[column].in_(chunk)))) for chunk in _chunks(values)
    )


def _delete_batch(
    connection: sa.Connection,
    rollout_ids: Sequence[str],
    parents: dict[str, str | None],
    report: Report,
    *,
    keep_summaries: set[str] | None = None,
) -> None:
    """Delete the calls in ``parents`` (and what names them) and the rollouts in ``rollout_ids``, in one
    transaction the caller holds. ``keep_summaries``: rollouts whose row, rollout-level rewards and trained rows
    stay."""
    keep = keep_summaries or set()
    calls = list(parents)
    deleted: dict[str, int] = dict.fromkeys(TABLES, 0)
    report.trained_versions |= _trained_versions(connection, calls, rollout_ids)

    # Per call: rows naming a call, the parent's link to it, the Responses-API answers stored with it.
    per_call = ("counterfactuals", "counterfactual_groups", "rewards", "judgements", "secret_findings", "trained_turns")
    for name in per_call:
        deleted[name] += _delete_where(connection, name, "call_id", calls)
    _unlink_parents(connection, parents)
    responses = _responses_of(connection, calls)
    report.response_ids |= responses
    deleted["stored_responses"] += _delete_where(connection, "stored_responses", "id", sorted(responses))

    # Per rollout: what names the rollout rather than a call.
    whole = [r for r in rollout_ids if r not in keep]
    for name in ("rewards", "judgements", "trained_turns", "trained_rollouts"):
        deleted[name] += _delete_where(connection, name, "rollout_id", whole)

    # The calls, children before parents (one statement per chunk; the order makes every chunk valid alone).
    deleted["calls"] += _delete_where(connection, "calls", "id", _deepest_first(parents))
    deleted["rollouts"] += _delete_where(connection, "rollouts", "id", whole)
    for name, n in deleted.items():
        report.deleted[name] += n


def _retrying(db: sa.Engine, work: Callable[[sa.Connection], T]) -> T:
    """Run ``work`` in a transaction; again (read afresh) when a concurrent capture made it fail."""
    for attempt in range(1, MAX_TRIES + 1):
        try:
            with db.begin() as connection:
                if connection.dialect.name == "postgresql":
                    # Every lookup here names up to CHUNK ids; psycopg prepares a statement run five times, and
                    # Postgres then plans it once for any ids: a sequential scan of the whole table (measured: a
                    # tenth of the rate on a million calls). Planned for its own ids each time instead, within this
                    # transaction only.
                    connection.exec_driver_sql("SET LOCAL plan_cache_mode = force_custom_plan")
                return work(connection)
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as error:
            if attempt == MAX_TRIES:
                raise
            log.info("a deletion batch met concurrent capture (%s); trying it again", type(error.orig).__name__)
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def _calls_of(connection: sa.Connection, rollout_ids: Sequence[str]) -> dict[str, str | None]:
    calls = Call.__table__
    found: dict[str, str | None] = {}
    for chunk in _chunks(list(rollout_ids)):
        for call_id, parent in connection.execute(
            sa.select(calls.c.id, calls.c.parent_call_id).where(calls.c.rollout_id.in_(chunk))
        ):
            found[call_id] = parent
    return found


def _old_batches(db: sa.Engine, cutoff: dt.datetime, tenant: str | None = None) -> Iterator[list[str]]:
    """The ids of the rollouts idle since before ``cutoff`` (of ``tenant`` only, if named), in batches of about
    BATCH_CALLS calls."""
    rollouts, calls = Rollout.__table__, Call.__table__
    after: str | None = None
    while True:
        # Keyset pagination over the id: kept rollouts stay behind the cursor, deleted ones are gone.
        with db.connect() as connection:
            query = sa.select(rollouts.c.id).where(rollouts.c.updated_at < cutoff)
            if tenant is not None:
                query = query.where(rollouts.c.tenant == tenant)
            if after is not None:
                query = query.where(rollouts.c.id > after)
            ids = list(connection.scalars(query.order_by(rollouts.c.id).limit(CHUNK)))
            sizes: dict[str, int] = dict(
                connection.execute(
                    sa.select(calls.c.rollout_id, sa.func.count())
                    .where(calls.c.rollout_id.in_(ids))
                    .group_by(calls.c.rollout_id)
                ).all()
            )
        if not ids:
            return
        after = ids[-1]
        batch: list[str] = []
        total = 0
        for rollout_id in ids:
            if batch and total + sizes.get(rollout_id, 0) > BATCH_CALLS:
                yield batch
                batch, total = [], 0
            batch.append(rollout_id)
            total += sizes.get(rollout_id, 0)
        yield batch


def _prune_batch(connection: sa.Connection, *, batch: list[str], cutoff: dt.datetime, keep_trained: bool) -> Report:
    part = Report()
    rollouts = Rollout.__table__
    # Read again inside the transaction: a rollout that came back to life since is not deleted.
    alive = set(
        connection.scalars(sa.select(rollouts.c.id).where(rollouts.c.id.in_(batch), rollouts.c.updated_at < cutoff))
    )
    parents = _calls_of(connection, sorted(alive))
    while continued := _continued_elsewhere(connection, parents):
        part.kept_continued += len(continued)
        alive -= continued
        parents = _calls_of(connection, sorted(alive))
    keep: set[str] = set()
    if keep_trained and alive:
        trained = TrainedRollout.__table__
        for chunk in _chunks(sorted(alive)):
            keep.update(
                connection.scalars(sa.select(trained.c.rollout_id).where(trained.c.rollout_id.in_(chunk)).distinct())
            )
    _delete_batch(connection, sorted(alive), parents, part, keep_summaries=keep)
    return part


def prune(
    db: sa.Engine,
    *,
    older_than: dt.timedelta,
    keep_trained_summaries: bool = False,
    now: dt.datetime | None = None,
    progress: Callable[[Report], None] | None = None,
    tenant: str | None = None,
) -> Report:
    """Delete the rollouts (of ``tenant`` only, if named) with no activity for ``older_than`` (open ones too: their
    sessions ended long ago), with everything derived from them (see the module docstring)."""
    if older_than <= dt.timedelta(0):
        raise ValueError("older_than must be positive")
    started = time.perf_counter()
    cutoff = (now or utcnow()) - older_than
    report = Report()
    for batch in _old_batches(db, cutoff, tenant):
        report.add(
            _retrying(
                db, functools.partial(_prune_batch, batch=batch, cutoff=cutoff, keep_trained=keep_trained_summaries)
            )
        )
        if progress is not None:
            progress(report)
    report.seconds = time.perf_counter() - started
    return report


def _continued_elsewhere(connection: sa.Connection, parents: dict[str, str | None]) -> set[str]:
    """The rollouts of the calls in ``parents`` that a call outside ``parents`` continues (prune keeps them whole
    until that conversation ages out too)."""
    calls = Call.__table__
    if not parents:
        return set()
    rollout_of: dict[str, str] = {}
    ids = sorted(parents)
    for chunk in _chunks(ids):
        for call_id, rollout_id in connection.execute(
            sa.select(calls.c.id, calls.c.rollout_id).where(calls.c.id.in_(chunk))
        ):
            rollout_of[call_id] = rollout_id
    kept: set[str] = set()
    for chunk in _chunks(ids):
        for child, parent in connection.execute(
            sa.select(calls.c.id, calls.c.parent_call_id).where(calls.c.parent_call_id.in_(chunk))
        ):
            if child not in parents:
                kept.add(rollout_of[parent])
    return kept
