"""Tenant keys over the admin API (``gateway/store/api_keys.py``): create (the key is in the answer, once), list,
revoke; and the quotas of tenants and keys (``gateway/tenants/quotas.py``): set, list with their usage.

The global admin key manages every tenant's keys; a tenant's admin key manages its own tenant's only (another
tenant's key ids read "not found"). A revoked key is refused by every gateway process within
``CLAWGATE_KEY_CACHE_TTL`` seconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import asdict
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import AdminAuth, principal_of
from gateway.errors import BadRequest, Forbidden, NotFound
from gateway.state import State
from gateway.store import api_keys as keys
from gateway.store import quotas as quota_store
from gateway.tenants import quotas as quota_book

router = APIRouter()


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(default=None, max_length=64)
    role: Literal["user", "admin"] = "user"
    name: str | None = Field(default=None, max_length=200)
    expires_at: dt.datetime | None = None
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)


@router.post("/v1/admin/keys", dependencies=[AdminAuth], status_code=201)
async def create_key(body: CreateKey, request: Request, state: State) -> dict[str, Any]:
    principal = principal_of(request)
    tenant = body.tenant or principal.tenant
    if tenant is None:
        raise Forbidden("name the key's tenant", param="tenant", code="missing_tenant")
    if not principal.sees(tenant):
        raise Forbidden("a tenant's admin key creates keys of its own tenant only", param="tenant")
    expires = body.expires_at
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.UTC)
    info, key = await asyncio.to_thread(
        keys.create,
        state.db,
        tenant,
        role=body.role,
        name=body.name,
        expires_at=expires,
        secret=state.settings.key_secret_bytes,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
    )
    return {**info.as_dict(), "key": key}


@router.get("/v1/admin/keys", dependencies=[AdminAuth])
async def list_keys(request: Request, state: State, tenant: str | None = None, revoked: bool = False) -> dict[str, Any]:
    visible, tenant = principal_of(request).listed(tenant)
    if not visible:
        return {"object": "list", "data": []}
    found = await asyncio.to_thread(keys.list_keys, state.db, tenant, revoked=revoked)
    return {"object": "list", "data": [k.as_dict() for k in found]}


@router.post("/v1/admin/keys/{key_id}/revoke", dependencies=[AdminAuth])
async def revoke_key(key_id: str, request: Request, state: State) -> dict[str, Any]:
    info = await asyncio.to_thread(keys.revoke, state.db, key_id, principal_of(request).tenant)
    if state.keys is not None:
        state.keys.forget()  # this process refuses it at once; the others within their cache's TTL
    return info.as_dict()


class SetQuota(BaseModel):
    """Limits of a tenant (``tenant``) or of one key (``key_id``): a number sets one, null removes it, a field left
    out keeps it."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(default=None, max_length=64)
    key_id: str | None = Field(default=None, max_length=32)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)


@router.post("/v1/admin/quotas", dependencies=[AdminAuth])
async def set_quota(body: SetQuota, request: Request, state: State) -> dict[str, Any]:
    """A tenant's quotas are the global admin's to set; a key's, also its own tenant's admin's (within the
    tenant's)."""
    principal = principal_of(request)
    if (body.tenant is None) == (body.key_id is None):
        raise BadRequest("name either a tenant or a key_id", param="tenant")
    given = {
        name: getattr(body, name)
        for name in ("requests_per_minute", "tokens_per_minute")
        if name in body.model_fields_set
    }
    if body.tenant is not None:
        if not principal.is_global:
            raise Forbidden("a tenant's quotas are set with the global admin key", param="tenant", code="admin_only")
        target: dict[str, str] = {"tenant": body.tenant}
    else:
        assert body.key_id is not None
        owner = await asyncio.to_thread(quota_store.key_tenant, state.db, body.key_id)
        if owner is None or not principal.sees(owner):
            raise NotFound(f"api key {body.key_id!r} not found", param="key_id")
        target = {"key_id": body.key_id}
    limits = await asyncio.to_thread(quota_store.set_limits, state.db, **target, **given)
    if state.quotas is not None:
        await state.quotas.sync()  # this process applies it at once; the others within a second
    return {"object": "quota", **target, **asdict(limits)}


@router.get("/v1/admin/quotas", dependencies=[AdminAuth])
async def list_quotas(request: Request, state: State, tenant: str | None = None) -> dict[str, Any]:
    """Every tenant and key with a limit (a tenant admin: its own), with the usage in the last minute."""
    visible, tenant = principal_of(request).listed(tenant)
    if not visible:
        return {"object": "list", "data": []}
    found = await asyncio.to_thread(quota_store.quotas, state.db, tenant)
    now = time.time()
    minute = quota_book.minute_of(now)
    counts = await asyncio.to_thread(quota_store.usage, state.db, [q.subject for q in found], (minute - 1, minute))
    data = []
    for q in found:
        requests, tokens = quota_book.estimate(counts, q.subject, now)
        data.append(
            {
                "object": "quota",
                "tenant": q.tenant,
                "key_id": q.key_id,
                **asdict(q.limits),
                "usage": {"requests": round(requests, 1), "tokens": round(tokens, 1)},
            }
        )
    return {"object": "list", "data": data}
