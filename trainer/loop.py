"""The trainer daemon: wait until enough data is ready, take a step, publish, repeat.

A step starts when (``TrainConfig.trigger``, ``config.Trigger``)

- at least ``min_rollouts`` rollouts of task runs are ready and they form at least ``min_groups`` groups with two
  or more members (GRPO learns nothing from a group of one), or
- at least ``min_turns`` turns of everyday traffic are ready (a batch baseline needs a batch), or
- the oldest ready rollout or turn has waited ``TrainConfig.group_wait`` seconds (so nothing is left behind long).

Otherwise the loop sleeps ``interval`` seconds and says what it waits for: rollouts, groups, and turns awaiting
their next state or the judge (a trainer that trains nothing should say why).

With tenants that have a policy of their own (``gateway/store/lineages.py``) there is one lineage per such tenant
beside the shared one, each with its own data, trigger, rollback and promotion gate. The loop takes them in turn:
each pass starts with the lineage after the one that stepped last, and the first whose trigger is met steps, so a
busy tenant cannot starve the others (each lineage with data ready gets one step in every round).

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

import sqlalchemy as sa

from gateway.faults import Fault, describe
from gateway.store import lineages, policy_control, policy_versions, promotion, train_steps, turns
from gateway.store.policy_versions import SHARED
from gateway.store.readiness import oldest_ready_age, readiness
from trainer import eval_gate
from trainer.distributed import WorldLost
from trainer.eval_gate import EvalGate
from trainer.plan import StepResult
from trainer.step import Trainer

log = logging.getLogger("clawgate.trainer")


def should_step(trainer: Trainer, *, waited: bool = True, lineage: str | None = None) -> tuple[bool, str]:
    """Whether the trigger is met for ``lineage`` (None: the active one), and why (or what is awaited);
    ``waited=False`` applies only the minimums."""
    cfg, epoch, wait = trainer.config.trigger, trainer.config.epoch, trainer.config.group_wait
    lineage = trainer.lineage if lineage is None else lineage
    ready = readiness(trainer.db, epoch, lineage)
    if ready.rollouts >= cfg.min_rollouts and ready.groups >= cfg.min_groups:
        return True, f"{ready.rollouts} rollouts ready in {ready.groups} groups"
    backlog = turns.backlog(
        trainer.db, epoch, await_judge=trainer.config.await_judge, secrets=trainer.config.tree.secrets, lineage=lineage
    )
    if backlog.answers >= cfg.min_turns:
        return True, f"{_turns(backlog)} ready"
    age = oldest_ready_age(trainer.db, epoch, lineage) if waited else None
    if ready.rollouts and age is not None and age >= wait:
        return True, f"{ready.rollouts} rollouts ready, the oldest waited {age:.0f}s"
    turn_age = backlog.oldest_ready_age if waited else None
    if backlog.ready and turn_age is not None and turn_age >= wait:
        return True, f"{_turns(backlog)} ready, the oldest waited {turn_age:.0f}s"
    waiting = (
        f"waiting: {ready.rollouts}/{cfg.min_rollouts} rollouts ready, "
        f"{ready.groups}/{cfg.min_groups} groups with two or more; "
        f"{_turns(backlog, cfg.min_turns)} ready, {backlog.awaiting_next_state} await their next state"
    )
    if trainer.config.await_judge:
        waiting += f", {backlog.awaiting_judge} await the judge"
    return False, waiting


def _turns(backlog: turns.Backlog, minimum: int | None = None) -> str:
    """``3/16 turns``, or with scored counterfactual siblings ``3 turns (12/16 answers with their siblings)``: the
    step budget counts answers."""
    of = "" if minimum is None else f"/{minimum}"
    if backlog.answers == backlog.ready:
        return f"{backlog.ready}{of} turns"
    return f"{backlog.ready} turns ({backlog.answers}{of} answers with their siblings)"


def promotion_gate(trainer: Trainer, gate: EvalGate | None = None, lineage: str | None = None) -> tuple[bool, str]:
    """Under guarded promotion: train on only from weights that earned their traffic.

    While the version the policy holds is being evaluated, a candidate or in its canary, the next step waits (it
    would build on unproven weights, and a rejection would throw it away). A version being evaluated is evaluated
    here, by ``gate`` (``eval_gate.py``: a held-out suite run on it and on the incumbent) unless an operator's pin
    holds all traffic. Once the version is rejected the policy goes back to the incumbent's weights
    (``Trainer.restore``) and training goes on from there. The data the rejected version served stays usable: it
    is trained off-policy like any other older version's, under the staleness bound and the truncated importance
    weights (``loss.py``)."""
    lineage = trainer.lineage if lineage is None else lineage
    state = promotion.read_state(trainer.db, lineage)
    if state.mode != promotion.GUARDED:
        return True, ""
    parent = trainer.parent_of(lineage)
    if parent is None or parent not in policy_versions.lineage_versions(trainer.db, lineage):
        return True, ""  # a lineage not opened yet, or forked from the shared policy with nothing of its own yet
    stage = policy_versions.stage_of(trainer.db, parent)
    if stage == "evaluating" and state.pinned is None:
        tenant = None if lineage == SHARED else lineage
        stage = eval_gate.decide(trainer.db, gate, parent, state.compared_with(), tenant)
    if stage == "rejected":
        back = state.incumbent.version if state.incumbent is not None else None
        back = back or policy_versions.newest_not_rejected(trainer.db, lineage)
        if back is None and lineage != SHARED:  # its only versions were rejected: back to the shared policy's
            back = policy_versions.newest_not_rejected(trainer.db, SHARED)
        trainer.activate(lineage)
        trainer.restore(back or 0)
        parent = trainer.parent
        stage = policy_versions.stage_of(trainer.db, parent)
    if stage in promotion.UNDECIDED:
        what = {"canary": "in its canary", "candidate": "a candidate"}.get(str(stage), "to be evaluated (pinned)")
        return False, f"waiting: policy@v{parent} is {what}"
    return True, ""


def record_failure(
    db: sa.Engine, version: int, error: BaseException, started: dt.datetime, algorithm: str = "grpo"
) -> None:
    try:
        train_steps.record_failed(db, version, f"{type(error).__name__}: {error}", started, algorithm)
    except Exception as exc:  # the database is the likely cause of the failure itself: said once by the loop
        log.debug("could not record the failed step: %s", describe(exc))


def run(
    trainer: Trainer,
    *,
    stop: threading.Event,
    on_step: Callable[[StepResult], None] = lambda r: None,
    on_wait: Callable[[str], None] = lambda msg: None,
    on_failure: Callable[[BaseException], None] = lambda exc: None,
    gate: EvalGate | None = None,
) -> int:
    """Train until ``stop`` is set (or ``max_steps`` steps were published); returns the number of steps.

    Each pass looks at every lineage in turn (see the module docstring): it carries out an operator's rollback
    request (``store/policy_control.py``), under guarded promotion waits for (or with ``gate`` runs) the decision on
    the version the lineage published last, and steps the first lineage whose trigger is met."""
    cfg = trainer.config.trigger
    steps = 0
    backoff = cfg.interval
    last_wait = ""
    after: str | None = None  # the lineage that stepped last: the next pass starts after it
    # The first failure is logged with its traceback (it may be a bug), then a reminder a minute, then the recovery.
    fault = Fault(log, "train step failed", traceback_once=True)
    while not stop.is_set():
        started = dt.datetime.now(dt.UTC)
        try:
            result, why = one_pass(trainer, gate, after)
        except WorldLost:
            raise  # another rank is gone: the launcher restarts the group, from the last published version
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
            after = trainer.lineage
            steps += 1
            on_step(result)
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                break
            continue
        if why != last_wait:
            on_wait(why)
            last_wait = why
        stop.wait(cfg.interval)
    return steps


def in_turn(names: list[str], after: str | None) -> list[str]:
    """``names`` in the order of this pass: starting with the one after ``after`` (round robin)."""
    if after not in names:
        return names
    i = names.index(after) + 1
    return names[i:] + names[:i]


def one_pass(trainer: Trainer, gate: EvalGate | None, after: str | None) -> tuple[StepResult | None, str]:
    """One look at every lineage, in turn: the step taken (None: none was due) and what each one waits for."""
    waits = []
    for lineage in in_turn([SHARED, *lineages.own_policies(trainer.db)], after):
        rollback_to = policy_control.read(trainer.db, lineage).rollback_to
        if rollback_to is not None:
            trainer.activate(lineage)
            trainer.rollback(rollback_to)
        go, why = promotion_gate(trainer, gate, lineage)
        if go:
            go, why = should_step(trainer, lineage=lineage)
        if go:
            trainer.activate(lineage)
            result = trainer.step()
            if result is not None:
                return result, ""
        waits.append(why if lineage == SHARED else f"{lineage}: {why}")
    return None, "; ".join(w for w in waits if w)


__all__ = ["in_turn", "oldest_ready_age", "one_pass", "promotion_gate", "record_failure", "run", "should_step"]
