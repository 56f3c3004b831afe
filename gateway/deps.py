"""Request-scoped dependencies: client authentication and rollout identification (the app state: ``gateway.state``).

All are ``async def``: FastAPI runs plain ``def`` dependencies in a thread pool, and three thread hops per
request cost more CPU than everything else the gateway does for a short call.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.exc import SQLAlchemyError

from gateway.core.job import RolloutRef
from gateway.errors import BadRequest, EngineUnavailable, Forbidden, Unauthorized
from gateway.state import AppState, State
from gateway.store import rollout_lifecycle

log = logging.getLogger("clawgate")

ROLLOUT_HEADER = "x-rollout-id"
ROLLOUT_ID_MAX = 100
# The longest a reward, finish, feedback or read waits for the calls queued before it to be committed; past it
# (the database is down or slow) the request is refused with a 503 and Retry-After rather than left hanging.
STORE_WAIT_S = 10.0
STORE_RETRY_AFTER_S = 5


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _matches_any(key: str, keys: list[str]) -> bool:
    # Compare against every key so the time taken does not reveal which one matched.
    return any([hmac.compare_digest(key.encode(), k.encode()) for k in keys])


async def store_caught_up(state: AppState) -> None:
    """Wait until every call queued so far is in the store; 503 at once while the capture cannot write (the
    writer's circuit breaker is open), or after STORE_WAIT_S."""
    unavailable = EngineUnavailable(
        "the database is unavailable (calls are still served and queued): try again shortly",
        code="store_unavailable",
        retry_after=STORE_RETRY_AFTER_S,
    )
    if state.writer.degraded:
        raise unavailable
    try:
        await asyncio.wait_for(asyncio.shield(state.writer.flush()), STORE_WAIT_S)
    except TimeoutError:
        raise unavailable from None


async def rollout_access(state: AppState, rollout_id: str) -> rollout_lifecycle.Access:
    if rollout_id not in state.rollout_keys:
        state.rollout_keys[rollout_id] = await asyncio.to_thread(rollout_lifecycle.access_of, state.db, rollout_id)
    return state.rollout_keys[rollout_id]


async def _rollout_key_ok(state: AppState, key: str, rollout_id: str | None) -> None:
    """A per-rollout key works only for its own rollout (403 otherwise, without saying whose key it is)."""
    if rollout_id is None:
        raise Forbidden("a rollout key can only be used under its rollout's base_url or with X-Rollout-Id")
    if not rollout_lifecycle.key_matches(key, (await rollout_access(state, rollout_id)).key_hash):
        raise Forbidden(f"this key does not grant access to rollout {rollout_id!r}")


async def _pinned_version(state: AppState, rollout_id: str) -> int | None:
    """The version an explicit rollout is pinned to. Pinned rollouts are created through this API (and cached
    here then); a client-named rollout needs one lookup, which must not make a database outage fail its calls:
    while the store is unreachable it is served unpinned, and the version that serves each call is recorded."""
    try:
        return (await rollout_access(state, rollout_id)).policy_version
    except SQLAlchemyError as exc:
        log.debug("rollout %s: cannot read whether it is pinned (%s); routed as usual", rollout_id, exc)
        return None


def _request_rollout_id(request: Request) -> str | None:
    value = request.path_params.get("rollout_id") or request.headers.get(ROLLOUT_HEADER)
    return value.strip() if value else None


async def require_client(request: Request, state: State) -> None:
    """Serving routes: a client key (CLAWGATE_API_KEYS), or the per-rollout key of the rollout addressed."""
    key = presented_key(request)
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        await _rollout_key_ok(state, key, _request_rollout_id(request))
        return
    keys = state.settings.api_keys
    if keys and (key is None or not _matches_any(key, keys)):
        raise Unauthorized("Invalid or missing API key.", code="invalid_api_key")


def _is_admin(state: AppState, key: str | None) -> bool:
    admin = state.settings.admin_key
    if admin is None:
        return state.settings.environment == "development"
    return key is not None and hmac.compare_digest(key.encode(), admin.get_secret_value().encode())


async def require_admin(request: Request, state: State) -> None:
    key = presented_key(request)
    if _is_admin(state, key):
        return
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        raise Forbidden("a rollout key cannot use this endpoint")
    raise Unauthorized("this endpoint needs the admin key", code="invalid_api_key")


async def authorize_rollout(request: Request, state: AppState, rollout_id: str) -> None:
    """Rollout endpoints: the admin key, or that rollout's own key."""
    key = presented_key(request)
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        await _rollout_key_ok(state, key, rollout_id)
        return
    if not _is_admin(state, key):
        raise Unauthorized("this endpoint needs the admin key or the rollout's key", code="invalid_api_key")


def authorize_raw(request: Request, state: AppState) -> None:
    """Exact token ids of credentials (``?raw=true``): the admin key only, never a rollout's own key."""
    key = presented_key(request)
    if (key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX)) or not _is_admin(state, key):
        raise Forbidden("raw=true (unredacted credentials) needs the admin key", param="raw", code="admin_only")


def _check_id(value: str, where: str) -> str:
    value = value.strip()
    if not value or len(value) > ROLLOUT_ID_MAX or not value.isprintable() or "/" in value:
        raise BadRequest(f"invalid rollout id in {where}", param=where)
    return value


async def rollout_ref(request: Request, state: State) -> RolloutRef:
    """Who a request belongs to: the URL prefix, then `X-Rollout-Id`, then a harness's own session header
    (Claude Code, Codex); with none of them the request is grouped implicitly by conversation. An explicit rollout
    may be pinned to a policy version (read once per rollout and process)."""
    headers = request.headers
    rollout_id: str | None = None
    kind = "explicit"
    if "rollout_id" in request.path_params:
        rollout_id = _check_id(request.path_params["rollout_id"], "path")
    elif ROLLOUT_HEADER in headers:
        rollout_id = _check_id(headers[ROLLOUT_HEADER], ROLLOUT_HEADER)
    else:
        for header, prefix in rollout_lifecycle.SESSION_HEADERS:
            if header in headers:
                rollout_id = prefix + _check_id(headers[header], header)
                kind = "session"
                break
    # Claude Code marks calls made by a sub-agent; their credit from the rollout's reward is unclear.
    agent_id = headers.get("x-claude-code-agent-id")
    pinned = await _pinned_version(state, rollout_id) if rollout_id and kind == "explicit" else None
    return RolloutRef(
        id=rollout_id, is_subagent=agent_id is not None, agent_id=agent_id, kind=kind, policy_version=pinned
    )


ClientAuth = Depends(require_client)
AdminAuth = Depends(require_admin)
# Who a serving request belongs to (not the ORM model ``gateway.store.models.Rollout``).
RolloutScope = Annotated[RolloutRef, Depends(rollout_ref)]
