"""How a protocol's serving class becomes routes: one POST handler, at the API's own path and under a rollout's
base URL (``/rollouts/{rollout_id}/…``), authenticated as a client and documented with its response model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.deps import ClientAuth, RolloutScope, State
from gateway.serving.base import ProtocolServing

ROLLOUT_PREFIX = "/rollouts/{rollout_id}"


def add_serving_route(
    router: APIRouter,
    path: str,
    serving: type[ProtocolServing[Any]],
    *,
    name: str,
    response_model: Any = None,
    summary: str | None = None,
) -> None:
    async def route(request: Request, state: State, rollout: RolloutScope) -> Response:
        return await serving(state).handle(request, rollout)

    route.__name__ = name
    for prefix in ("", ROLLOUT_PREFIX):
        router.add_api_route(
            prefix + path,
            route,
            methods=["POST"],
            dependencies=[ClientAuth],
            response_model=response_model,
            summary=summary,
            name=name if not prefix else f"{name}_in_rollout",
        )
