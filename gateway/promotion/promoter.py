"""The promoter: moves published versions through their stages, from each gateway's policy poll.

- ``immediate``: every candidate is promoted at once (a version reaches all traffic at the next poll).
- ``guarded``: the newest candidate starts a canary (older candidates are superseded: the trainer publishes one at a
  time, so more than one means a mode change or a hand-published version); a running canary is looked at every
  ``canary_check_interval`` seconds and promoted or rejected by ``stats.decide`` on the evidence since it began.
  A version being evaluated (``evaluating``) is left to its trainer's evaluation gate (``trainer/eval_gate.py``).
- While a version is pinned nothing is decided: the pin serves all traffic and the canary gathers no evidence; its
  clock keeps running, so a canary past its time limit is decided as soon as the pin is released.

Every gateway runs one; ``store.promotion.move`` lets exactly one of them take each decision, and the gateway that
took it logs it in one line with its numbers.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

import sqlalchemy as sa

from gateway.metrics import Metrics
from gateway.promotion.stats import ArmStats, Rule, Verdict, decide
from gateway.settings import Settings
from gateway.store import promotion
from gateway.store.models import PolicyVersion
from gateway.store.policy_versions import SHARED
from gateway.store.promotion import State

log = logging.getLogger("clawgate.promotion")


def rule_of(settings: Settings) -> Rule:
    return Rule(
        margin=settings.promotion_margin,
        min_n=settings.canary_min_turns,
        max_seconds=settings.canary_max_seconds,
        timeout_outcome=settings.canary_timeout_outcome,
    )


class Promoter:
    def __init__(self, settings: Settings, db: sa.Engine, gateway_id: str, metrics: Metrics | None = None) -> None:
        self.mode = settings.promotion_mode
        self.share = settings.canary_share
        self.interval = settings.canary_check_interval
        self.rule = rule_of(settings)
        self.db = db
        self.gateway_id = gateway_id
        self.metrics = metrics
        self.last: Verdict | None = None  # the latest look at the running canary (health, console, metrics)
        self.last_version: int | None = None
        self._next_look = 0.0

    def step(self, state: State) -> bool:
        """One pass (blocking: run it in a thread); True when a stage changed."""
        if state.pinned is not None:
            return False
        if self.mode == promotion.IMMEDIATE:
            changed = False
            for row in [*state.evaluating, *state.candidates, *([state.canary] if state.canary else [])]:
                changed |= self._move(row.version, "promoted", "immediate", state, None)
            return changed
        if state.canary is None:
            if not state.candidates:
                return False
            *older, newest = state.candidates
            for row in older:
                self._move(row.version, "rejected", f"superseded by policy@v{newest.version}", state, None)
            moved = promotion.move(
                self.db,
                newest.version,
                expect=("candidate",),
                to="canary",
                reason="canary started",
                decided_by=self.gateway_id,
                incumbent=_version(state),
                share=self.share,
                evidence={"share": self.share},
            )
            if moved:
                log.info(
                    "canary: policy@v%d serves %.0f%% of new conversations beside policy@v%s",
                    newest.version,
                    100 * self.share,
                    _version(state),
                )
            self._next_look = time.monotonic() + self.interval
            return moved
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + self.interval
        verdict = self.look(state)
        if verdict.outcome == "wait":
            return False
        to = "promoted" if verdict.outcome == "promote" else "rejected"
        return self._move(state.canary.version, to, verdict.reason, state, verdict)

    def look(self, state: State) -> Verdict:
        """The verdict on the running canary now (no decision is written)."""
        assert state.canary is not None
        tenant = None if state.lineage == SHARED else state.lineage
        verdict, _ = look_at(self.db, state.canary, _version(state), self.rule, tenant)
        self.last, self.last_version = verdict, state.canary.version
        if self.metrics is not None:
            for arm in ("candidate", "incumbent"):
                figures = verdict.evidence[arm]
                self.metrics.canary_samples.labels(arm).set(figures["n"])
                self.metrics.canary_reward.labels(arm).set(figures["mean"] or 0.0)
                self.metrics.canary_error_rate.labels(arm).set(figures["error_rate"] or 0.0)
        return verdict

    def _move(self, version: int, to: str, reason: str, state: State, verdict: Verdict | None) -> bool:
        incumbent = _version(state)
        moved = promotion.move(
            self.db,
            version,
            expect=promotion.UNDECIDED,
            to=to,
            reason=reason,
            evidence=verdict.evidence if verdict else None,
            decided_by=self.gateway_id,
            incumbent=incumbent,
        )
        if moved:
            if self.metrics is not None:
                self.metrics.promotion_decisions.labels(to).inc()
            e = verdict.evidence if verdict else {}
            c, i = e.get("candidate", {}), e.get("incumbent", {})
            log.info(
                "policy@v%d %s (incumbent policy@v%s): %s; n=%s/%s mean=%s/%s bound=[%s, %s] margin=%s",
                version,
                to,
                incumbent,
                reason,
                c.get("n"),
                i.get("n"),
                c.get("mean"),
                i.get("mean"),
                e.get("lower"),
                e.get("upper"),
                e.get("margin"),
            )
        return moved


def look_at(
    db: sa.Engine, canary: PolicyVersion, incumbent: int | None, rule: Rule, tenant: str | None = None
) -> tuple[Verdict, promotion.Evidence]:
    """The evidence of a running canary since it began (``tenant``: on its traffic only), and the test's verdict."""
    since = canary.stage_at or canary.created_at
    ev = promotion.evidence(db, canary.version, incumbent, since, tenant)
    elapsed = (dt.datetime.now(dt.UTC) - since).total_seconds()
    verdict = decide(
        (ArmStats.of(ev.rewards[0]), ArmStats.of(ev.rewards[1])),
        (ArmStats.of(ev.errors[0]), ArmStats.of(ev.errors[1])),
        rule,
        elapsed,
    )
    return verdict, ev


def _version(state: State) -> int | None:
    return state.compared_with()


__all__ = ["Promoter", "look_at", "rule_of"]
