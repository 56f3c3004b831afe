"""OpenAI-compatible routes: chat completions and completions (``chat.py``, ``completions.py``), the model list."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import ClientAuth
from gateway.protocols.common.routes import ROLLOUT_PREFIX, add_serving_route
from gateway.protocols.openai.chat import ChatServing
from gateway.protocols.openai.completions import CompletionsServing
from gateway.protocols.openai.wire import ChatCompletion, Completion, ModelCard, ModelList
from gateway.state import State

router = APIRouter()
add_serving_route(router, "/v1/chat/completions", ChatServing, ChatCompletion, name="chat_completions")
add_serving_route(router, "/v1/completions", CompletionsServing, Completion, name="completions")


@router.get("/v1/models", dependencies=[ClientAuth])
@router.get(ROLLOUT_PREFIX + "/v1/models", dependencies=[ClientAuth])
async def list_models(state: State) -> ModelList:
    created = int(state.started_at)
    max_len = state.engine.max_model_len
    return ModelList(data=[ModelCard(id=n, created=created, max_model_len=max_len) for n in sorted(state.model_names)])


@router.get("/v1/models/{model_id:path}", dependencies=[ClientAuth])
async def get_model(model_id: str, state: State) -> ModelCard:
    state.check_model(model_id)
    return ModelCard(id=model_id, created=int(state.started_at))
