"""The trainer's record in the store: a published step with what it consumed, or a failed one.

Publishing ``policy@vN`` is one transaction (``publish``): the train step, the rollouts and turns it consumed with
their advantages, and the ``policy_versions`` row gateways follow, so a crash leaves either all of them or none
(``trainer/publish.py`` writes the directory first and recovers from a crash between the two). A rollback's
request is completed and a promoted version's decision recorded in the same transaction.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import policy_control, policy_versions, promotion
from gateway.store.models import TrainedRollout, TrainedTurn, TrainStep
from gateway.store.policy_versions import NewVersion


def publish(
    db: sa.Engine,
    new: NewVersion,
    *,
    algorithm: str,
    epoch: int,
    started: dt.datetime | None,
    consumed: dict[str, float | None],
    consumed_turns: dict[str, tuple[str, float | None, float | None]],
    metrics: dict[str, float],
    gated: bool = False,
) -> int:
    """Record the train step (``started``: when it began, None for v0), what it consumed (rollout id -> advantage;
    call id -> rollout id, reward, advantage) and the version's row, in one transaction; returns the step's id (0
    for v0)."""
    now = dt.datetime.now(dt.UTC)
    with Session(db) as session, session.begin():
        step_id = 0
        if started is not None:
            step = TrainStep(
                version=new.version,
                base_version=new.parent_version,
                algorithm=algorithm,
                status="ok",
                n_rollouts=len(consumed) + len(consumed_turns),
                n_paths=0,
                tokens_processed=int(metrics.get("tokens_processed", 0)),
                trainable_tokens=int(metrics.get("trainable_tokens", 0)),
                metrics=metrics,
                started_at=started,
                ended_at=now,
            )
            session.add(step)
            session.flush()
            step_id = step.id
            _record_consumed(session, new.version, step_id, epoch, consumed, consumed_turns, now)
        # Under guarded promotion a trained version is a candidate that must earn its traffic (gateway/promotion).
        stage = promotion.initial_stage(
            session, rolled_back_from=new.rolled_back_from, gated=gated, lineage=new.lineage
        )
        policy_versions.insert(session, new, stage=stage, step=step_id or None, metrics=metrics or None, at=now)
        if new.rolled_back_from is not None:
            policy_control.complete_rollback(session, new.rolled_back_from, new.lineage)
        if stage == "promoted":
            promotion.record_published(
                session, new.version, rolled_back_from=new.rolled_back_from, at=now, lineage=new.lineage
            )
    return step_id


def _record_consumed(
    session: Session,
    version: int,
    step_id: int,
    epoch: int,
    consumed: dict[str, float | None],
    consumed_turns: dict[str, tuple[str, float | None, float | None]],
    at: dt.datetime,
) -> None:
    for rollout_id, advantage in consumed.items():
        session.add(
            TrainedRollout(
                rollout_id=rollout_id, epoch=epoch, step_id=step_id, version=version, advantage=advantage, created_at=at
            )
        )
    for call_id, (rollout_id, reward, advantage) in consumed_turns.items():
        session.add(
            TrainedTurn(
                call_id=call_id,
                epoch=epoch,
                rollout_id=rollout_id,
                step_id=step_id,
                version=version,
                reward=reward,
                advantage=advantage,
                created_at=at,
            )
        )


def record_failed(db: sa.Engine, base_version: int, error: str, started: dt.datetime, algorithm: str) -> None:
    """A step that raised: what it started from, and why it failed."""
    with Session(db) as session, session.begin():
        session.add(
            TrainStep(
                version=None,
                base_version=base_version,
                algorithm=algorithm,
                status="failed",
                n_rollouts=0,
                n_paths=0,
                tokens_processed=0,
                trainable_tokens=0,
                error=error[:4000],
                started_at=started,
                ended_at=dt.datetime.now(dt.UTC),
            )
        )


__all__ = ["publish", "record_failed"]
