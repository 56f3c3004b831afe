"""OpenAI-compatible routes: chat completions, completions, models.

The routes only translate HTTP to a handler: ``gateway.serving.chat`` and ``gateway.serving.completions`` do the
protocol work, ``ChatService`` the serving.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.deps import ClientAuth, RolloutScope, State
from gateway.serving.chat import ChatServing
from gateway.serving.completions import CompletionsServing

router = APIRouter()


@router.post("/v1/chat/completions", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/chat/completions", dependencies=[ClientAuth])
async def chat_completions(request: Request, state: State, rollout: RolloutScope) -> Response:
    return await ChatServing(state).handle(request, rollout)


@router.post("/v1/completions", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/completions", dependencies=[ClientAuth])
async def completions(request: Request, state: State, rollout: RolloutScope) -> Response:
    return await CompletionsServing(state).handle(request, rollout)


@router.get("/v1/models", dependencies=[ClientAuth])
@router.get("/rollouts/{rollout_id}/v1/models", dependencies=[ClientAuth])
async def list_models(state: State) -> dict[str, Any]:
    created = int(state.started_at)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "clawgate",
            "max_model_len": state.engine.max_model_len,
        }
        for name in sorted(state.model_names)
    ]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}", dependencies=[ClientAuth])
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    state.check_model(model_id)
    return {"id": model_id, "object": "model", "created": int(state.started_at), "owned_by": "clawgate"}
