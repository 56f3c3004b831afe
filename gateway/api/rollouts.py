"""Rollout lifecycle routes: create, reward, finish, list, inspect; per-call feedback.

Keys: creating and listing rollouts and posting feedback need an admin key; a rollout's own key (returned once,
at creation) can serve calls under its ``base_url``, post its reward, finish it and read it — and nothing else.
A tenant's admin key works on its own tenant's rollouts and calls only: another tenant's ids read "not found".
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from fastapi import APIRouter, Query, Request

from gateway.api.rollouts_wire import CreateRollout, FinishRollout, PostFeedback, PostReward
from gateway.deps import (
    AdminAuth,
    authorize_raw,
    authorize_rollout,
    is_global_admin,
    principal_of,
    rollout_tenant,
    store_caught_up,
)
from gateway.errors import BadRequest, Conflict, Forbidden, NotFound
from gateway.state import State
from gateway.store import console, rollout_lifecycle
from gateway.store.api_keys import check_tenant_name
from gateway.store.training_data import load_rollout
from prefix_tree import TreeConfig

router = APIRouter()


@router.post("/v1/rollouts", dependencies=[AdminAuth], status_code=201)
async def create_rollout(body: CreateRollout, request: Request, state: State) -> dict[str, Any]:
    principal = principal_of(request)
    tenant = body.tenant or principal.serving_tenant
    if not principal.sees(tenant):
        raise Forbidden("a tenant's admin key creates rollouts of its own tenant only", param="tenant")
    try:
        check_tenant_name(tenant)
    except ValueError as exc:
        raise BadRequest(str(exc), param="tenant") from None
    try:
        rollout, key = await asyncio.to_thread(
            rollout_lifecycle.create,
            state.db,
            task_id=body.task_id,
            harness=body.harness,
            group=body.group,
            metadata=body.metadata,
            eval=body.eval,
            policy_version=body.policy_version,
            tenant=tenant,
        )
    except rollout_lifecycle.VersionNotServable as exc:
        error = NotFound if exc.stage is None else Conflict
        raise error(str(exc), param="policy_version") from None
    state.rollout_keys[rollout.id] = rollout_lifecycle.Access(rollout.api_key_hash, rollout.policy_version, tenant)
    base = str(request.base_url).rstrip("/")
    return {**rollout_lifecycle.summary(rollout), "api_key": key, "base_url": f"{base}/rollouts/{rollout.id}/v1"}


@router.post("/v1/rollouts/{rollout_id}/reward", status_code=201)
async def post_reward(rollout_id: str, body: PostReward, request: Request, state: State) -> dict[str, Any]:
    await authorize_rollout(request, state, rollout_id)
    await store_caught_up(state)  # the rollout row may still be in the capture queue
    reward = await asyncio.to_thread(
        rollout_lifecycle.add_reward, state.db, rollout_id, body.value, source=body.source, details=body.details
    )
    return rollout_lifecycle.reward_dict(reward)


@router.post("/v1/rollouts/{rollout_id}/finish")
async def finish_rollout(rollout_id: str, request: Request, state: State) -> dict[str, Any]:
    await authorize_rollout(request, state, rollout_id)
    raw = await request.body()
    body = FinishRollout.model_validate_json(raw) if raw.strip() else FinishRollout()
    # Every call served so far must be in the store before the rollout is marked ready for training.
    await store_caught_up(state)
    rollout = await asyncio.to_thread(rollout_lifecycle.finish, state.db, rollout_id, body.status, body.reason)
    return rollout_lifecycle.summary(rollout)


@router.get("/v1/rollouts", dependencies=[AdminAuth])
async def list_rollouts(
    request: Request,
    state: State,
    task_id: str | None = None,
    harness: str | None = None,
    status: str | None = None,
    group: str | None = None,
    policy_version: int | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    eval: bool | None = None,
    limit: int = Query(default=50, ge=1, le=500),
    cursor: str | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Rollouts, newest first; a tenant admin's list holds its tenant's only (``tenant`` filters the global
    admin's)."""
    principal = principal_of(request)
    visible, tenant = principal.listed(tenant)
    if not visible:
        return {"object": "list", "data": [], "next_cursor": None}
    f = rollout_lifecycle.RolloutFilter(task_id, harness, status, group, policy_version, since, until, eval, tenant)
    rows, next_cursor = await asyncio.to_thread(
        rollout_lifecycle.list_rollouts, state.db, f, limit=limit, cursor=cursor
    )
    stats = await asyncio.to_thread(console.rollout_stats, state.db, [r.id for r in rows])
    data = []
    for r in rows:
        s = stats[r.id]
        data.append(
            {
                **rollout_lifecycle.summary(r),
                "reward": s.reward,
                "calls": s.calls,
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "policy_versions": s.versions,
            }
        )
    return {"object": "list", "data": data, "next_cursor": next_cursor}


@router.get("/v1/rollouts/{rollout_id}")
async def get_rollout(
    rollout_id: str, request: Request, state: State, tokens: bool = True, raw: bool = False
) -> dict[str, Any]:
    """The rollout's calls and rewards; the token ids of credentials read -1 unless ``raw`` (admin key only).

    Read with the global admin key, each call also carries its ``counterfactual_group`` (the siblings drawn for it,
    None when none were): siblings are never shown to a client, so a tenant's or the rollout's own key reads the
    calls without that field."""
    await authorize_rollout(request, state, rollout_id)
    if raw:
        authorize_raw(request, state)
    siblings = is_global_admin(request, state)
    await store_caught_up(state)
    return await asyncio.to_thread(
        rollout_lifecycle.detail, state.db, rollout_id, with_tokens=tokens, raw=raw, counterfactuals=siblings
    )


@router.get("/v1/rollouts/{rollout_id}/tree")
async def get_tree(
    rollout_id: str, request: Request, state: State, tokens: bool = False, raw: bool = False
) -> dict[str, Any]:
    """The rollout's reconstructed prefix tree: edges with token counts, filtered branches and why, figures (with
    ``tokens``, credentials' ids read -1 unless ``raw``, admin key only)."""
    await authorize_rollout(request, state, rollout_id)
    if raw:
        authorize_raw(request, state)
    await store_caught_up(state)
    config = TreeConfig(secrets=state.settings.secrets)
    data = await asyncio.to_thread(load_rollout, state.db, rollout_id, config, redact=tokens and not raw)
    if data is None:
        raise NotFound(f"rollout {rollout_id!r} not found", param="rollout_id")
    return {"rollout_id": rollout_id, "reward": data.reward, **data.tree.to_json(include_tokens=tokens)}


@router.post("/v1/feedback", dependencies=[AdminAuth], status_code=201)
async def post_feedback(body: PostFeedback, request: Request, state: State) -> dict[str, Any]:
    principal = principal_of(request)
    await store_caught_up(state)
    if body.call_id is not None:
        targets = [(body.call_id, await asyncio.to_thread(rollout_lifecycle.call_rollout, state.db, body.call_id))]
    else:
        assert body.response_id is not None
        targets = await asyncio.to_thread(rollout_lifecycle.calls_of_request, state.db, body.response_id)
    if principal.tenant is not None:  # another tenant's calls read as unknown ones
        targets = [(c, r) for c, r in targets if await rollout_tenant(state, r) == principal.tenant]
        if not targets and body.call_id is not None:
            raise NotFound(f"call {body.call_id!r} not found", param="call_id")
    if not targets:
        raise NotFound(f"no calls for response {body.response_id!r}", param="response_id")
    rewards = []
    for call_id, rollout_id in targets:
        reward = await asyncio.to_thread(
            rollout_lifecycle.add_reward,
            state.db,
            rollout_id,
            body.value,
            source=body.source or "feedback",
            details=body.details,
            call_id=call_id,
        )
        rewards.append(rollout_lifecycle.reward_dict(reward))
    return {"object": "list", "data": rewards}
