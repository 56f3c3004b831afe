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
from gateway.errors import BadRequest, EngineUnavailable, Forbidden, NotFound, RateLimited, Unauthorized
from gateway.state import AppState, State
from gateway.store import api_keys as tenant_keys
from gateway.store import rollout_lifecycle
from gateway.tenants.cache import KeysUnavailable
from gateway.tenants.principal import DEFAULT_TENANT, DEFAULT_USER, GLOBAL_ADMIN, Principal

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


async def rollout_tenant(state: AppState, rollout_id: str) -> str | None:
    """The tenant of a rollout, None if it does not exist. One this process has not seen is read again after the
    capture queue is written (it may have been created by a call just served, or by another process)."""
    access = await rollout_access(state, rollout_id)
    if access.tenant is None:
        await store_caught_up(state)
        access = await asyncio.to_thread(rollout_lifecycle.access_of, state.db, rollout_id)
        if access.tenant is not None:
            state.rollout_keys[rollout_id] = access
    return access.tenant


async def _rollout_key_ok(state: AppState, key: str, rollout_id: str | None) -> Principal:
    """A per-rollout key works only for its own rollout (403 otherwise, without saying whose key it is)."""
    if rollout_id is None:
        raise Forbidden("a rollout key can only be used under its rollout's base_url or with X-Rollout-Id")
    access = await rollout_access(state, rollout_id)
    if not rollout_lifecycle.key_matches(key, access.key_hash):
        raise Forbidden(f"this key does not grant access to rollout {rollout_id!r}")
    return Principal(tenant=access.tenant or DEFAULT_TENANT, role="rollout", rollout_id=rollout_id)


async def _tenant_key(state: AppState, key: str) -> Principal:
    """A tenant key from the database (through this process's short-lived cache): 401 unless valid now."""
    assert state.keys is not None
    try:
        info = await state.keys.check(key)
    except KeysUnavailable:
        raise EngineUnavailable(
            "the database is unavailable and this key has not been checked lately: try again shortly",
            code="store_unavailable",
            retry_after=STORE_RETRY_AFTER_S,
        ) from None
    if info is None:
        raise Unauthorized("Invalid, expired or revoked API key.", code="invalid_api_key")
    return Principal(tenant=info.tenant, role="admin" if info.role == "admin" else "user", key_id=info.id)


async def _claim_rollout(state: AppState, rollout_id: str, tenant: str) -> int | None:
    """A rollout named by a serving request (explicit or a harness session): another tenant's reads "not found"
    (its existence is not revealed); one that does not exist yet is this tenant's from now on, on this process
    (its first call creates it). Returns the version it is pinned to. While the database is unreachable the
    request is served, as a pinned rollout's calls are (the rollout's tenant cannot be read then)."""
    try:
        access = await rollout_access(state, rollout_id)
    except SQLAlchemyError as exc:
        log.debug("rollout %s: cannot read its tenant or pin (%s); routed as usual", rollout_id, exc)
        return None
    if access.tenant is None:
        state.rollout_keys[rollout_id] = rollout_lifecycle.Access(access.key_hash, access.policy_version, tenant)
    elif access.tenant != tenant:
        raise NotFound(f"rollout {rollout_id!r} not found", param="rollout_id", code="rollout_not_found")
    return access.policy_version


def _request_rollout_id(request: Request) -> str | None:
    value = request.path_params.get("rollout_id") or request.headers.get(ROLLOUT_HEADER)
    return value.strip() if value else None


async def require_client(request: Request, state: State) -> None:
    """Serving routes: a client key (CLAWGATE_API_KEYS: the default tenant), a tenant's key from the database, or
    the per-rollout key of the rollout addressed. Who it is goes on ``request.state.principal``."""
    key = presented_key(request)
    principal = DEFAULT_USER
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        principal = await _rollout_key_ok(state, key, _request_rollout_id(request))
    elif key is not None and key.startswith(tenant_keys.PREFIX):
        principal = await _tenant_key(state, key)
    else:
        keys = state.settings.api_keys
        if keys and (key is None or not _matches_any(key, keys)):
            raise Unauthorized("Invalid or missing API key.", code="invalid_api_key")
    request.state.principal = principal


def _is_admin(state: AppState, key: str | None) -> bool:
    admin = state.settings.admin_key
    if admin is None:
        return state.settings.environment == "development"
    return key is not None and hmac.compare_digest(key.encode(), admin.get_secret_value().encode())


async def admin_principal(request: Request, state: AppState) -> Principal:
    """The global admin key, or a tenant's admin key (which sees only its tenant); 401/403 otherwise."""
    key = presented_key(request)
    if key is not None and key.startswith(tenant_keys.PREFIX):
        principal = await _tenant_key(state, key)
        if not principal.is_admin:
            raise Forbidden("this endpoint needs an admin key; this is a tenant's user key", code="admin_only")
        return principal
    if _is_admin(state, key):
        return GLOBAL_ADMIN
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        raise Forbidden("a rollout key cannot use this endpoint")
    raise Unauthorized("this endpoint needs the admin key", code="invalid_api_key")


async def require_admin(request: Request, state: State) -> None:
    """Admin routes that see tenants' data: the global admin, or a tenant admin limited to its tenant (the route
    reads ``request.state.principal`` and answers 404 for another tenant's records)."""
    request.state.principal = await admin_principal(request, state)


async def require_global_admin(request: Request, state: State) -> None:
    """Routes that act on what all tenants share (the policy, the API docs): the global admin key only."""
    principal = await admin_principal(request, state)
    if not principal.is_global:
        raise Forbidden("this endpoint needs the global admin key (CLAWGATE_ADMIN_KEY)", code="admin_only")
    request.state.principal = principal


def principal_of(request: Request) -> Principal:
    """Who the request is, as set by its route's auth dependency."""
    principal: Principal = request.state.principal
    return principal


async def authorize_rollout(request: Request, state: AppState, rollout_id: str) -> Principal:
    """Rollout endpoints: the admin key (a tenant admin: its own tenant's rollouts; another's read "not found"),
    or that rollout's own key."""
    key = presented_key(request)
    if key is not None and key.startswith(rollout_lifecycle.ROLLOUT_KEY_PREFIX):
        principal = await _rollout_key_ok(state, key, rollout_id)
    else:
        try:
            principal = await admin_principal(request, state)
        except Unauthorized:
            raise Unauthorized(
                "this endpoint needs the admin key or the rollout's key", code="invalid_api_key"
            ) from None
        if not principal.is_global and await rollout_tenant(state, rollout_id) != principal.tenant:
            raise NotFound(f"rollout {rollout_id!r} not found", param="rollout_id", code="rollout_not_found")
    request.state.principal = principal
    return principal


def is_global_admin(request: Request, state: AppState) -> bool:
    """Whether the request carries the global admin key, never a tenant's or a rollout's (what only the operator may
    read: credentials' exact ids, counterfactual siblings)."""
    key = presented_key(request)
    if key is not None and key.startswith((rollout_lifecycle.ROLLOUT_KEY_PREFIX, tenant_keys.PREFIX)):
        return False
    return _is_admin(state, key)


def authorize_raw(request: Request, state: AppState) -> None:
    """Exact token ids of credentials (``?raw=true``): the global admin key only, never a tenant's or a rollout's."""
    if not is_global_admin(request, state):
        raise Forbidden("raw=true (unredacted credentials) needs the global admin key", param="raw", code="admin_only")


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
    principal = principal_of(request)
    tenant = principal.serving_tenant
    try:
        meter = state.quotas.admit(principal) if state.quotas is not None else None
    except RateLimited:
        state.metrics.refused.labels("quota").inc()
        raise
    pinned = None
    if rollout_id is not None:
        pinned = await _claim_rollout(state, rollout_id, tenant)
        if kind != "explicit":
            pinned = None  # a harness session is never pinned
    return RolloutRef(
        id=rollout_id,
        is_subagent=agent_id is not None,
        agent_id=agent_id,
        kind=kind,
        policy_version=pinned,
        tenant=tenant,
        usage=meter,
    )


ClientAuth = Depends(require_client)
AdminAuth = Depends(require_admin)
GlobalAdminAuth = Depends(require_global_admin)
# Who a serving request belongs to (not the ORM model ``gateway.store.models.Rollout``).
RolloutScope = Annotated[RolloutRef, Depends(rollout_ref)]
