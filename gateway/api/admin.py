"""Admin data-governance routes: forget rollouts, harness sessions or calls (``gateway/store/forget.py``).

``POST /v1/admin/forget`` takes ``{"rollouts": [...], "sessions": [...], "calls": [...], "tenants": [...]}`` (a
tenant's admin key finds only its own tenant's data: another tenant's ids read as not found) and answers with what it
deleted, table by table, the spool lines it removed (this gateway's own spool directory, and any no running
gateway holds) and the policy versions already trained on that data (they cannot be un-trained). Calls queued on
this gateway are committed first, so a conversation served here a moment ago is forgotten whole, and its stored
Responses-API answers leave this gateway's cache; the export files written on this gateway's host lose those
rollouts. Another gateway process may still hold the conversation's last turns in memory (for
``CLAWGATE_SESSION_CACHE_IDLE`` seconds, its cached answers until evicted): a continuation it serves is recorded as
a new conversation, never attached to the deleted rows.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import AdminAuth, principal_of, store_caught_up
from gateway.errors import BadRequest
from gateway.state import State
from gateway.store import exports, spool
from gateway.store import forget as forgetting

router = APIRouter()

MAX_IDS = 10_000


class ForgetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollouts: list[str] = Field(default_factory=list, max_length=MAX_IDS)
    sessions: list[str] = Field(default_factory=list, max_length=MAX_IDS)
    calls: list[str] = Field(default_factory=list, max_length=MAX_IDS)
    tenants: list[str] = Field(default_factory=list, max_length=100)


@router.post("/v1/admin/forget", dependencies=[AdminAuth])
async def forget(body: ForgetRequest, request: Request, state: State) -> dict[str, Any]:
    if not (body.rollouts or body.sessions or body.calls or body.tenants):
        raise BadRequest("name at least one of rollouts, sessions, calls or tenants to forget", param="rollouts")
    for name in ("rollouts", "sessions", "calls", "tenants"):
        if any(not value.strip() or len(value) > 256 for value in getattr(body, name)):
            raise BadRequest(f"{name} holds an empty id or one longer than 256 characters", param=name)
    within = principal_of(request).tenant
    await store_caught_up(state)
    report = await asyncio.to_thread(
        forgetting.forget,
        state.db,
        rollouts=body.rollouts,
        sessions=body.sessions,
        calls=body.calls,
        tenants=body.tenants,
        within=within,
    )
    state.responses.discard(report.response_ids)
    report.exports = asdict(await asyncio.to_thread(exports.remove_rollouts, state.db, report.affected))
    if within is None:
        ids = forgetting.named_ids(body.rollouts, body.sessions, body.calls) | report.affected
    else:  # a tenant admin: spool lines only of what was found to be its own (never another tenant's pending calls)
        ids = frozenset(report.affected) | {c for c in body.calls if c not in report.not_found}
    own_lines, own_files = await state.writer.clean_spool(ids=ids)
    lines, files, _ = await asyncio.to_thread(spool.clean_all, state.settings.data_dir / "spool", ids=ids)
    report.spool_lines, report.spool_files = own_lines + lines, own_files + files
    return {"object": "forget.report", **report.as_dict()}
