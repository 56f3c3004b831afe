"""Operational routes: health and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy import exc as sa_exc

from gateway.state import State
from gateway.store import turns
from gateway.store.errors import is_transient
from gateway.store.readiness import training_counts

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
        policy["promotion"] = state.policy.promotion_summary()
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
    m.counterfactuals_judged.set(counts.counterfactuals_judged)
    if counts.newest is not None and state.service.policy_version is not None:
        m.policy_staleness.set(counts.newest - state.service.policy_version)
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
