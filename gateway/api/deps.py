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


async def rollout_ref(request: Request) -> RolloutRef:
    rollout_id = request.path_params.get("rollout_id") or request.headers.get(ROLLOUT_HEADER)
    if rollout_id is not None:
        rollout_id = rollout_id.strip()
        if not rollout_id or len(rollout_id) > ROLLOUT_ID_MAX or not rollout_id.isprintable():
            raise BadRequest("invalid rollout id", param=ROLLOUT_HEADER)
    return RolloutRef(id=rollout_id or None)


ClientAuth = Depends(require_client)
Rollout = Annotated[RolloutRef, Depends(rollout_ref)]
