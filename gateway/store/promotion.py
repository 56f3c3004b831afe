"""Promotion stages in the database: what serves, the canary's evidence, and decisions taken with compare-and-set.

A version's ``stage`` moves ``candidate`` → ``canary`` → ``promoted`` | ``rejected`` (a candidate may also be
promoted or rejected directly: immediate mode, an operator, a newer candidate superseding it). A trainer with an
evaluation gate publishes it ``evaluating`` first: it serves only the rollouts pinned to it until the gate moves it
on to ``candidate`` or rejects it (``trainer/eval_gate.py``). Every move is one
transaction that changes the stage only if it is still the one the mover saw (``UPDATE … WHERE stage IN …``) and
records a ``promotion_decisions`` row, so when several gateways decide at once exactly one decision is taken.
The promotion mode (``guarded`` | ``immediate``) is stored beside the operator's pin of the shared lineage
(``policy_control``): the gateways write it, the trainer reads it when it publishes; it holds for every lineage.
Stages, the incumbent and the canary are each lineage's own (``policy_versions``: a tenant's own policy is promoted
against its own incumbent, on its own traffic).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import policy_control, policy_versions
from gateway.store.models import Call, PolicyControl, PolicyVersion, PromotionDecision, Reward, Rollout
from gateway.store.policy_versions import SHARED
from gateway.store.turns import turn_rewards

GUARDED, IMMEDIATE = "guarded", "immediate"
UNDECIDED = ("evaluating", "candidate", "canary")


class NotDecidable(ValueError):
    """The operator asked to promote or reject a version that is not a candidate or in a canary."""


def set_mode(db: sa.Engine, mode: str) -> str | None:
    """Record the gateways' promotion mode; returns the mode recorded before (another gateway's, or None)."""
    with Session(db) as session, session.begin():
        row = policy_control.find(session, SHARED, for_update=True)
        if row is None:
            row = PolicyControl(id=policy_control.ROW_ID, lineage=SHARED, updated_at=dt.datetime.now(dt.UTC))
            session.add(row)
        before, row.promotion = row.promotion, mode
        return before


def mode_in(session: Session) -> str:
    row = policy_control.find(session, SHARED)
    return (row.promotion if row is not None else None) or IMMEDIATE


def initial_stage(session: Session, *, rolled_back_from: int | None, gated: bool = False, lineage: str = SHARED) -> str:
    """The stage a version is published in: a candidate under guarded promotion (``evaluating`` first when its
    trainer has an evaluation gate), unless there is nothing to compare it with (the first version) or its weights
    are an earlier version's (a rollback); promoted otherwise."""
    if mode_in(session) != GUARDED or rolled_back_from is not None:
        return "promoted"
    undecided = "evaluating" if gated else "candidate"
    if policy_versions.any_promoted(session, lineage):
        return undecided
    # A first version has nothing to compare with, unless it is a tenant's first of its own: that one is compared
    # with the shared incumbent, which serves the tenant meanwhile.
    if lineage != SHARED and policy_versions.any_promoted(session, SHARED):
        return undecided
    return "promoted"


def record_published(
    session: Session, version: int, *, rolled_back_from: int | None, at: dt.datetime, lineage: str = SHARED
) -> None:
    """Inside the transaction that publishes a promoted ``version``: say why it skipped the canary, and under guarded
    promotion retire what is still undecided (a rollback goes back to proven weights; what was trained before it
    is superseded)."""
    guarded = mode_in(session) == GUARDED
    reason = "rollback" if rolled_back_from is not None else ("first version" if guarded else "immediate")
    session.add(
        PromotionDecision(version=version, outcome="promoted", reason=reason, decided_by="trainer", created_at=at)
    )
    if not guarded:
        return
    for older in policy_versions.older_in_stages(session, version, UNDECIDED, lineage):
        policy_versions.set_stage(session, older, expect=None, stage="rejected", stage_at=at)
        session.add(
            PromotionDecision(
                version=older,
                incumbent_version=version,
                outcome="rejected",
                reason="superseded",
                decided_by="trainer",
                created_at=at,
            )
        )


@dataclass(slots=True)
class State:
    mode: str = IMMEDIATE
    pinned: int | None = None
    incumbent: PolicyVersion | None = None  # the newest promoted version
    canary: PolicyVersion | None = None
    candidates: list[PolicyVersion] = field(default_factory=list)  # published, not yet in a canary, oldest first
    evaluating: list[PolicyVersion] = field(default_factory=list)  # before the evaluation gate, oldest first
    promoted: list[int] = field(default_factory=list)  # every promoted version, newest first
    # A tenant lineage with no incumbent of its own: the shared incumbent, which serves the tenant meanwhile and
    # which its first candidate is compared with (on the tenant's traffic only).
    base: PolicyVersion | None = None
    lineage: str = SHARED

    def compared_with(self) -> int | None:
        """The version a canary is compared with: the incumbent, else the shared one serving the tenant."""
        arm = self.incumbent or self.base
        return arm.version if arm is not None else None

    def undecided(self) -> PolicyVersion | None:
        """The version the operator looks at: the canary, else the newest candidate, else the newest evaluated."""
        return self.canary or next(iter(self.candidates[-1:] or self.evaluating[-1:]), None)


def read_state(db: sa.Engine, lineage: str = SHARED) -> State:
    """``lineage``'s stages, its pin, and the promotion mode."""
    with Session(db, expire_on_commit=False) as session:
        mode = mode_in(session)
        control = policy_control.find(session, lineage)
        rows = policy_versions.in_stages(session, (*UNDECIDED, "promoted"), lineage)
        base = None
        if lineage != SHARED and not any(row.stage == "promoted" for row in rows):
            base = next(iter(policy_versions.in_stages(session, ("promoted",), SHARED)), None)
    state = State(mode=mode, pinned=control.pinned_version if control is not None else None, base=base, lineage=lineage)
    for row in rows:
        if row.stage == "promoted":
            state.promoted.append(row.version)
            state.incumbent = state.incumbent or row
        elif row.stage == "canary":
            state.canary = state.canary or row
        elif row.stage == "evaluating":
            state.evaluating.insert(0, row)
        else:
            state.candidates.insert(0, row)
    return state


def move(
    db: sa.Engine,
    version: int,
    *,
    expect: Sequence[str],
    to: str,
    reason: str,
    evidence: dict[str, Any] | None = None,
    decided_by: str | None = None,
    incumbent: int | None = None,
    share: float | None = None,
) -> bool:
    """Move ``version`` from one of the ``expect`` stages to ``to`` and record why; False when another mover was
    first (the stage was no longer one of ``expect``)."""
    now = dt.datetime.now(dt.UTC)
    values: dict[str, Any] = {"stage": to, "stage_at": now}
    if share is not None:
        values["canary_share"] = share
    with Session(db) as session, session.begin():
        if not policy_versions.set_stage(session, version, expect=expect, **values):
            return False
        session.add(
            PromotionDecision(
                version=version,
                incumbent_version=incumbent,
                outcome=to,
                reason=reason,
                evidence=evidence,
                decided_by=decided_by,
                created_at=now,
            )
        )
    return True


def decide_by_operator(
    db: sa.Engine, outcome: str, version: int | None, who: str = "operator", lineage: str = SHARED
) -> int:
    """Promote or reject a version of ``lineage`` being evaluated, a candidate or a canary (the newest undecided one
    when ``version`` is None); returns it."""
    state = read_state(db, lineage)
    undecided = [v.version for v in ([state.canary] if state.canary else []) + state.candidates + state.evaluating]
    if version is None:
        if not undecided:
            raise NotDecidable("no version is being evaluated, a candidate or in a canary")
        version = max(undecided)
    if version not in undecided:
        raise NotDecidable(
            f"policy@v{version} is not being evaluated, a candidate or in a canary (undecided: {sorted(undecided)})"
        )
    to = "promoted" if outcome == "promote" else "rejected"
    incumbent = state.compared_with()
    if not move(db, version, expect=UNDECIDED, to=to, reason="operator", decided_by=who, incumbent=incumbent):
        raise NotDecidable(f"policy@v{version} was decided meanwhile")
    return version


@dataclass(slots=True)
class Evidence:
    """Per arm (candidate, incumbent): reward samples (one per rewarded turn, one per rewarded task rollout) and
    failure indicators (one per finished call: 1 failed, 0 ok)."""

    rewards: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    errors: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))


def evidence(
    db: sa.Engine, candidate: int, incumbent: int | None, since: dt.datetime, tenant: str | None = None
) -> Evidence:
    """What each arm earned since the canary began (``tenant``: on that tenant's traffic only, for a tenant lineage
    whose candidate is compared with the shared incumbent). Cancelled calls (the client went away) are neither;
    rollouts pinned to a version (evaluations, not a share of traffic) are left out."""
    arms = {candidate: 0} if incumbent is None else {candidate: 0, incumbent: 1}
    out = Evidence()
    with Session(db) as session:
        rows = session.execute(
            sa.select(Call.id, Call.policy_version, Call.status, Call.rollout_id, Rollout.group_key)
            .join(Rollout, Rollout.id == Call.rollout_id)
            .where(
                Call.policy_version.in_(tuple(arms)),
                Call.started_at >= since,
                Call.status.in_(("ok", "failed")),
                Rollout.policy_version.is_(None),
                *(() if tenant is None else (Rollout.tenant == tenant,)),
            )
        ).all()
        turn_arm: dict[str, int] = {}
        task_rollouts: dict[str, int] = {}
        for call_id, version, status, rollout_id, group_key in rows:
            arm = arms[int(version or 0)]
            out.errors[arm].append(1.0 if status == "failed" else 0.0)
            if status != "ok":
                continue
            if group_key is None:
                turn_arm[call_id] = arm
            else:
                task_rollouts.setdefault(rollout_id, arm)  # a task run's reward is one sample of its arm
        for call_id, reward in turn_rewards(session, turn_arm).items():
            out.rewards[turn_arm[call_id]].append(reward.value)
        latest: dict[str, float] = {}
        ids = list(task_rollouts)
        for i in range(0, len(ids), 500):
            for rollout_id, value in session.execute(
                sa.select(Reward.rollout_id, Reward.value)
                .join(Rollout, Rollout.id == Reward.rollout_id)
                .where(Reward.rollout_id.in_(ids[i : i + 500]), Reward.call_id.is_(None), Rollout.status == "completed")
                .order_by(Reward.id)
            ):
                latest[rollout_id] = float(value)
        for rollout_id, value in latest.items():
            out.rewards[task_rollouts[rollout_id]].append(value)
    return out


def decisions(
    db: sa.Engine, limit: int = 50, version: int | None = None, lineage: str | None = None
) -> list[PromotionDecision]:
    """The newest decisions: on ``version``, or on the versions of ``lineage`` (None: of every lineage)."""
    query = sa.select(PromotionDecision).order_by(PromotionDecision.id.desc()).limit(limit)
    if version is not None:
        query = query.where(PromotionDecision.version == version)
    if lineage is not None:
        query = query.where(PromotionDecision.version.in_(policy_versions.of_lineage(lineage)))
    with Session(db, expire_on_commit=False) as session:
        return list(session.scalars(query))


__all__ = [
    "GUARDED",
    "IMMEDIATE",
    "UNDECIDED",
    "Evidence",
    "NotDecidable",
    "State",
    "decide_by_operator",
    "decisions",
    "evidence",
    "initial_stage",
    "mode_in",
    "move",
    "read_state",
    "record_published",
    "set_mode",
]
