"""Anthropic Messages API routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Thin: ``gateway.serving.messages`` translates the protocol, ``ChatService`` serves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.deps import ClientAuth, RolloutScope, State
from gateway.serving.messages import MessagesServing

router = APIRouter()


@router.post("/v1/messages", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/messages", dependencies=[ClientAuth])
async def create_message(request: Request, state: State, rollout: RolloutScope) -> Response:
    return await MessagesServing(state).handle(request, rollout)


@router.post("/v1/messages/count_tokens", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/messages/count_tokens", dependencies=[ClientAuth])
async def count_tokens(request: Request, state: State) -> dict[str, int]:
    """The prompt length the same conversation would have in a fresh ``/v1/messages`` call."""
    return await MessagesServing(state).count_tokens(request)
