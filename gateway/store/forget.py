"""Forgetting on request: named rollouts, harness sessions and calls, every call continuing them, and everything
derived from them, in the batches and order of ``retention.py`` (whose docstring says what goes and what stays).
The callers then clean spool files (``spool.py``) and export files (``exports.py``) with the ids and rollouts the
report names."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import sqlalchemy as sa

from gateway.store.models import Call, Rollout
from gateway.store.retention import Report, _calls_of, _chunks, _delete_batch, _descendants, _retrying
from gateway.store.rollout_lifecycle import SESSION_HEADERS


class NothingToForget(ValueError):
    """``forget`` was given no id at all."""


def session_rollout_ids(session_id: str) -> list[str]:
    """The rollout ids a harness session id may have (``rollout_lifecycle.SESSION_HEADERS``), and the id itself."""
    prefixes = dict.fromkeys(prefix for _, prefix in SESSION_HEADERS)
    return [session_id, *(prefix + session_id for prefix in prefixes)]


def named_ids(rollouts: Sequence[str], sessions: Sequence[str], calls: Sequence[str]) -> frozenset[str]:
    """Every id a forget names (a session as each rollout id it may have): what spool lines are matched against."""
    return frozenset([*rollouts, *calls, *(r for s in sessions for r in session_rollout_ids(s))])


def _find(
    db: sa.Engine, rollouts: list[str], calls: Sequence[str], tenants: Sequence[str], within: str | None
) -> tuple[set[str], set[str], dict[str, list[str]]]:
    """Which of the named rollouts and calls exist, and each named tenant's rollouts; ``within``: of that tenant
    only."""
    rollout_table, call_table = Rollout.__table__, Call.__table__
    scoped = (rollout_table.c.tenant == within) if within is not None else sa.true()
    existing: set[str] = set()
    found_calls: set[str] = set()
    of_tenants: dict[str, list[str]] = {}
    with db.connect() as connection:
        for chunk in _chunks(rollouts):
            query = sa.select(rollout_table.c.id).where(rollout_table.c.id.in_(chunk), scoped)
            existing.update(connection.scalars(query))
        for chunk in _chunks(list(calls)):
            joined = call_table.join(rollout_table, rollout_table.c.id == call_table.c.rollout_id)
            query = sa.select(call_table.c.id).select_from(joined).where(call_table.c.id.in_(chunk), scoped)
            found_calls.update(connection.scalars(query))
        for name in dict.fromkeys(tenants):
            query = sa.select(rollout_table.c.id).where(rollout_table.c.tenant == name, scoped)
            of_tenants[name] = list(connection.scalars(query))
    return existing, found_calls, of_tenants


def forget(
    db: sa.Engine,
    *,
    rollouts: Sequence[str] = (),
    sessions: Sequence[str] = (),
    calls: Sequence[str] = (),
    tenants: Sequence[str] = (),
    within: str | None = None,
    progress: Callable[[Report], None] | None = None,
) -> Report:
    """Delete the named rollouts, harness sessions and calls, every rollout of the named ``tenants``, every call
    continuing them and everything derived (see the module docstring). ``within``: only that tenant's data is
    found (a tenant admin's forget); another tenant's ids read as not there. Ids that are not there are reported
    in ``not_found``."""
    if not (rollouts or sessions or calls or tenants):
        raise NothingToForget("name at least one rollout, session, call or tenant to forget")
    started = time.perf_counter()
    report = Report()
    wanted_rollouts = list(dict.fromkeys(rollouts))
    session_ids = {s: session_rollout_ids(s) for s in dict.fromkeys(sessions)}
    named = [r for ids in session_ids.values() for r in ids] + wanted_rollouts
    existing, found_calls, of_tenants = _find(db, named, calls, tenants, within)
    report.not_found = [r for r in wanted_rollouts if r not in existing]
    report.not_found += [s for s, ids in session_ids.items() if not existing.intersection(ids)]
    report.not_found += [c for c in dict.fromkeys(calls) if c not in found_calls]
    report.not_found += [t for t, ids in of_tenants.items() if not ids]
    whole = sorted(existing.union(*of_tenants.values()))

    # Rollouts in batches of about BATCH_CALLS calls, then the single calls with their continuations.
    for chunk in _chunks(whole, 50):

        def drop_rollouts(connection: sa.Connection, chunk: Sequence[str] = chunk) -> Report:
            part = Report()
            parents = _descendants(connection, set(_calls_of(connection, chunk)))
            touched = _rollouts_of(connection, parents) - set(chunk)
            part.affected |= touched | set(chunk)
            _delete_batch(connection, chunk, parents, part)
            _drop_emptied(connection, touched, part)
            return part

        report.add(_retrying(db, drop_rollouts))
        if progress is not None:
            progress(report)
    if found_calls:

        def drop_calls(connection: sa.Connection) -> Report:
            part = Report()
            parents = _descendants(connection, found_calls)
            touched = _rollouts_of(connection, parents)
            part.affected |= touched
            _delete_batch(connection, [], parents, part)
            _drop_emptied(connection, touched, part)
            return part

        report.add(_retrying(db, drop_calls))
    report.seconds = time.perf_counter() - started
    return report


def _rollouts_of(connection: sa.Connection, call_ids: Iterable[str]) -> set[str]:
    calls = Call.__table__
    out: set[str] = set()
    for chunk in _chunks(sorted(call_ids)):
        out.update(connection.scalars(sa.select(calls.c.rollout_id).where(calls.c.id.in_(chunk)).distinct()))
    return out


def _drop_emptied(connection: sa.Connection, touched: set[str], report: Report) -> None:
    """Rollouts that lost calls to a forget (a continuation in another rollout, a named call) and have none left:
    deleted too, with their rollout-level rows. Only rollouts this forget touched: one just opened, with no call
    yet, stays."""
    calls, rollouts = Call.__table__, Rollout.__table__
    empty: list[str] = []
    for chunk in _chunks(sorted(touched)):
        empty.extend(
            connection.scalars(
                sa.select(rollouts.c.id).where(
                    rollouts.c.id.in_(chunk), ~sa.exists().where(calls.c.rollout_id == rollouts.c.id)
                )
            )
        )
    if empty:
        _delete_batch(connection, empty, {}, report)
