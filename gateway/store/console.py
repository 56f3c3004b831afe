"""Read-only queries behind the operator console (``/dashboard``): what serves, what learns, what happened.

Each function opens its own session and returns plain dataclasses, so the pages render without touching the ORM
(and the queries can be tested without a web page). Everything here is a bounded query: pages ask for a limit.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import policy_versions
from gateway.store.models import Call, Reward, Rollout, TrainedRollout, TrainedTurn, TrainStep


@dataclass(slots=True)
class Spread:
    """Mean, count and standard deviation of a set of rewards."""

    count: int = 0
    mean: float | None = None
    std: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls()
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        return cls(len(values), mean, math.sqrt(var))


@dataclass(slots=True)
class Traffic:
    calls: int  # calls recorded in the window
    completion_tokens: int
    window_s: float

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s


def traffic(db: sa.Engine, window_s: float = 60.0) -> Traffic:
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=window_s)
    with Session(db) as session:
        calls, tokens = session.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(Call.completion_len), 0)).where(
                Call.ended_at >= since
            )
        ).one()
    return Traffic(int(calls), int(tokens), window_s)


@dataclass(slots=True)
class VersionRow:
    version: int
    adapter_name: str
    status: str
    is_current: bool
    created_at: dt.datetime
    current_at: dt.datetime | None
    metrics: dict[str, Any]
    turn_reward: Spread  # rewards of the turns this version served (call-level rewards)
    rollout_reward: Spread  # rollout-level rewards of rollouts this version served first
    eval_reward: Spread  # the same, for evaluation rollouts only (pass rates when rewards are 0/1)
    trained_rollouts: int = 0  # rollouts consumed by the step that published this version
    trained_turns: int = 0
    parent_version: int | None = None
    rolled_back_from: int | None = None
    stage: str = "promoted"  # guarded promotion: candidate | canary | promoted | rejected
    lineage: str = ""  # "" the shared policy, else the tenant whose own policy it is


def versions(db: sa.Engine, limit: int = 200) -> list[VersionRow]:
    """The newest ``limit`` policy versions, oldest first, with the rewards of what each one served."""
    with Session(db) as session:
        rows = policy_versions.newest_first(session, limit)
        rows.reverse()
        if not rows:
            return []
        low = rows[0].version
        turn: dict[int, list[float]] = {}
        for version, value in session.execute(
            sa.select(Call.policy_version, Reward.value)
            .join(Call, Call.id == Reward.call_id)
            .where(Call.policy_version >= low)
        ):
            turn.setdefault(int(version or 0), []).append(float(value))
        # A rollout is credited to the version of its first call (the one that started the episode).
        first_call = (
            sa.select(Call.rollout_id, sa.func.min(Call.policy_version).label("version"))
            .group_by(Call.rollout_id)
            .subquery()
        )
        rollout: dict[int, list[float]] = {}
        evals: dict[int, list[float]] = {}
        latest = sa.select(sa.func.max(Reward.id)).where(Reward.call_id.is_(None)).group_by(Reward.rollout_id)
        for version, value, is_eval in session.execute(
            sa.select(first_call.c.version, Reward.value, Rollout.eval)
            .join(first_call, first_call.c.rollout_id == Reward.rollout_id)
            .join(Rollout, Rollout.id == Reward.rollout_id)
            .where(Reward.id.in_(latest), first_call.c.version >= low)
        ):
            (evals if is_eval else rollout).setdefault(int(version), []).append(float(value))
        trained_r = dict(
            session.execute(sa.select(TrainedRollout.version, sa.func.count()).group_by(TrainedRollout.version)).all()
        )
        trained_t = dict(
            session.execute(sa.select(TrainedTurn.version, sa.func.count()).group_by(TrainedTurn.version)).all()
        )
        return [
            VersionRow(
                version=v.version,
                adapter_name=v.adapter_name,
                status=v.status,
                is_current=v.is_current,
                created_at=v.created_at,
                current_at=v.current_at,
                metrics=v.metrics or {},
                turn_reward=Spread.of(turn.get(v.version, [])),
                rollout_reward=Spread.of(rollout.get(v.version, [])),
                eval_reward=Spread.of(evals.get(v.version, [])),
                trained_rollouts=int(trained_r.get(v.version, 0)),
                trained_turns=int(trained_t.get(v.version, 0)),
                parent_version=v.parent_version,
                rolled_back_from=v.rolled_back_from,
                stage=v.stage,
                lineage=v.lineage,
            )
            for v in rows
        ]


@dataclass(slots=True)
class GroupReward:
    task_id: str | None
    harness: str | None
    reward: Spread


def reward_by_task_and_harness(db: sa.Engine, limit: int = 100) -> list[GroupReward]:
    """The latest rollout-level reward of each rollout, per task × harness (most rollouts first)."""
    latest = sa.select(sa.func.max(Reward.id)).where(Reward.call_id.is_(None)).group_by(Reward.rollout_id)
    groups: dict[tuple[str | None, str | None], list[float]] = {}
    with Session(db) as session:
        for task, harness, value in session.execute(
            sa.select(Rollout.task_id, Rollout.harness, Reward.value)
            .join(Rollout, Rollout.id == Reward.rollout_id)
            .where(Reward.id.in_(latest))
        ):
            groups.setdefault((task, harness), []).append(float(value))
    out = [GroupReward(t, h, Spread.of(v)) for (t, h), v in groups.items()]
    out.sort(key=lambda g: (-g.reward.count, g.task_id or "", g.harness or ""))
    return out[:limit]


@dataclass(slots=True)
class StepRow:
    id: int
    version: int | None
    base_version: int | None
    algorithm: str
    status: str
    n_rollouts: int
    tokens_processed: int
    trainable_tokens: int
    metrics: dict[str, Any]
    error: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None

    @property
    def seconds(self) -> float | None:
        return (self.ended_at - self.started_at).total_seconds() if self.ended_at else None


def train_steps(db: sa.Engine, limit: int = 500) -> list[StepRow]:
    """The newest ``limit`` train steps (failed ones included), oldest first."""
    with Session(db) as session:
        rows = list(session.scalars(sa.select(TrainStep).order_by(TrainStep.id.desc()).limit(limit)))
    rows.reverse()
    return [
        StepRow(
            id=s.id,
            version=s.version,
            base_version=s.base_version,
            algorithm=s.algorithm,
            status=s.status,
            n_rollouts=s.n_rollouts,
            tokens_processed=s.tokens_processed,
            trainable_tokens=s.trainable_tokens,
            metrics=s.metrics or {},
            error=s.error,
            started_at=s.started_at,
            ended_at=s.ended_at,
        )
        for s in rows
    ]


@dataclass(slots=True)
class RolloutFilter:
    task_id: str | None = None
    harness: str | None = None
    status: str | None = None
    policy_version: int | None = None
    tenant: str | None = None  # a tenant admin's console: its own tenant's only


@dataclass(slots=True)
class RolloutRow:
    id: str
    kind: str
    task_id: str | None
    harness: str | None
    status: str
    eval: bool
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None
    reward: float | None = None  # the latest rollout-level reward
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)  # the policy versions that served its calls

    @property
    def seconds(self) -> float:
        end = self.finished_at or self.updated_at
        return max((end - self.created_at).total_seconds(), 0.0)


def rollouts_page(
    db: sa.Engine, where: RolloutFilter, *, offset: int = 0, limit: int = 50
) -> tuple[list[RolloutRow], int]:
    """One page of rollouts, newest first, with their latest reward, calls, tokens and versions; and the total."""
    conditions: list[sa.ColumnElement[bool]] = []
    if where.task_id:
        conditions.append(Rollout.task_id == where.task_id)
    if where.harness:
        conditions.append(Rollout.harness == where.harness)
    if where.status:
        conditions.append(Rollout.status == where.status)
    if where.tenant is not None:
        conditions.append(Rollout.tenant == where.tenant)
    if where.policy_version is not None:
        conditions.append(Rollout.id.in_(sa.select(Call.rollout_id).where(Call.policy_version == where.policy_version)))
    with Session(db) as session:
        total = session.scalar(sa.select(sa.func.count()).select_from(Rollout).where(*conditions)) or 0
        found = list(
            session.scalars(
                sa.select(Rollout)
                .where(*conditions)
                .order_by(Rollout.created_at.desc(), Rollout.id.desc())
                .offset(offset)
                .limit(limit)
            )
        )
        rows = {
            r.id: RolloutRow(
                r.id, r.kind, r.task_id, r.harness, r.status, r.eval, r.created_at, r.updated_at, r.finished_at
            )
            for r in found
        }
        for rid, stats in _stats(session, list(rows)).items():
            row = rows[rid]
            row.reward, row.calls, row.versions = stats.reward, stats.calls, stats.versions
            row.prompt_tokens, row.completion_tokens = stats.prompt_tokens, stats.completion_tokens
    return list(rows.values()), int(total)


@dataclass(slots=True)
class RolloutStats:
    reward: float | None = None  # the latest rollout-level reward
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)  # the policy versions that served its calls, ascending


def rollout_stats(db: sa.Engine, ids: list[str]) -> dict[str, RolloutStats]:
    """Each rollout's latest reward, call and token counts and serving versions (three grouped queries)."""
    with Session(db) as session:
        return _stats(session, ids)


def _stats(session: Session, ids: list[str]) -> dict[str, RolloutStats]:
    out = {rid: RolloutStats() for rid in ids}
    if not ids:
        return out
    for rid, n, prompt, completion in session.execute(
        sa.select(Call.rollout_id, sa.func.count(), sa.func.sum(Call.prompt_len), sa.func.sum(Call.completion_len))
        .where(Call.rollout_id.in_(ids))
        .group_by(Call.rollout_id)
    ):
        stats = out[rid]
        stats.calls, stats.prompt_tokens, stats.completion_tokens = int(n), int(prompt or 0), int(completion or 0)
    for rid, version in session.execute(
        sa.select(Call.rollout_id, Call.policy_version)
        .where(Call.rollout_id.in_(ids), Call.policy_version.is_not(None))
        .distinct()
    ):
        out[rid].versions.append(int(version or 0))
    latest = (
        sa.select(sa.func.max(Reward.id))
        .where(Reward.call_id.is_(None), Reward.rollout_id.in_(ids))
        .group_by(Reward.rollout_id)
    )
    for rid, value in session.execute(sa.select(Reward.rollout_id, Reward.value).where(Reward.id.in_(latest))):
        out[rid].reward = float(value)
    for stats in out.values():
        stats.versions.sort()
    return out


@dataclass(slots=True)
class Backlog:
    rollouts: dict[str, int]  # by status
    calls: int
    versions: int
    steps_ok: int
    steps_failed: int
    last_step: StepRow | None


def backlog(db: sa.Engine) -> Backlog:
    with Session(db) as session:
        by_status = dict(session.execute(sa.select(Rollout.status, sa.func.count()).group_by(Rollout.status)).all())
        calls = session.scalar(sa.select(sa.func.count()).select_from(Call)) or 0
        versions = policy_versions.count(session)
        steps = dict(session.execute(sa.select(TrainStep.status, sa.func.count()).group_by(TrainStep.status)).all())
    last = train_steps(db, limit=1)
    return Backlog(
        rollouts={str(k): int(v) for k, v in by_status.items()},
        calls=int(calls),
        versions=int(versions),
        steps_ok=int(steps.get("ok", 0)),
        steps_failed=int(steps.get("failed", 0)),
        last_step=last[0] if last else None,
    )


__all__ = [
    "Backlog",
    "GroupReward",
    "RolloutFilter",
    "RolloutRow",
    "RolloutStats",
    "Spread",
    "StepRow",
    "Traffic",
    "VersionRow",
    "backlog",
    "reward_by_task_and_harness",
    "rollout_stats",
    "rollouts_page",
    "traffic",
    "train_steps",
    "versions",
]
