"""Tenant keys over the admin API (``gateway/store/api_keys.py``): create (the key is in the answer, once), list,
revoke.

The global admin key manages every tenant's keys; a tenant's admin key manages its own tenant's only (another
tenant's key ids read "not found"). A revoked key is refused by every gateway process within
``CLAWGATE_KEY_CACHE_TTL`` seconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import AdminAuth, principal_of
from gateway.errors import Forbidden
from gateway.state import State
from gateway.store import api_keys as keys

router = APIRouter()


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(default=None, max_length=64)
    role: Literal["user", "admin"] = "user"
    name: str | None = Field(default=None, max_length=200)
    expires_at: dt.datetime | None = None


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
    )
    return {**info.as_dict(), "key": key}


@router.get("/v1/admin/keys", dependencies=[AdminAuth])
async def list_keys(request: Request, state: State, tenant: str | None = None, revoked: bool = False) -> dict[str, Any]:
    principal = principal_of(request)
    if principal.tenant is not None:
        if tenant is not None and tenant != principal.tenant:
            return {"object": "list", "data": []}
        tenant = principal.tenant
    found = await asyncio.to_thread(keys.list_keys, state.db, tenant, revoked=revoked)
    return {"object": "list", "data": [k.as_dict() for k in found]}


@router.post("/v1/admin/keys/{key_id}/revoke", dependencies=[AdminAuth])
async def revoke_key(key_id: str, request: Request, state: State) -> dict[str, Any]:
    info = await asyncio.to_thread(keys.revoke, state.db, key_id, principal_of(request).tenant)
    if state.keys is not None:
        state.keys.forget()  # this process refuses it at once; the others within their cache's TTL
    return info.as_dict()
