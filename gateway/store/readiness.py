"""What the trainer may take now: task rollouts ready to train, data beyond the staleness bound, the backlog.

A rollout of a task run (it has a group) is ready once it finished ``completed`` with a rollout-level reward, is
not an evaluation rollout and was not consumed in the epoch; turns of everyday traffic have their own rules in
``turns.py``. The trainer (``trainer/step.py``, ``trainer/loop.py``) and the gateway's ``/metrics`` read the
same conditions from here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import policy_versions, turns
from gateway.store.lineages import scope
from gateway.store.models import Call, Counterfactual, Judgement, Reward, Rollout, TrainedRollout, TrainedTurn


def ready_condition(epoch: int | None, lineage: str | None = None) -> tuple[sa.ColumnElement[bool], ...]:
    """A rollout of a task run ready to train (``epoch`` None: consumed in no epoch at all) by ``lineage`` (None:
    by any)."""
    consumed = sa.select(TrainedRollout.rollout_id)
    if epoch is not None:
        consumed = consumed.where(TrainedRollout.epoch == epoch)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    return (
        Rollout.status == "completed",
        Rollout.eval.is_(False),
        Rollout.group_key.is_not(None),
        Rollout.id.in_(rewarded),
        Rollout.id.not_in(consumed),
        *scope(lineage),
    )


def ready_rollouts(db: sa.Engine, epoch: int, limit: int, lineage: str | None = None) -> list[str]:
    """Finished, rewarded, not evaluation, not consumed in ``epoch``: the freshest first.

    Freshest first, because clients may produce rollouts faster than the trainer consumes them: oldest-first would
    then train on ever staler data (further off-policy every step), while freshest-first trains on what the
    current policy produced and lets the backlog age out through the staleness bound (``stale_rollouts``).
    """
    query = (
        sa.select(Rollout.id)
        .where(*ready_condition(epoch, lineage))
        .order_by(Rollout.finished_at.desc(), Rollout.id.desc())
        .limit(limit)
    )
    with Session(db) as session:
        return list(session.scalars(query))


def stale_rollouts(
    db: sa.Engine, epoch: int, oldest_ok: int, limit: int = 10_000, lineage: str | None = None
) -> dict[str, int]:
    """Ready rollouts with a call served by a version older than ``oldest_ok``: rollout id -> that version."""
    served = (
        sa.select(Call.rollout_id, sa.func.min(sa.func.coalesce(Call.policy_version, 0)).label("version"))
        .where(Call.status == "ok")
        .group_by(Call.rollout_id)
        .subquery()
    )
    query = (
        sa.select(Rollout.id, served.c.version)
        .join(served, served.c.rollout_id == Rollout.id)
        .where(*ready_condition(epoch, lineage), served.c.version < oldest_ok)
        .limit(limit)
    )
    with Session(db) as session:
        return {row[0]: int(row[1]) for row in session.execute(query)}


def stale_turns(
    db: sa.Engine, epoch: int, oldest_ok: int, limit: int = 10_000, lineage: str | None = None
) -> dict[str, tuple[str, int]]:
    """Turns not consumed yet that a version older than ``oldest_ok`` served: call id -> (rollout id, version).

    They could never be trained (staleness only grows), ready or not, so they are consumed as stale: that also
    ends the wait of turns whose judge verdict will never come (the worker skips stale turns too).
    """
    version = sa.func.coalesce(Call.policy_version, 0)
    query = (
        sa.select(Call.id, Call.rollout_id, version)
        .join(Rollout, Rollout.id == Call.rollout_id)
        .where(*turns.is_turn(), turns.not_consumed(epoch), version < oldest_ok, *scope(lineage))
        .limit(limit)
    )
    with Session(db) as session:
        return {row[0]: (row[1], int(row[2])) for row in session.execute(query)}


@dataclass(slots=True)
class Readiness:
    rollouts: int  # ready rollouts of task runs
    groups: int  # groups with at least two ready rollouts (a GRPO baseline needs company)


def readiness(db: sa.Engine, epoch: int, lineage: str | None = None) -> Readiness:
    group = Rollout.group_key
    ready = ready_condition(epoch, lineage)
    sizes = sa.select(group.label("g"), sa.func.count().label("n")).where(*ready).group_by(group)
    with Session(db) as session:
        rows = session.execute(sizes).all()
    return Readiness(rollouts=sum(int(r.n) for r in rows), groups=sum(1 for r in rows if int(r.n) >= 2))


def oldest_ready_age(db: sa.Engine, epoch: int, lineage: str | None = None) -> float | None:
    """Seconds since the oldest ready rollout finished (None: nothing is ready)."""
    with Session(db) as session:
        query = sa.select(sa.func.min(Rollout.finished_at)).where(*ready_condition(epoch, lineage))
        oldest = session.scalar(query)
    if oldest is None:
        return None
    if oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=dt.UTC)
    return (dt.datetime.now(dt.UTC) - oldest).total_seconds()


@dataclass(slots=True)
class TrainingCounts:
    """The training backlog and its outcome, as the gateway's ``/metrics`` reports them."""

    rollouts_ready: int  # rollouts of task runs ready for training
    rollouts_trained: int
    turns: turns.Backlog  # turns of everyday traffic: ready, waiting for their next state or the judge
    turns_trained: int
    judgements: dict[str, int]  # reward-worker verdicts by status
    counterfactuals_judged: int  # counterfactual siblings with a score
    newest: int | None  # the newest published version


def training_counts(db: sa.Engine, await_judge: bool) -> TrainingCounts:
    with Session(db) as session:
        ready = session.scalar(sa.select(sa.func.count()).select_from(Rollout).where(*ready_condition(None)))
        done = session.scalar(sa.select(sa.func.count(sa.distinct(TrainedRollout.rollout_id))))
        turns_done = session.scalar(sa.select(sa.func.count(sa.distinct(TrainedTurn.call_id))))
        verdicts = dict(session.execute(sa.select(Judgement.status, sa.func.count()).group_by(Judgement.status)).all())
        siblings_judged = session.scalar(
            sa.select(sa.func.count()).select_from(Counterfactual).where(Counterfactual.reward.is_not(None))
        )
        newest = policy_versions.newest(session)
    return TrainingCounts(
        rollouts_ready=int(ready or 0),
        rollouts_trained=int(done or 0),
        turns=turns.backlog(db, 0, await_judge=await_judge),
        turns_trained=int(turns_done or 0),
        judgements={str(k): int(v) for k, v in verdicts.items()},
        counterfactuals_judged=int(siblings_judged or 0),
        newest=newest,
    )


__all__ = [
    "Readiness",
    "TrainingCounts",
    "oldest_ready_age",
    "readiness",
    "ready_condition",
    "ready_rollouts",
    "stale_rollouts",
    "stale_turns",
    "training_counts",
]
