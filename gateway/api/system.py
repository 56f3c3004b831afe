"""Operational routes: health and Prometheus metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session

from gateway.api.deps import State
from gateway.store import turns
from gateway.store.models import Judgement, PolicyVersion, Reward, Rollout, TrainedRollout, TrainedTurn

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    engine_ok = await state.engine.health()
    stats = state.writer.stats
    body: dict[str, Any] = {
        "status": "ok" if engine_ok else "degraded",
        "engine": {"name": state.engine.name, "ok": engine_ok},
        "policy": {"adapter": state.service.adapter, "version": state.service.policy_version},
        "capture": {
            "queued": stats.queued,
            "written": stats.written,
            "retries": stats.retries,
            "last_error": stats.last_error,
        },
    }
    return JSONResponse(body, status_code=200 if engine_ok else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    m = state.metrics
    stats = state.writer.stats
    m.capture_queue.set(stats.queued)
    m.capture_written.set(stats.written)
    m.capture_retries.set(stats.retries)
    counts = await asyncio.to_thread(training_counts, state.db, state.settings.awaits_judge)
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
