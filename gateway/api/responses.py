"""OpenAI Responses API route: `POST /v1/responses`.

Thin: ``gateway.serving.responses`` translates the protocol, ``ChatService`` serves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.deps import ClientAuth, RolloutScope, State
from gateway.serving.responses import ResponsesServing

router = APIRouter()


@router.post("/v1/responses", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/responses", dependencies=[ClientAuth])
async def create_response(request: Request, state: State, rollout: RolloutScope) -> Response:
    return await ResponsesServing(state).handle(request, rollout)
