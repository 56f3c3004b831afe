"""The reward worker's bookkeeping in the store: which turns to judge, claiming one, and recording a verdict once.

The worker (``rewards/worker.py``) runs these; the conditions of a judgeable turn are ``turns.py``'s.

Exactly once: a turn's verdict lives in ``judgements`` (primary key: the call). A worker *claims* a turn by
setting a random token and a lease on its row in one conditional UPDATE, so of two workers racing for a turn one
wins; it records the verdict and the rewards in one transaction that first checks it still holds the claim. A
worker that dies mid-turn leaves a lease that expires, and the turn is claimed again — its judge call may run
twice, its verdict is recorded once.

Between attempts a turn stays ``running`` with no claim and a ``retry_at``; ``attempts`` counts the attempts
that were the turn's fault (an unparseable answer, a refused request), never outages of the judge.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from gateway.store import codec, policy_versions, repo, turns
from gateway.store.models import Call, Judgement, Reward, Rollout, TrainedTurn
from gateway.store.secret_spans import Span, sequence_spans, shifted


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def oldest_useful_version(session: Session, max_staleness: int | None) -> int | None:
    """Turns served by an older version would be consumed untrained (staleness bound): not worth a judge call."""
    if max_staleness is None:
        return None
    return policy_versions.oldest_within(session, max_staleness)


def candidates(
    db: sa.Engine, limit: int, *, exclude: set[str], max_staleness: int | None = None
) -> list[tuple[str, str]]:
    """(call id, rollout id) of judgeable turns nobody holds or has finished, oldest first."""
    now = utcnow()
    blocked = sa.exists().where(
        Judgement.call_id == Call.id,
        sa.or_(Judgement.status.in_(turns.FINAL), Judgement.claimed_until > now, Judgement.retry_at > now),
    )
    trained = sa.exists().where(TrainedTurn.call_id == Call.id)
    with Session(db) as session:
        query = (
            sa.select(Call.id, Call.rollout_id)
            .join(Rollout, Rollout.id == Call.rollout_id)
            .where(*turns.judgeable(), ~blocked, ~trained)
        )
        oldest = oldest_useful_version(session, max_staleness)
        if oldest is not None:
            query = query.where(sa.func.coalesce(Call.policy_version, 0) >= oldest)
        if exclude:
            query = query.where(Call.id.not_in(sorted(exclude)))
        rows = session.execute(query.order_by(Call.started_at, Call.id).limit(limit)).all()
    return [(r[0], r[1]) for r in rows]


def backlog(db: sa.Engine, *, max_staleness: int | None = None) -> int:
    """Judgeable turns without a final verdict."""
    done = sa.exists().where(Judgement.call_id == Call.id, Judgement.status.in_(turns.FINAL))
    trained = sa.exists().where(TrainedTurn.call_id == Call.id)
    with Session(db) as session:
        query = (
            sa.select(sa.func.count())
            .select_from(Call)
            .join(Rollout, Rollout.id == Call.rollout_id)
            .where(*turns.judgeable(), ~done, ~trained)
        )
        oldest = oldest_useful_version(session, max_staleness)
        if oldest is not None:
            query = query.where(sa.func.coalesce(Call.policy_version, 0) >= oldest)
        return int(session.scalar(query) or 0)


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """A turn's exact recorded tokens and what the judge is told about it (``rewards/turns.py`` decodes them)."""

    call_id: str
    rollout_id: str
    api: str
    policy_version: int | None
    finish_reason: str | None
    prompt: npt.NDArray[np.uint32]
    completion: npt.NDArray[np.uint32]
    # The tokens the continuing call has after this call's prompt + completion; None: no linked continuation.
    next_state: npt.NDArray[np.uint32] | None
    harness: str | None
    rollout_metadata: dict[str, Any] | None
    # Credentials in each of the three, as (kind, start, end) over its own ids (``secret_spans``).
    prompt_secrets: list[Span] = field(default_factory=list)
    completion_secrets: list[Span] = field(default_factory=list)
    next_state_secrets: list[Span] = field(default_factory=list)


def recorded_turn(db: sa.Engine, call_id: str) -> RecordedTurn | None:
    """The turn of call ``call_id`` (None when the call is gone)."""
    with Session(db) as session:
        call = session.get(Call, call_id)
        if call is None:
            return None
        rollout = session.get(Rollout, call.rollout_id)
        cache = repo.CallCache(session)
        prompt = repo.full_prompt_array(cache, call)
        next_state: npt.NDArray[np.uint32] | None = None
        start = call.prompt_len + call.completion_len
        child = session.get(Call, call.next_call_id) if call.next_call_id is not None else None
        # The child's prompt starts with exactly this call's prompt + completion (that is how it was linked).
        if child is not None and child.parent_call_id == call.id and child.prompt_prefix_len == start:
            next_state = repo.full_prompt_array(cache, child)[start:]
        spans = sequence_spans(session, [call] if next_state is None or child is None else [call, child])
        return RecordedTurn(
            call_id=call.id,
            rollout_id=call.rollout_id,
            api=call.api,
            policy_version=call.policy_version,
            finish_reason=call.finish_reason,
            prompt=prompt,
            completion=codec.ids_array(call.completion_ids),
            next_state=next_state,
            harness=None if rollout is None else rollout.harness,
            rollout_metadata=None if rollout is None else rollout.metadata_,
            prompt_secrets=shifted(spans[call.id], 0, call.prompt_len),
            completion_secrets=shifted(spans[call.id], call.prompt_len, call.completion_len),
            next_state_secrets=[]
            if next_state is None or child is None
            else shifted(spans[child.id], start, len(next_state)),
        )


def _insert_ignore(dialect: str) -> Any:
    table = Judgement.__table__
    assert isinstance(table, sa.Table)
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=["call_id"])
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=["call_id"])
    raise ValueError(f"the reward worker supports sqlite and postgresql, not {dialect}")


def claim(db: sa.Engine, call_id: str, rollout_id: str, token: str, lease_seconds: float) -> int | None:
    """Take one turn for ``lease_seconds``; returns its attempts so far, or None when it is not available."""
    return claim_many(db, [(call_id, rollout_id)], token, lease_seconds).get(call_id)


def claim_many(db: sa.Engine, turns_: list[tuple[str, str]], token: str, lease_seconds: float) -> dict[str, int]:
    """Take the available ones of (call id, rollout id) in one transaction: call id -> attempts so far."""
    if not turns_:
        return {}
    now = utcnow()
    ids = [call_id for call_id, _ in turns_]
    with db.begin() as connection:
        connection.execute(
            _insert_ignore(db.dialect.name),
            [
                {"call_id": call_id, "rollout_id": rollout_id, "status": "running", "attempts": 0, "created_at": now}
                for call_id, rollout_id in turns_
            ],
        )
        taken = connection.execute(
            sa.update(Judgement)
            .where(
                Judgement.call_id.in_(ids),
                Judgement.status == "running",
                sa.or_(Judgement.claimed_until.is_(None), Judgement.claimed_until <= now),
                sa.or_(Judgement.retry_at.is_(None), Judgement.retry_at <= now),
            )
            .values(claim=token, claimed_until=now + dt.timedelta(seconds=lease_seconds))
            .returning(Judgement.call_id, Judgement.attempts)
        ).all()
    return {str(call_id): int(attempts or 0) for call_id, attempts in taken}


def release(db: sa.Engine, call_id: str, token: str, *, retry_in: float, attempt: bool, error: str) -> bool:
    """Give the turn back for a later try (``attempt``: the failure was the turn's and counts)."""
    now = utcnow()
    with db.begin() as connection:
        result = connection.execute(
            sa.update(Judgement)
            .where(Judgement.call_id == call_id, Judgement.claim == token)
            .values(
                claim=None,
                claimed_until=None,
                retry_at=now + dt.timedelta(seconds=retry_in),
                attempts=Judgement.attempts + (1 if attempt else 0),
                error=error[:4000],
            )
        )
    return result.rowcount == 1


@dataclass(frozen=True, slots=True)
class NewReward:
    value: float
    source: str
    details: dict[str, Any] | None


class _LostClaim(Exception):
    pass


def finish(
    db: sa.Engine,
    call_id: str,
    rollout_id: str,
    token: str,
    *,
    status: str,
    rewards: list[NewReward],
    attempt: bool = False,
    **fields: Any,
) -> bool:
    """Record the final verdict and its rewards in one transaction, if the claim is still ours."""
    if status not in turns.FINAL:
        raise ValueError(f"not a final status: {status!r}")
    now = utcnow()
    try:
        with Session(db) as session, session.begin():
            result = session.execute(
                sa.update(Judgement)
                .where(Judgement.call_id == call_id, Judgement.claim == token)
                .values(
                    status=status,
                    claim=None,
                    claimed_until=None,
                    retry_at=None,
                    judged_at=now,
                    attempts=Judgement.attempts + (1 if attempt else 0),
                    **fields,
                )
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                raise _LostClaim
            session.add_all(
                Reward(
                    rollout_id=rollout_id,
                    call_id=call_id,
                    value=r.value,
                    source=r.source,
                    details=r.details,
                    created_at=now,
                )
                for r in rewards
            )
    except _LostClaim:
        return False
    return True


__all__ = [
    "NewReward",
    "RecordedTurn",
    "backlog",
    "candidates",
    "claim",
    "claim_many",
    "finish",
    "oldest_useful_version",
    "recorded_turn",
    "release",
]
