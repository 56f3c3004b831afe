"""How a protocol's serving class becomes routes: one POST handler, at the API's own path and under a rollout's
base URL (``/rollouts/{rollout_id}/…``), authenticated as a client and documented with its response model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from gateway.api.deps import ClientAuth, RolloutScope, State
from gateway.protocol.base import ErrorResponse
from gateway.serving.base import ProtocolServing

ROLLOUT_PREFIX = "/rollouts/{rollout_id}"
# The statuses a serving route answers with an error body (see gateway/errors.py).
ERROR_STATUSES = (400, 401, 403, 404, 429, 502, 503, 504)


def documented_responses(error_model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a serving route besides its JSON body: the event stream, and the errors."""
    stream = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: stream, **{status: {"model": error_model} for status in ERROR_STATUSES}}


def add_serving_route(
    router: APIRouter,
    path: str,
    serving: type[ProtocolServing[Any]],
    response_model: type[BaseModel],
    *,
    name: str,
    error_model: type[BaseModel] = ErrorResponse,
) -> None:
    """The body is ``response_model``, or with ``stream: true`` Server-Sent Events; errors are ``error_model``."""
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
            responses=documented_responses(error_model),
            name=name if not prefix else f"{name}_in_rollout",
        )
