"""The operator's control over the served policy: pin a version, unpin, roll back.

- **Pin**: every gateway serves the pinned version (its policy follower swaps to it, even to an older one) until it is
  unpinned; the trainer may keep training and publishing, but nothing new is served meanwhile.
- **Roll back** to version V: V is pinned at once (so serving goes back now), and the trainer is asked to continue
  from V: it republishes V's weights as a new version N+1 (``rolled_back_from = V``) and, in the same transaction,
  clears the request and the pin, so gateways move on to N+1 and later versions train from it. Versions stay
  immutable and their numbers monotonic; every call still records the version that served it.

Each lineage (the shared policy, or a tenant's own: ``policy_versions``) has its own pin and rollback: one row per
lineage in ``policy_control`` (the shared lineage's is id 1), written only through these functions.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import policy_versions
from gateway.store.models import PolicyControl
from gateway.store.policy_versions import SHARED

ROW_ID = 1


class UnknownVersion(LookupError):
    """The version asked for was never published."""


@dataclass(frozen=True, slots=True)
class Control:
    pinned_version: int | None = None
    rollback_to: int | None = None
    updated_at: dt.datetime | None = None


def find(session: Session, lineage: str = SHARED, *, for_update: bool = False) -> PolicyControl | None:
    """The row of ``lineage`` (None: nothing was ever pinned, rolled back or set there)."""
    query = sa.select(PolicyControl).where(PolicyControl.lineage == lineage)
    return session.scalar(query.with_for_update() if for_update else query)


def read(db: sa.Engine, lineage: str = SHARED) -> Control:
    with Session(db) as session:
        row = find(session, lineage)
        return Control(row.pinned_version, row.rollback_to, row.updated_at) if row is not None else Control()


def pins(db: sa.Engine) -> dict[str, int]:
    """The pinned version of every lineage that has one."""
    with Session(db) as session:
        query = sa.select(PolicyControl.lineage, PolicyControl.pinned_version)
        return {lineage: int(v) for lineage, v in session.execute(query) if v is not None}


def _row(session: Session, lineage: str = SHARED) -> PolicyControl:
    row = find(session, lineage, for_update=True)
    if row is None:
        ids = session.scalar(sa.select(sa.func.max(PolicyControl.id))) or ROW_ID
        row = PolicyControl(id=ROW_ID if lineage == SHARED else ids + 1, lineage=lineage)
        session.add(row)
    return row


def _require(session: Session, version: int, lineage: str) -> None:
    found = policy_versions.lineage_of(session, version)
    if found is None:
        raise UnknownVersion(f"policy version {version} was never published")
    if found != lineage:
        raise UnknownVersion(f"policy version {version} is not a version of {describe(lineage)}")


def describe(lineage: str) -> str:
    return "the shared policy" if lineage == SHARED else f"tenant {lineage}'s policy"


def pin(db: sa.Engine, version: int, lineage: str = SHARED) -> Control:
    with Session(db) as session, session.begin():
        _require(session, version, lineage)
        row = _row(session, lineage)
        row.pinned_version, row.updated_at = version, dt.datetime.now(dt.UTC)
        return Control(row.pinned_version, row.rollback_to, row.updated_at)


def unpin(db: sa.Engine, lineage: str = SHARED) -> Control:
    """Serving follows the newest version again (a pending rollback is withdrawn too: it pins what it rolls to)."""
    with Session(db) as session, session.begin():
        row = _row(session, lineage)
        row.pinned_version, row.rollback_to, row.updated_at = None, None, dt.datetime.now(dt.UTC)
        return Control(None, None, row.updated_at)


def request_rollback(db: sa.Engine, version: int, lineage: str = SHARED) -> Control:
    with Session(db) as session, session.begin():
        _require(session, version, lineage)
        row = _row(session, lineage)
        row.pinned_version, row.rollback_to, row.updated_at = version, version, dt.datetime.now(dt.UTC)
        return Control(row.pinned_version, row.rollback_to, row.updated_at)


def complete_rollback(session: Session, rolled_back_to: int, lineage: str = SHARED) -> None:
    """Inside the transaction that records the republished version: the request is done and the pin released,
    unless the operator has changed them in the meantime."""
    row = find(session, lineage, for_update=True)
    if row is None or row.rollback_to != rolled_back_to:
        return
    row.rollback_to = None
    if row.pinned_version == rolled_back_to:
        row.pinned_version = None
    row.updated_at = dt.datetime.now(dt.UTC)


__all__ = [
    "Control",
    "UnknownVersion",
    "complete_rollback",
    "describe",
    "find",
    "pin",
    "pins",
    "read",
    "request_rollback",
    "unpin",
]
