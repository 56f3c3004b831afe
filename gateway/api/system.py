"""Operational routes: health and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gateway.api.deps import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    engine_ok = await state.engine.health()
    stats = state.writer.stats
    body: dict[str, Any] = {
        "status": "ok" if engine_ok else "degraded",
        "engine": {"name": state.engine.name, "ok": engine_ok},
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
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
