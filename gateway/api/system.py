"""Operational routes: health and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session

from gateway.api.deps import State
from gateway.store.models import PolicyVersion, Reward, Rollout, TrainedRollout

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
    ready, trained, newest = await asyncio.to_thread(training_counts, state.db)
    m.rollouts_ready.set(ready)
    m.rollouts_trained.set(trained)
    if newest is not None and state.service.policy_version is not None:
        m.policy_staleness.set(newest - state.service.policy_version)
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def training_counts(db: sa.Engine) -> tuple[int, int, int | None]:
    """(rollouts ready for training, rollouts trained on, newest published version)."""
    trained = sa.select(TrainedRollout.rollout_id)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    with Session(db) as session:
        ready = session.scalar(
            sa.select(sa.func.count())
            .select_from(Rollout)
            .where(
                Rollout.status == "completed",
                Rollout.eval.is_(False),
                Rollout.id.in_(rewarded),
                Rollout.id.not_in(trained),
            )
        )
        done = session.scalar(sa.select(sa.func.count(sa.distinct(TrainedRollout.rollout_id))))
        newest = session.scalar(sa.select(sa.func.max(PolicyVersion.version)))
    return int(ready or 0), int(done or 0), newest
