"""Request-scoped dependencies: the app state, client authentication, and rollout identification.

All are ``async def``: FastAPI runs plain ``def`` dependencies in a thread pool, and three thread hops per
request cost more CPU than everything else the gateway does for a short call.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import BadRequest, Unauthorized
from gateway.service import RolloutRef
from gateway.state import AppState

ROLLOUT_HEADER = "x-rollout-id"
ROLLOUT_ID_MAX = 128


async def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.clawgate
    return state


State = Annotated[AppState, Depends(get_state)]


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


async def require_client(request: Request, state: State) -> None:
    keys = state.settings.api_keys
    if not keys:
        return
    key = presented_key(request)
    # Compare against every key so the time taken does not reveal which one matched.
    if key is None or not any([hmac.compare_digest(key.encode(), k.encode()) for k in keys]):
        raise Unauthorized("Invalid or missing API key.", code="invalid_api_key")


# Harness session headers, in priority order after the explicit ones, with the prefix their rollout id gets.
SESSION_HEADERS = (
    ("x-claude-code-session-id", "claude-code-"),
    ("session-id", "codex-"),
    ("thread-id", "codex-"),
)


def _check_id(value: str, where: str) -> str:
    value = value.strip()
    if not value or len(value) > ROLLOUT_ID_MAX or not value.isprintable() or "/" in value:
        raise BadRequest(f"invalid rollout id in {where}", param=where)
    return value


async def rollout_ref(request: Request) -> RolloutRef:
    """Who a request belongs to: the URL prefix, then `X-Rollout-Id`, then a harness's own session header
    (Claude Code, Codex); with none of them the request is grouped implicitly by conversation."""
    headers = request.headers
    rollout_id: str | None = None
    if "rollout_id" in request.path_params:
        rollout_id = _check_id(request.path_params["rollout_id"], "path")
    elif ROLLOUT_HEADER in headers:
        rollout_id = _check_id(headers[ROLLOUT_HEADER], ROLLOUT_HEADER)
    else:
        for header, prefix in SESSION_HEADERS:
            if header in headers:
                rollout_id = prefix + _check_id(headers[header], header)
                break
    # Claude Code marks calls made by a sub-agent; their credit from the rollout's reward is unclear.
    agent_id = headers.get("x-claude-code-agent-id")
    return RolloutRef(id=rollout_id, is_subagent=agent_id is not None, agent_id=agent_id)


ClientAuth = Depends(require_client)
Rollout = Annotated[RolloutRef, Depends(rollout_ref)]
