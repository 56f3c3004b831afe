"""The trainer daemon: wait until enough data is ready, take a step, publish, repeat.

A step starts when

- at least ``min_rollouts`` rollouts of task runs are ready and they form at least ``min_groups`` groups with two
  or more members (GRPO learns nothing from a group of one), or
- at least ``min_turns`` turns of everyday traffic are ready (a batch baseline needs a batch), or
- the oldest ready rollout or turn has waited ``group_wait`` seconds (so nothing is left behind for long).

Otherwise the loop sleeps ``interval`` seconds and says what it waits for: rollouts, groups, and turns awaiting
their next state or the judge (a trainer that trains nothing should say why).

Crash safety comes from the step itself (``step.py``: consumption and publication commit in one transaction,
``publish.record_version``; ``publish.recover`` resumes from the last recorded version), so the daemon may be killed
at any point. A step that raises (the database went away, a CUDA error) is logged and recorded as a failed train
step; the loop backs off and tries again — the data it would have consumed is still ready.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.faults import Fault, describe
from gateway.store import policy_control, promotion, turns
from gateway.store.models import TrainStep
from gateway.store.readiness import oldest_ready_age, readiness
from trainer.plan import StepResult
from trainer.step import Trainer

log = logging.getLogger("clawgate.trainer")


@dataclass(slots=True)
class LoopConfig:
    min_rollouts: int = 8
    min_groups: int = 1
    min_turns: int = 16
    interval: float = 5.0
    group_wait: float = 600.0
    max_steps: int | None = None  # stop after this many published steps (None: run until stopped)
    max_backoff: float = 300.0


def should_step(trainer: Trainer, cfg: LoopConfig) -> tuple[bool, str]:
    epoch = trainer.config.epoch
    ready = readiness(trainer.db, epoch)
    if ready.rollouts >= cfg.min_rollouts and ready.groups >= cfg.min_groups:
        return True, f"{ready.rollouts} rollouts ready in {ready.groups} groups"
    backlog = turns.backlog(trainer.db, epoch, await_judge=trainer.config.await_judge)
    if backlog.ready >= cfg.min_turns:
        return True, f"{backlog.ready} turns ready"
    age = oldest_ready_age(trainer.db, epoch)
    if ready.rollouts and age is not None and age >= cfg.group_wait:
        return True, f"{ready.rollouts} rollouts ready, the oldest waited {age:.0f}s"
    turn_age = backlog.oldest_ready_age
    if backlog.ready and turn_age is not None and turn_age >= cfg.group_wait:
        return True, f"{backlog.ready} turns ready, the oldest waited {turn_age:.0f}s"
    waiting = (
        f"waiting: {ready.rollouts}/{cfg.min_rollouts} rollouts ready, "
        f"{ready.groups}/{cfg.min_groups} groups with two or more; "
        f"{backlog.ready}/{cfg.min_turns} turns ready, {backlog.awaiting_next_state} await their next state"
    )
    if trainer.config.await_judge:
        waiting += f", {backlog.awaiting_judge} await the judge"
    return False, waiting


def promotion_gate(trainer: Trainer) -> tuple[bool, str]:
    """Under guarded promotion: train on only from weights that earned their traffic.

    While the version the policy holds is a candidate or in its canary, the next step waits (it would build on
    unproven weights, and a rejection would throw it away). Once that version is rejected the policy goes back to
    the incumbent's weights (``Trainer.restore``) and training goes on from there. The data the rejected version
    served stays usable: it is trained off-policy like any other older version's, under the staleness bound and
    the truncated importance weights (``loss.py``)."""
    state = promotion.read_state(trainer.db)
    if state.mode != promotion.GUARDED:
        return True, ""
    stage = promotion.stage_of(trainer.db, trainer.parent)
    if stage == "rejected":
        incumbent = (
            state.incumbent.version if state.incumbent is not None else promotion.newest_not_rejected(trainer.db)
        )
        trainer.restore(incumbent or 0)
        stage = promotion.stage_of(trainer.db, trainer.parent)
    if stage in promotion.UNDECIDED:
        return False, f"waiting: policy@v{trainer.parent} is {'in its canary' if stage == 'canary' else 'a candidate'}"
    return True, ""


def record_failure(
    db: sa.Engine, version: int, error: BaseException, started: dt.datetime, algorithm: str = "grpo"
) -> None:
    try:
        with Session(db) as session, session.begin():
            session.add(
                TrainStep(
                    version=None,
                    base_version=version,
                    algorithm=algorithm,
                    status="failed",
                    n_rollouts=0,
                    n_paths=0,
                    tokens_processed=0,
                    trainable_tokens=0,
                    error=f"{type(error).__name__}: {error}"[:4000],
                    started_at=started,
                    ended_at=dt.datetime.now(dt.UTC),
                )
            )
    except Exception as exc:  # the database is the likely cause of the failure itself: said once by the loop
        log.debug("could not record the failed step: %s", describe(exc))


def run(
    trainer: Trainer,
    cfg: LoopConfig,
    *,
    stop: threading.Event,
    on_step: Callable[[StepResult], None] = lambda r: None,
    on_wait: Callable[[str], None] = lambda msg: None,
    on_failure: Callable[[BaseException], None] = lambda exc: None,
) -> int:
    """Train until ``stop`` is set (or ``max_steps`` steps were published); returns the number of steps.

    Before each look for data it carries out an operator's rollback request (``store/policy_control.py``)."""
    steps = 0
    backoff = cfg.interval
    last_wait = ""
    # The first failure is logged with its traceback (it may be a bug), then a reminder a minute, then the recovery.
    fault = Fault(log, "train step failed", traceback_once=True)
    while not stop.is_set():
        started = dt.datetime.now(dt.UTC)
        try:
            rollback_to = policy_control.read(trainer.db).rollback_to
            if rollback_to is not None:
                trainer.rollback(rollback_to)
            go, why = promotion_gate(trainer)
            if go:
                go, why = should_step(trainer, cfg)
            result = trainer.step() if go else None
        except Exception as exc:
            fault.failed(f"{describe(exc)}; retrying in {backoff:.0f}s", exc_info=exc)
            record_failure(trainer.db, trainer.version, exc, started, trainer.config.algorithm)
            on_failure(exc)
            stop.wait(backoff)
            backoff = min(backoff * 2, cfg.max_backoff)
            continue
        fault.cleared()
        backoff = cfg.interval
        if result is not None:
            steps += 1
            on_step(result)
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                break
            continue
        if not go and why != last_wait:
            on_wait(why)
            last_wait = why
        stop.wait(cfg.interval)
    return steps


__all__ = ["LoopConfig", "oldest_ready_age", "promotion_gate", "record_failure", "run", "should_step"]
