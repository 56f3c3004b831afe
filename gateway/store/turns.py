"""Turns of everyday traffic in the store: which can be judged, which are ready to train, and their rewards.

A *turn* is one ``ok`` call of a rollout that has no group (no task: implicit conversations, harness sessions,
explicit rollouts opened without a task). Rollouts with a group (task runs) are trained as a whole on their
rollout-level reward (``trainer/step.py``); turns are trained one by one, as soon as they are rewarded:

- its *next state* is known when a later call continued it (``Call.next_call_id``), or its rollout closed;
- its *reward* is the sum, over reward sources, of each source's latest value for that call (``judge``,
  ``feedback``, ``rule:tool_error``, ``function:<name>``, …), plus the rollout's latest rollout-level reward once
  the rollout completed (so a client that posts one reward per conversation trains every turn not trained yet);
- it is *ready* when it has a next state (or its rollout closed), a reward, and — when a reward worker runs
  (judge or reward functions) — the worker's final verdict, so a turn is never trained before its judge score
  exists; it is consumed once per epoch (``trained_turns``).

The judge and the trainer share these conditions so they can never disagree on what a turn is.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.credentials.tokens import COMPLETION
from gateway.store.counterfactuals import Group, drawing, groups_of
from gateway.store.lineages import scope
from gateway.store.models import (
    FINAL_JUDGEMENTS,
    Call,
    Counterfactual,
    CounterfactualGroup,
    Judgement,
    Reward,
    Rollout,
    SecretFinding,
    TrainedTurn,
)

# APIs whose calls are conversations (the completions API takes raw prompts: no turns to judge).
CONVERSATION_APIS = ("chat", "messages", "responses")
FINAL = FINAL_JUDGEMENTS
ROLLOUT_SOURCE = "rollout"


def is_turn() -> tuple[sa.ColumnElement[bool], ...]:
    """An ok call of a rollout without a group, not an evaluation (needs ``Rollout`` joined on the call)."""
    return (Call.status == "ok", Rollout.group_key.is_(None), Rollout.eval.is_(False))


def has_next_state() -> sa.ColumnElement[bool]:
    """Its next state is known, or its rollout closed without one."""
    return sa.or_(Call.next_call_id.is_not(None), Rollout.status != "open")


def judgeable() -> tuple[sa.ColumnElement[bool], ...]:
    """A conversation turn with its next state, whose counterfactual group (if one is offered) is not being drawn."""
    return (*is_turn(), Call.api.in_(CONVERSATION_APIS), has_next_state(), ~drawing())


def judged() -> sa.ColumnElement[bool]:
    return sa.exists().where(Judgement.call_id == Call.id, Judgement.status.in_(FINAL))


def rewarded() -> sa.ColumnElement[bool]:
    own = sa.exists().where(Reward.call_id == Call.id)
    episode = sa.and_(
        Rollout.status == "completed",
        sa.exists().where(Reward.rollout_id == Rollout.id, Reward.call_id.is_(None)),
    )
    return sa.or_(own, episode)


def not_consumed(epoch: int) -> sa.ColumnElement[bool]:
    return ~sa.exists().where(TrainedTurn.call_id == Call.id, TrainedTurn.epoch == epoch)


def verdict_in(await_judge: bool) -> sa.ColumnElement[bool]:
    """The reward worker has had its say, when one runs (calls it never judges do not wait for it)."""
    if not await_judge:
        return sa.true()
    return sa.or_(judged(), Call.api.not_in(CONVERSATION_APIS))


def secret_in_answer() -> sa.ColumnElement[bool]:
    """The call's answer holds a credential (``gateway/credentials``)."""
    return sa.exists().where(SecretFinding.call_id == Call.id, SecretFinding.part == COMPLETION)


def secret_in_call() -> sa.ColumnElement[bool]:
    """The call's new prompt tokens or its answer hold a credential."""
    return sa.exists().where(SecretFinding.call_id == Call.id)


def ready(
    epoch: int, await_judge: bool, secrets: str = "exclude", lineage: str | None = None
) -> tuple[sa.ColumnElement[bool], ...]:
    """Ready to train by ``lineage`` (None: by any; the query joins ``Rollout``). Under ``secrets="exclude"`` a turn
    whose answer holds a credential never is (it is not trained, nor counted as consumed); under "drop", nor is one
    whose new prompt tokens held one (a turn after it, whose context repeats those tokens, gets no trainable token in
    its tree)."""
    trainable: tuple[sa.ColumnElement[bool], ...] = ()
    if secrets == "exclude":
        trainable = (~secret_in_answer(),)
    elif secrets == "drop":
        trainable = (~secret_in_call(),)
    return (
        *is_turn(),
        has_next_state(),
        rewarded(),
        not_consumed(epoch),
        verdict_in(await_judge),
        *trainable,
        *scope(lineage),
    )


def answers() -> sa.ColumnElement[int]:
    """The answers a turn trains (needs ``Call``): its own, and its counterfactual group's scored siblings once the
    group was scored beside it (``counterfactuals.Group.scored``). The trainer's step budget counts these: a turn
    with K scored siblings costs a step K + 1 answers' work and brings as many samples."""
    scored_siblings = (
        sa.select(sa.func.count())
        .select_from(Counterfactual)
        .join(CounterfactualGroup, CounterfactualGroup.call_id == Counterfactual.call_id)
        .where(
            Counterfactual.call_id == Call.id,
            Counterfactual.reward.is_not(None),
            CounterfactualGroup.served_reward.is_not(None),
        )
        .correlate(Call)
        .scalar_subquery()
    )
    return 1 + scored_siblings


def ready_turns(
    db: sa.Engine, epoch: int, limit: int, *, await_judge: bool, secrets: str = "exclude", lineage: str | None = None
) -> list[str]:
    """Ready turns, freshest first (as ``readiness.ready_rollouts``: the backlog ages out through staleness), as many
    as hold ``limit`` answers (``answers``; at least one turn)."""
    query = (
        sa.select(Call.id, answers())
        .join(Rollout, Rollout.id == Call.rollout_id)
        .where(*ready(epoch, await_judge, secrets, lineage))
        .order_by(Call.started_at.desc(), Call.id.desc())
        .limit(limit)
    )
    out: list[str] = []
    total = 0
    with Session(db) as session:
        for call_id, n in session.execute(query):
            if out and total + int(n) > limit:
                break
            out.append(call_id)
            total += int(n)
    return out


@dataclass(slots=True)
class Backlog:
    """What the turns of everyday traffic are waiting for (for the trainer's status line)."""

    ready: int = 0
    answers: int = 0  # the ready turns' answers, their scored counterfactual siblings included (``answers``)
    awaiting_next_state: int = 0  # rollout still open, no later call yet
    awaiting_judge: int = 0  # next state known, reward worker not done
    oldest_ready_age: float | None = None  # seconds since the oldest ready turn was served


def backlog(
    db: sa.Engine, epoch: int, *, await_judge: bool, secrets: str = "exclude", lineage: str | None = None
) -> Backlog:
    base = sa.select(sa.func.count()).select_from(Call).join(Rollout, Rollout.id == Call.rollout_id)
    pending = (*is_turn(), not_consumed(epoch), *scope(lineage))
    is_ready = ready(epoch, await_judge, secrets, lineage)
    counted = (
        sa.select(sa.func.count(), sa.func.sum(answers()))
        .select_from(Call)
        .join(Rollout, Rollout.id == Call.rollout_id)
    )
    with Session(db) as session:
        turns, total = session.execute(counted.where(*is_ready)).one()
        out = Backlog(
            ready=int(turns or 0),
            answers=int(total or 0),
            awaiting_next_state=int(session.scalar(base.where(*pending, ~has_next_state())) or 0),
        )
        if await_judge:
            waiting = sa.and_(Call.api.in_(CONVERSATION_APIS), ~judged())
            out.awaiting_judge = int(session.scalar(base.where(*pending, has_next_state(), waiting)) or 0)
        oldest = session.scalar(
            sa.select(sa.func.min(Call.ended_at)).join(Rollout, Rollout.id == Call.rollout_id).where(*is_ready)
        )
    if oldest is not None:
        out.oldest_ready_age = (dt.datetime.now(dt.UTC) - oldest).total_seconds()
    return out


@dataclass(slots=True)
class TurnReward:
    """A turn's reward: the sum of the latest value of each source, and those values."""

    value: float
    sources: dict[str, float] = field(default_factory=dict)


def turn_rewards(session: Session, call_ids: Iterable[str]) -> dict[str, TurnReward]:
    """The reward of each given turn (see the module docstring); turns without any reward are left out."""
    ids = list(call_ids)
    if not ids:
        return {}
    latest: dict[str, dict[str, float]] = {}
    rollout_of: dict[str, str] = {}
    for chunk in _chunks(ids, 500):
        for call_id, source, value in session.execute(
            sa.select(Reward.call_id, Reward.source, Reward.value).where(Reward.call_id.in_(chunk)).order_by(Reward.id)
        ):
            latest.setdefault(str(call_id), {})[source or "unknown"] = float(value)
        for call_id, rollout_id in session.execute(sa.select(Call.id, Call.rollout_id).where(Call.id.in_(chunk))):
            rollout_of[call_id] = rollout_id
    completed_rewards: dict[str, float] = {}
    rollout_ids = sorted(set(rollout_of.values()))
    for chunk in _chunks(rollout_ids, 500):
        rows = session.execute(
            sa.select(Reward.rollout_id, Reward.value)
            .join(Rollout, Rollout.id == Reward.rollout_id)
            .where(Reward.rollout_id.in_(chunk), Reward.call_id.is_(None), Rollout.status == "completed")
            .order_by(Reward.id)
        )
        for rollout_id, value in rows:
            completed_rewards[rollout_id] = float(value)
    out: dict[str, TurnReward] = {}
    for call_id in ids:
        sources = dict(latest.get(call_id, {}))
        episode = completed_rewards.get(rollout_of.get(call_id, ""))
        if episode is not None:
            sources[ROLLOUT_SOURCE] = episode
        if sources:
            out[call_id] = TurnReward(sum(sources.values()), sources)
    return out


@dataclass(slots=True)
class TurnHistory:
    """A turn and what became of it: its rollout's status, its reward, the judge's verdict, its training."""

    call: Call
    rollout_status: str
    reward: TurnReward | None
    verdict: Judgement | None
    trained: TrainedTurn | None  # the latest epoch that consumed it
    group: Group | None = None  # its counterfactual siblings and their scores, when drawn


def turn_history(db: sa.Engine, *, rollout_id: str | None = None, limit: int = 20) -> list[TurnHistory]:
    """The newest turns (of one rollout, or all), newest first (``clawgate turns``)."""
    query = sa.select(Call, Rollout.status).join(Rollout, Rollout.id == Call.rollout_id).where(*is_turn())
    if rollout_id is not None:
        query = query.where(Call.rollout_id == rollout_id)
    query = query.order_by(Call.started_at.desc(), Call.id.desc()).limit(limit)
    with Session(db) as session:
        rows = session.execute(query).all()
        ids = [call.id for call, _ in rows]
        rewards = turn_rewards(session, ids)
        verdicts = {j.call_id: j for j in session.scalars(sa.select(Judgement).where(Judgement.call_id.in_(ids)))}
        trained: dict[str, TrainedTurn] = {}
        for t in session.scalars(
            sa.select(TrainedTurn).where(TrainedTurn.call_id.in_(ids)).order_by(TrainedTurn.epoch)
        ):
            trained[t.call_id] = t
        groups = groups_of(session, ids)
    return [
        TurnHistory(
            call, status, rewards.get(call.id), verdicts.get(call.id), trained.get(call.id), groups.get(call.id)
        )
        for call, status in rows
    ]


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


__all__ = [
    "CONVERSATION_APIS",
    "FINAL",
    "Backlog",
    "TurnHistory",
    "TurnReward",
    "backlog",
    "judgeable",
    "ready",
    "ready_turns",
    "turn_history",
    "turn_rewards",
]
