"""What the operator sees of guarded promotion: stage, arms, evidence and decisions, as one JSON-ready dict.

Shared by ``clawgate policy status``, ``GET /v1/policy`` and the console, so all three say the same thing. The
evidence of a running canary is read fresh (``Promoter.look`` without writing a decision)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from gateway.promotion.promoter import look_at
from gateway.promotion.stats import ArmStats, Rule, half_width
from gateway.store import promotion
from gateway.store.models import PromotionDecision
from gateway.store.policy_versions import SHARED


def decision_dict(d: PromotionDecision) -> dict[str, Any]:
    return {
        "version": d.version,
        "incumbent_version": d.incumbent_version,
        "outcome": d.outcome,
        "reason": d.reason,
        "evidence": d.evidence,
        "decided_by": d.decided_by,
        "created_at": d.created_at.isoformat(),
    }


def arm_figures(values: list[float], errors: list[float], rule: Rule) -> dict[str, Any]:
    """n, mean and the mean's confidence interval (the same sequence the test uses, against a fixed point)."""
    stats, err = ArmStats.of(values), ArmStats.of(errors)
    hw = half_width(stats.var / stats.n, stats.n, rule.alpha, rule.min_n) if stats.n > 1 else None
    return {
        "n": stats.n,
        "mean": stats.mean if stats.n else None,
        "interval": [stats.mean - hw, stats.mean + hw] if hw is not None else None,
        "calls": err.n,
        "error_rate": err.mean if err.n else None,
    }


def status(db: sa.Engine, rule: Rule, *, history: int = 20, lineage: str = SHARED) -> dict[str, Any]:
    """``lineage``'s promotion (a tenant's own policy, or the shared one): a tenant's first candidate is compared
    with the shared incumbent, on the tenant's traffic."""
    state = promotion.read_state(db, lineage)
    incumbent = state.compared_with()
    out: dict[str, Any] = {
        "mode": state.mode,
        "incumbent": incumbent,
        "pinned_version": state.pinned,
        "candidate": None,
        "stage": None,
        "canary_share": None,
        "canary_started_at": None,
        "arms": None,
        "verdict": None,
        "decisions": [decision_dict(d) for d in promotion.decisions(db, history, lineage=lineage)],
    }
    undecided = state.undecided()
    if undecided is None:
        return out
    out.update(candidate=undecided.version, stage=undecided.stage)
    if state.canary is not None:
        canary = state.canary
        since = canary.stage_at or canary.created_at
        verdict, ev = look_at(db, canary, incumbent, rule, None if lineage == SHARED else lineage)
        out.update(
            canary_share=canary.canary_share,
            canary_started_at=since.isoformat(),
            arms={
                "candidate": arm_figures(ev.rewards[0], ev.errors[0], rule),
                "incumbent": arm_figures(ev.rewards[1], ev.errors[1], rule),
            },
            verdict={"outcome": verdict.outcome, "reason": verdict.reason, **verdict.evidence},
        )
    return out


__all__ = ["arm_figures", "decision_dict", "status"]
