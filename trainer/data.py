"""From the store to the trainer's pure types: a rollout's calls as ``CallView``s, its tree, its reward.

The only module of the trainer's data path that touches the database; everything after it (tree, filters,
advantages, packing) is a pure function of what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import codec, repo
from gateway.store.models import Call, Reward, Rollout
from trainer.filters import TreeConfig
from trainer.tree import CallView, RolloutTree, build_tree


def call_views(session: Session, rollout_id: str) -> list[CallView]:
    cache = repo.CallCache.for_rollout(session, rollout_id)
    return [
        CallView(
            id=c.id,
            prompt_ids=repo.full_prompt_array(cache, c),
            completion_ids=codec.ids_array(c.completion_ids),
            completion_logprobs=codec.logprobs_array(c.completion_logprobs),
            started_at=c.started_at.timestamp(),
            status=c.status,
            policy_version=c.policy_version,
            is_subagent=c.is_subagent,
            agent_id=c.agent_id,
            finish_reason=c.finish_reason,
        )
        for c in repo.calls_for_rollout(session, rollout_id)
    ]


def rollout_reward(session: Session, rollout_id: str) -> float | None:
    """The latest rollout-level reward (per-call feedback rows have a call id and do not count here)."""
    return session.scalar(
        sa.select(Reward.value)
        .where(Reward.rollout_id == rollout_id, Reward.call_id.is_(None))
        .order_by(Reward.id.desc())
        .limit(1)
    )


@dataclass(slots=True)
class RolloutData:
    rollout: Rollout
    tree: RolloutTree
    reward: float | None
    # The policy version of each served call (None: the base model), for the trainer's staleness bound.
    served_versions: list[int | None] = field(default_factory=list)


def load_rollout(db: sa.Engine, rollout_id: str, config: TreeConfig | None = None) -> RolloutData | None:
    with Session(db, expire_on_commit=False) as session:
        rollout = session.get(Rollout, rollout_id)
        if rollout is None:
            return None
        views = call_views(session, rollout_id)
        tree = build_tree(views, config)
        served = [v.policy_version for v in views if v.status == "ok"]
        return RolloutData(rollout, tree, rollout_reward(session, rollout_id), served)


def rollout_ids(db: sa.Engine, *, status: str | None = None, limit: int | None = None) -> list[str]:
    query = sa.select(Rollout.id).order_by(Rollout.created_at, Rollout.id)
    if status is not None:
        query = query.where(Rollout.status == status)
    if limit is not None:
        query = query.limit(limit)
    with Session(db) as session:
        return list(session.scalars(query))


__all__ = ["Call", "RolloutData", "call_views", "load_rollout", "rollout_ids", "rollout_reward"]
