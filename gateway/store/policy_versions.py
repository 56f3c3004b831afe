"""The rows of ``policy_versions``: every read and write of a published version goes through this module.

A row is what the gateways follow: the trainer inserts it in the transaction that publishes ``policy@vN``
(``train_steps.publish``), each gateway's policy follower marks it current, then retired (``gateway/policy.py``),
guarded promotion moves its ``stage`` (``promotion.py`` decides and records why; the statement is here), the
operator's pin and rollback check that it exists (``policy_control.py``), and the console, the readiness counts, the
reward worker and the trainer read the newest one. Functions taking a ``Session`` run inside the caller's
transaction; those taking an engine open their own.

Every version belongs to a lineage (``lineage``): "" for the shared policy, a tenant's name for a policy of its own
(``tenants.own_policy``). Version numbers are global (one trainer numbers them all); stages, "current", the newest
and the incumbent are each lineage's own.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store.models import PolicyVersion

SHARED = ""  # the shared lineage: every tenant without a policy of its own


@dataclass(frozen=True, slots=True)
class NewVersion:
    """A version being published: its adapter (written to ``path``) and where its weights come from."""

    version: int
    adapter_name: str
    path: str
    base_model: str
    parent_version: int | None = None
    rolled_back_from: int | None = None  # a rollback: the weights are those of this earlier version
    lineage: str = SHARED


def insert(
    session: Session,
    new: NewVersion,
    *,
    stage: str,
    step: int | None,
    metrics: dict[str, float] | None,
    at: dt.datetime,
) -> None:
    """Inside the transaction that publishes it: the row gateways follow (``stage``: ``promotion.initial_stage``)."""
    session.add(
        PolicyVersion(
            version=new.version,
            adapter_name=new.adapter_name,
            path=new.path,
            base_model=new.base_model,
            status="published",
            is_current=False,
            step=step,
            metrics=metrics,
            created_at=at,
            parent_version=new.parent_version,
            rolled_back_from=new.rolled_back_from,
            stage=stage,
            stage_at=at,
            lineage=new.lineage,
        )
    )


def get(db: sa.Engine, version: int) -> PolicyVersion | None:
    with Session(db, expire_on_commit=False) as session:
        return session.get(PolicyVersion, version)


def exists(session: Session, version: int) -> bool:
    return session.get(PolicyVersion, version) is not None


def published(db: sa.Engine) -> list[int]:
    """Every version the database knows, oldest first."""
    with Session(db) as session:
        return list(session.scalars(sa.select(PolicyVersion.version).order_by(PolicyVersion.version)))


def newest(session: Session) -> int | None:
    return session.scalar(sa.select(sa.func.max(PolicyVersion.version)))


def newest_first(session: Session, limit: int) -> list[PolicyVersion]:
    return list(session.scalars(sa.select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(limit)))


def count(session: Session) -> int:
    return int(session.scalar(sa.select(sa.func.count()).select_from(PolicyVersion)) or 0)


def newest_not_rejected(db: sa.Engine, lineage: str = SHARED) -> int | None:
    """The newest version of ``lineage`` whose weights a trainer may train on from (a rejected one's it must not)."""
    with Session(db) as session:
        return session.scalar(
            sa.select(sa.func.max(PolicyVersion.version)).where(
                PolicyVersion.stage != "rejected", PolicyVersion.lineage == lineage
            )
        )


def lineage_of(session: Session, version: int) -> str | None:
    return session.scalar(sa.select(PolicyVersion.lineage).where(PolicyVersion.version == version))


def oldest_within(session: Session, bound: int) -> int | None:
    """The oldest version within ``bound`` versions of its lineage's newest, over every lineage (None: no lineage has
    more than ``bound`` versions yet, so nothing is beyond the bound anywhere)."""
    by_lineage: dict[str, list[int]] = {}
    for lineage, version in session.execute(
        sa.select(PolicyVersion.lineage, PolicyVersion.version).order_by(PolicyVersion.version.desc())
    ):
        by_lineage.setdefault(lineage, []).append(int(version))
    if not by_lineage or any(len(v) <= bound for v in by_lineage.values()):
        return None
    return min(v[bound] for v in by_lineage.values())


def of_lineage(lineage: str) -> sa.Select[int]:
    """The versions of ``lineage``, as a subquery for another table's filter."""
    return sa.select(PolicyVersion.version).where(PolicyVersion.lineage == lineage)


def lineage_of_version(db: sa.Engine, version: int) -> str | None:
    """The lineage ``version`` belongs to (None: never published)."""
    with Session(db) as session:
        return lineage_of(session, version)


def lineage_versions(db: sa.Engine, lineage: str) -> list[int]:
    """The versions of ``lineage``, newest first."""
    with Session(db) as session:
        query = sa.select(PolicyVersion.version).where(PolicyVersion.lineage == lineage)
        return list(session.scalars(query.order_by(PolicyVersion.version.desc())))


# -- stages (guarded promotion: ``promotion.py`` takes the decisions) ------------------------------------------


def stage(session: Session, version: int) -> str | None:
    return session.scalar(sa.select(PolicyVersion.stage).where(PolicyVersion.version == version))


def stage_of(db: sa.Engine, version: int) -> str | None:
    with Session(db) as session:
        return stage(session, version)


def any_promoted(session: Session, lineage: str = SHARED) -> bool:
    """Whether ``lineage`` has an incumbent (a version of it was ever promoted)."""
    query = sa.select(PolicyVersion.version).where(PolicyVersion.stage == "promoted", PolicyVersion.lineage == lineage)
    return session.scalar(query.limit(1)) is not None


def in_stages(session: Session, stages: Sequence[str], lineage: str = SHARED) -> list[PolicyVersion]:
    """The versions of ``lineage`` in any of ``stages``, newest first."""
    query = sa.select(PolicyVersion).where(PolicyVersion.stage.in_(tuple(stages)), PolicyVersion.lineage == lineage)
    return list(session.scalars(query.order_by(PolicyVersion.version.desc())))


def older_in_stages(session: Session, version: int, stages: Sequence[str], lineage: str = SHARED) -> list[int]:
    """The versions of ``lineage`` before ``version`` in any of ``stages``."""
    query = sa.select(PolicyVersion.version).where(
        PolicyVersion.version < version, PolicyVersion.stage.in_(stages), PolicyVersion.lineage == lineage
    )
    return list(session.scalars(query).all())


def set_stage(session: Session, version: int, *, expect: Sequence[str] | None, **values: Any) -> bool:
    """Set ``values`` (the stage, its time, a canary's share) on ``version``; with ``expect``, only while its stage
    is still one of them (compare-and-set: False when another mover was first)."""
    query = sa.update(PolicyVersion).where(PolicyVersion.version == version)
    if expect is not None:
        query = query.where(PolicyVersion.stage.in_(tuple(expect)))
    done = session.execute(query.values(**values))
    return bool(done.rowcount == 1)  # type: ignore[attr-defined]


# -- the policy follower (``gateway/policy.py``) -----------------------------------------------------------


def mark_current(db: sa.Engine, version: int, loaded_at: dt.datetime) -> None:
    """One transaction: this version is current (and loaded), no other of its lineage is."""
    now = dt.datetime.now(dt.UTC)
    with Session(db) as session, session.begin():
        row = session.get(PolicyVersion, version)
        if row is None:
            return
        session.execute(
            sa.update(PolicyVersion)
            .where(
                PolicyVersion.version != version,
                PolicyVersion.is_current.is_(True),
                PolicyVersion.lineage == row.lineage,
            )
            .values(is_current=False)
        )
        row.is_current = True
        row.status = "loaded"
        row.loaded_at = row.loaded_at or loaded_at
        row.current_at = row.current_at or now


def mark_retired(db: sa.Engine, version: int) -> None:
    with Session(db) as session, session.begin():
        session.execute(
            sa.update(PolicyVersion)
            .where(PolicyVersion.version == version, PolicyVersion.is_current.is_(False))
            .values(status="retired")
        )


__all__ = [
    "SHARED",
    "NewVersion",
    "any_promoted",
    "count",
    "exists",
    "get",
    "in_stages",
    "insert",
    "lineage_of",
    "lineage_of_version",
    "lineage_versions",
    "mark_current",
    "mark_retired",
    "newest",
    "newest_first",
    "newest_not_rejected",
    "of_lineage",
    "older_in_stages",
    "oldest_within",
    "published",
    "set_stage",
    "stage",
    "stage_of",
]
