"""Anthropic Messages API routes (``serving.py`` beside it does the work): messages and token counting."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import ClientAuth
from gateway.protocols.anthropic.serving import MessagesServing
from gateway.protocols.anthropic.wire import AnthropicError, MessageResponse, TokenCount
from gateway.protocols.common.routes import ROLLOUT_PREFIX, add_serving_route
from gateway.state import State

router = APIRouter()
# Errors on these paths take the Messages API's shape (see app.is_anthropic_path).
add_serving_route(
    router, "/v1/messages", MessagesServing, MessageResponse, name="create_message", error_model=AnthropicError
)


@router.post("/v1/messages/count_tokens", dependencies=[ClientAuth])
@router.post(ROLLOUT_PREFIX + "/v1/messages/count_tokens", dependencies=[ClientAuth])
async def count_tokens(request: Request, state: State) -> TokenCount:
    """The prompt length the same conversation would have in a fresh ``/v1/messages`` call."""
    return await MessagesServing(state).count_tokens(request)
