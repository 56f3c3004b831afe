"""Policy-control routes (admin key): which version serves, pin one, unpin, roll back, promote or reject a candidate.

``GET /v1/policy`` lists the versions (each with its lineage: ``""`` the shared policy, else the tenant whose own
policy it is) and says what this gateway serves, what is pinned and which rollback the trainer has yet to carry
out, for the shared policy and (``lineages``) each tenant's own. A change takes ``tenant`` to act on a tenant's own
policy; a version names its lineage by itself. Pin and rollback take effect on every gateway at its next policy poll
(``CLAWGATE_POLICY_POLL_INTERVAL``); this gateway looks at once, so its answer already shows the change.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from gateway.api.policy_wire import LineageChoice, OptionalVersion, VersionChoice
from gateway.deps import GlobalAdminAuth
from gateway.errors import BadRequest, Conflict, NotFound
from gateway.policy import apply_change, lineage_for
from gateway.promotion.promoter import rule_of
from gateway.promotion.status import status
from gateway.state import AppState, State
from gateway.store import console, policy_control, promotion

router = APIRouter()


async def describe_policy(state: AppState) -> dict[str, Any]:
    control, versions, pins = await asyncio.gather(
        asyncio.to_thread(policy_control.read, state.db),
        asyncio.to_thread(console.versions, state.db),
        asyncio.to_thread(policy_control.pins, state.db),
    )
    follower = state.policy
    lineages: dict[str, Any] = {}
    for tenant, routing in state.service.lineage_routing.items():
        lineages[tenant] = {"served": {"adapter": routing.incumbent.adapter, "version": routing.incumbent.version}}
    if follower is not None:
        for tenant in follower.lineages:
            lineages.setdefault(tenant, {"served": None})
        for tenant, reason in follower.refused.items():
            lineages.setdefault(tenant, {"served": None})["refused"] = reason
    for tenant, entry in lineages.items():
        entry["pinned_version"] = pins.get(tenant)
    routing = state.service.routing
    rule = rule_of(state.settings)
    promo = await asyncio.to_thread(status, state.db, rule)
    return {
        "object": "policy",
        "served": {"adapter": state.service.adapter, "version": state.service.policy_version},
        "canary": None
        if routing.candidate is None
        else {"adapter": routing.candidate.adapter, "version": routing.candidate.version, "share": routing.share},
        "promotion": promo,
        "pinned_version": control.pinned_version,
        "rollback_to": control.rollback_to,
        "lineages": lineages,
        "versions": [
            {
                "version": v.version,
                "lineage": v.lineage,
                "adapter": v.adapter_name,
                "status": v.status,
                "stage": v.stage,
                "current": v.is_current,
                "parent_version": v.parent_version,
                "rolled_back_from": v.rolled_back_from,
                "created_at": v.created_at.isoformat(),
                "current_at": v.current_at.isoformat() if v.current_at else None,
                "metrics": v.metrics,
            }
            for v in versions
        ],
    }


async def apply(
    state: AppState, change: Any, *args: Any, tenant: str | None = None, version: int | None = None
) -> dict[str, Any]:
    """Write the change (in the lineage of ``tenant``, else of ``version``), let this gateway's follower act on it
    now, and describe the result."""
    try:
        lineage = await asyncio.to_thread(lineage_for, state.db, tenant, version)
    except ValueError as exc:
        raise BadRequest(str(exc), param="tenant") from None
    try:
        await apply_change(state.db, state.policy, change, *args, lineage)
    except policy_control.UnknownVersion as exc:
        raise NotFound(str(exc), param="version") from None
    except promotion.NotDecidable as exc:
        raise Conflict(str(exc), param="version") from None
    return await describe_policy(state)


@router.get("/v1/policy", dependencies=[GlobalAdminAuth])
async def get_policy(state: State) -> dict[str, Any]:
    return await describe_policy(state)


@router.post("/v1/policy/pin", dependencies=[GlobalAdminAuth])
async def pin(body: VersionChoice, state: State) -> dict[str, Any]:
    """Serve ``version`` on every gateway until unpinned (the trainer may go on publishing meanwhile)."""
    return await apply(state, policy_control.pin, body.version, tenant=body.tenant, version=body.version)


@router.post("/v1/policy/unpin", dependencies=[GlobalAdminAuth])
async def unpin(state: State, body: LineageChoice | None = None) -> dict[str, Any]:
    """Serve the newest version again (withdraws a rollback the trainer has not carried out yet)."""
    return await apply(state, policy_control.unpin, tenant=body.tenant if body is not None else None)


@router.post("/v1/policy/rollback", dependencies=[GlobalAdminAuth])
async def rollback(body: VersionChoice, state: State) -> dict[str, Any]:
    """Serve ``version`` now and have the trainer continue from it: it republishes that version's weights as a new
    version and trains on from there."""
    return await apply(state, policy_control.request_rollback, body.version, tenant=body.tenant, version=body.version)


@router.post("/v1/policy/promote", dependencies=[GlobalAdminAuth])
async def promote(body: OptionalVersion, state: State) -> dict[str, Any]:
    """Promote a candidate or canary now (default: the undecided one): it becomes the incumbent."""
    return await decide(state, "promote", body)


@router.post("/v1/policy/reject", dependencies=[GlobalAdminAuth])
async def reject(body: OptionalVersion, state: State) -> dict[str, Any]:
    """Reject a candidate or canary now (default: the undecided one): the incumbent serves everything again and the
    trainer goes on from the incumbent's weights."""
    return await decide(state, "reject", body)


async def decide(state: AppState, outcome: str, body: OptionalVersion) -> dict[str, Any]:
    version = body.version
    return await apply(
        state, promotion.decide_by_operator, outcome, version, "operator", tenant=body.tenant, version=version
    )
