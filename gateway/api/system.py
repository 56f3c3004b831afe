"""Operational routes: health and Prometheus metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from gateway.api.deps import State
from gateway.store import turns
from gateway.store.models import Judgement, PolicyVersion, Reward, Rollout, TrainedRollout, TrainedTurn
from gateway.store.writer import is_transient

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    """What a monitor needs: each part's state now (``ok`` / ``degraded``), its last error and when it recovered.

    503 only when the engine cannot serve; a degraded capture (the database is down: calls are served and queued)
    or policy follower (no new versions are picked up) answers 200 with ``status: degraded``.
    """
    engine_ok = await state.engine.health()
    stats = state.writer.stats
    capture = {
        **state.writer.fault.snapshot(),
        "queued": stats.queued,
        "written": stats.written,
        "retries": stats.retries,
        "dead_lettered": stats.dead_lettered,
        "spooled": stats.spooled,
    }
    policy: dict[str, Any] = {"adapter": state.service.adapter, "version": state.service.policy_version}
    if state.policy is not None:
        policy.update(state.policy.fault.snapshot())
        policy["pinned_version"] = state.policy.pinned
    degraded = not engine_ok or capture["state"] != "ok" or policy.get("state", "ok") != "ok"
    body: dict[str, Any] = {
        "status": "degraded" if degraded else "ok",
        "engine": {"name": state.engine.name, "ok": engine_ok, "state": "ok" if engine_ok else "down"},
        "policy": policy,
        "capture": capture,
    }
    return JSONResponse(body, status_code=200 if engine_ok else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    m = state.metrics
    stats = state.writer.stats
    m.capture_queue.set(stats.queued)
    m.capture_written.set(stats.written)
    m.capture_retries.set(stats.retries)
    m.capture_dead_lettered.set(stats.dead_lettered)
    m.capture_degraded.set(1 if state.writer.degraded else 0)
    try:
        counts = await asyncio.to_thread(training_counts, state.db, state.settings.awaits_judge)
    except sa_exc.DBAPIError as error:
        if not is_transient(error):
            raise
        # The database is down: the gateway's own figures still answer (a monitor needs them most now); the
        # training backlog gauges keep their last values.
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
    m.rollouts_ready.set(counts.rollouts_ready)
    m.rollouts_trained.set(counts.rollouts_trained)
    m.turns_ready.set(counts.turns.ready)
    m.turns_trained.set(counts.turns_trained)
    m.turns_waiting.labels("next_state").set(counts.turns.awaiting_next_state)
    m.turns_waiting.labels("judge").set(counts.turns.awaiting_judge)
    for status in ("running", *turns.FINAL):
        m.judgements.labels(status).set(counts.judgements.get(status, 0))
    if counts.newest is not None and state.service.policy_version is not None:
        m.policy_staleness.set(counts.newest - state.service.policy_version)
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@dataclass(slots=True)
class TrainingCounts:
    rollouts_ready: int  # rollouts of task runs ready for training
    rollouts_trained: int
    turns: turns.Backlog  # turns of everyday traffic: ready, waiting for their next state or the judge
    turns_trained: int
    judgements: dict[str, int]  # reward-worker verdicts by status
    newest: int | None  # the newest published version


def training_counts(db: sa.Engine, await_judge: bool) -> TrainingCounts:
    trained = sa.select(TrainedRollout.rollout_id)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    with Session(db) as session:
        ready = session.scalar(
            sa.select(sa.func.count())
            .select_from(Rollout)
            .where(
                Rollout.status == "completed",
                Rollout.eval.is_(False),
                Rollout.group_key.is_not(None),
                Rollout.id.in_(rewarded),
                Rollout.id.not_in(trained),
            )
        )
        done = session.scalar(sa.select(sa.func.count(sa.distinct(TrainedRollout.rollout_id))))
        turns_done = session.scalar(sa.select(sa.func.count(sa.distinct(TrainedTurn.call_id))))
        verdicts = dict(session.execute(sa.select(Judgement.status, sa.func.count()).group_by(Judgement.status)).all())
        newest = session.scalar(sa.select(sa.func.max(PolicyVersion.version)))
    return TrainingCounts(
        rollouts_ready=int(ready or 0),
        rollouts_trained=int(done or 0),
        turns=turns.backlog(db, 0, await_judge=await_judge),
        turns_trained=int(turns_done or 0),
        judgements={str(k): int(v) for k, v in verdicts.items()},
        newest=newest,
    )
