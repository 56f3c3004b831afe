"""OpenAI-compatible routes: chat completions, completions (``gateway.serving``), and the model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.api.deps import ClientAuth, State
from gateway.api.routing import add_serving_route
from gateway.serving.chat import ChatServing
from gateway.serving.completions import CompletionsServing

router = APIRouter()
add_serving_route(router, "/v1/chat/completions", ChatServing, name="chat_completions")
add_serving_route(router, "/v1/completions", CompletionsServing, name="completions")


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
