"""The operator console at ``/dashboard``: server-rendered pages over the store, behind the admin key.

Pages: overview (what serves, traffic, capture, backlog, the trainer's last step), rewards per policy version and
per task × harness, train-step charts, a filterable rollout table, one rollout in full (``rollout_page.py``: decoded
prompts and completions, per-token logprobs, rewards with their reasons, each turn's counterfactual siblings with
their scores, the prefix tree with what was filtered and why), and the policy versions with their promotion stages
(a running canary's arms and verdict, the decisions so far). Every query runs on a thread; the pages are plain HTML
with inline SVG charts and no script, so they work offline. Login: a form takes the admin key once and sets a
signed, HttpOnly session cookie (``auth.py``); without an admin key (development only) the console is open, like
the admin API.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hmac
import math
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.exc import SQLAlchemyError

from gateway.dashboard import auth, charts, rollout_page
from gateway.errors import NotFound
from gateway.policy import apply_change, lineage_for
from gateway.promotion.promoter import rule_of
from gateway.promotion.status import status as promotion_status
from gateway.state import AppState, State
from gateway.store import api_keys, console, policy_control, promotion
from gateway.store.errors import RecordNotFound
from gateway.store.readiness import training_counts
from gateway.tenants.cache import KeysUnavailable
from gateway.tenants.principal import GLOBAL_ADMIN, Principal

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50
STEP_CHARTS = (  # (metric, label); the clip fraction, tokens/s and seconds are derived below
    ("loss", "loss"),
    ("reward_mean", "reward mean (rollouts)"),
    ("turn_reward_mean", "reward mean (turns)"),
    ("approx_kl", "KL (to the sampling policy)"),
    ("entropy", "entropy"),
    ("clip_frac", "clip fraction"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
    ("seconds", "step seconds"),
)


@functools.cache
def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gateway.dashboard", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
    )
    env.filters["ago"] = _ago
    env.filters["num"] = _num
    env.globals["logprob_colour"] = charts.logprob_colour
    return env


def _ago(when: dt.datetime | None) -> str:
    if when is None:
        return "—"
    seconds = (dt.datetime.now(dt.UTC) - when).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def render(state: AppState, name: str, *, tenant: str | None = None, **context: Any) -> HTMLResponse:
    """A page; ``tenant``: a tenant admin's view (its navigation holds its rollouts only)."""
    body = (
        templates()
        .get_template(name)
        .render(served_model=state.settings.model_name, policy=_policy(state), tenant=tenant, **context)
    )
    return HTMLResponse(body, headers={"Cache-Control": "no-store"})


def _policy(state: AppState) -> dict[str, Any]:
    return {"adapter": state.service.adapter, "version": state.service.policy_version}


def _admin_key(state: AppState) -> str | None:
    key = state.settings.admin_key
    return key.get_secret_value() if key is not None else None


async def viewer(request: Request, state: AppState) -> Principal | None:
    """Who is signed in: the global admin, a tenant's admin (while its key stays valid), or None."""
    key = _admin_key(state)
    if key is None:  # no admin key: only development gets here (production refuses to start without one)
        return GLOBAL_ADMIN if state.settings.environment == "development" else None
    who = auth.session(key, request.cookies.get(auth.COOKIE))
    if not who:
        return GLOBAL_ADMIN if who == "" else None
    try:
        info = await asyncio.to_thread(api_keys.valid_by_id, state.db, who)
    except SQLAlchemyError:
        return None
    if info is None or info.role != "admin":
        return None
    return Principal(tenant=info.tenant, role="admin", key_id=info.id)


def _global_only(request: Request, state: AppState) -> Response:
    """A tenant admin on a page of what all tenants share: its rollouts are what it may see."""
    who = "a tenant's admin key: it sees its tenant's rollouts"
    page = render(state, "missing.html", tenant="-", title="Not for a tenant", what=f"such page for {who}")
    page.status_code = 403
    return page


def _to_login(request: Request) -> RedirectResponse:
    return RedirectResponse("/dashboard/login?" + urlencode({"next": request.url.path}), status_code=303)


def _safe_next(value: str | None) -> str:
    # Only a console path: never an absolute URL or a scheme-relative one (an open redirect).
    if value and value.startswith("/dashboard") and not value.startswith("//"):
        return value
    return "/dashboard"


@router.get("/dashboard/login")
async def login_form(request: Request, state: State, next: str | None = None) -> Response:
    return render(state, "login.html", next=_safe_next(next), error=None, title="Sign in")


@router.post("/dashboard/login")
async def login(request: Request, state: State) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    typed = (form.get("key") or [""])[0]
    target = _safe_next((form.get("next") or [""])[0])
    key = _admin_key(state)
    if key is None:
        return RedirectResponse(target, status_code=303)
    tenant_key = None
    if typed.startswith(api_keys.PREFIX) and state.keys is not None:
        try:
            tenant_key = await state.keys.check(typed)
        except KeysUnavailable:
            tenant_key = None
        if tenant_key is not None and tenant_key.role != "admin":
            tenant_key = None
        if tenant_key is not None and target == "/dashboard":
            target = "/dashboard/rollouts"  # the pages a tenant's admin sees: its rollouts
    if tenant_key is None and not hmac.compare_digest(typed.encode(), key.encode()):
        page = render(
            state,
            "login.html",
            next=target,
            error="That is not the admin key or a tenant's admin key.",
            title="Sign in",
        )
        page.status_code = 401
        return page
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        auth.COOKIE,
        auth.issue(key, key_id=tenant_key.id if tenant_key is not None else None),
        max_age=auth.LIFETIME_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/dashboard",
    )
    return response


@router.post("/dashboard/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(auth.COOKIE, path="/dashboard")
    return response


@router.get("/dashboard")
async def overview(request: Request, state: State) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    if not who.is_global:
        return _global_only(request, state)
    traffic, backlog, counts, versions = await asyncio.gather(
        asyncio.to_thread(console.traffic, state.db),
        asyncio.to_thread(console.backlog, state.db),
        asyncio.to_thread(training_counts, state.db, state.settings.awaits_judge),
        asyncio.to_thread(console.versions, state.db, 1000),
    )
    serving = next((v for v in versions if v.version == state.service.policy_version), None)
    capture = {**state.writer.fault.snapshot(), "queued": state.writer.stats.queued}
    follower = state.policy.fault.snapshot() if state.policy is not None else None
    return render(
        state,
        "overview.html",
        title="Overview",
        traffic=traffic,
        backlog=backlog,
        counts=counts,
        serving=serving,
        swaps=sum(1 for v in versions if v.current_at is not None),
        capture=capture,
        follower=follower,
        settings=state.settings,
    )


@router.get("/dashboard/rewards")
async def rewards(request: Request, state: State) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    if not who.is_global:
        return _global_only(request, state)
    versions, groups = await asyncio.gather(
        asyncio.to_thread(console.versions, state.db), asyncio.to_thread(console.reward_by_task_and_harness, state.db)
    )
    chart = charts.line_chart(
        "mean reward per policy version",
        [
            charts.Series("turn reward", [(v.version, v.turn_reward.mean) for v in versions]),
            charts.Series("rollout reward", [(v.version, v.rollout_reward.mean) for v in versions]),
            charts.Series("eval reward", [(v.version, v.eval_reward.mean) for v in versions]),
        ],
        x_label="policy version",
        y_label="reward",
    )
    return render(state, "rewards.html", title="Rewards", versions=versions, groups=groups, chart=chart)


@router.get("/dashboard/steps")
async def steps(request: Request, state: State) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    if not who.is_global:
        return _global_only(request, state)
    rows = await asyncio.to_thread(console.train_steps, state.db)
    ok = [s for s in rows if s.status == "ok"]
    figures = []
    for key, label in STEP_CHARTS:
        points = [(s.id, _step_figure(s, key)) for s in ok]
        if key in ("turn_reward_mean", "entropy") and not any(y is not None for _, y in points):
            continue  # figures a run never produces (no turns, entropy not computed) get no empty chart
        figures.append((label, charts.line_chart(label, [charts.Series(label, points)], x_label="step")))
    return render(state, "steps.html", title="Train steps", steps=list(reversed(rows[-100:])), figures=figures)


def _step_figure(step: console.StepRow, key: str) -> float | None:
    if key == "seconds":
        return step.seconds
    if key == "tokens_per_s":
        return step.tokens_processed / step.seconds if step.seconds else None
    if key == "clip_frac":
        low, high = _metric(step.metrics, "clip_frac_low"), _metric(step.metrics, "clip_frac_high")
        return None if low is None and high is None else (low or 0.0) + (high or 0.0)
    return _metric(step.metrics, key)


def _metric(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@router.get("/dashboard/rollouts")
async def rollout_list(
    request: Request,
    state: State,
    task_id: str | None = None,
    harness: str | None = None,
    status: str | None = None,
    policy_version: str | None = None,
    page: int = 1,
) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    version = int(policy_version) if policy_version and policy_version.strip().isdigit() else None
    where = console.RolloutFilter(task_id or None, harness or None, status or None, version, who.tenant)
    page = max(page, 1)
    rows, total = await asyncio.to_thread(
        console.rollouts_page, state.db, where, offset=(page - 1) * PAGE_SIZE, limit=PAGE_SIZE
    )
    query = {k: v for k, v in {"task_id": task_id, "harness": harness, "status": status}.items() if v}
    if version is not None:
        query["policy_version"] = str(version)
    pages = max((total + PAGE_SIZE - 1) // PAGE_SIZE, 1)
    return render(
        state,
        "rollouts.html",
        tenant=who.tenant,
        title="Rollouts",
        rows=rows,
        total=total,
        page=page,
        pages=pages,
        filters=query,
        link=lambda p: "/dashboard/rollouts?" + urlencode({**query, "page": p}),
    )


@router.get("/dashboard/rollouts/{rollout_id}")
async def rollout_detail(request: Request, state: State, rollout_id: str) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    try:
        view = await asyncio.to_thread(rollout_page.view, state, rollout_id)
        if not who.sees(view["rollout"]["tenant"]):  # another tenant's reads as one that does not exist
            raise RecordNotFound(rollout_id)
    except RecordNotFound:
        page = render(state, "missing.html", tenant=who.tenant, title="Not found", what=f"rollout {rollout_id}")
        page.status_code = 404
        return page
    return render(state, "rollout.html", tenant=who.tenant, title=f"Rollout {rollout_id}", **view)


@router.get("/dashboard/versions")
async def versions_page(request: Request, state: State, error: str | None = None) -> Response:
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    if not who.is_global:
        return _global_only(request, state)
    versions, control, promo, pins = await asyncio.gather(
        asyncio.to_thread(console.versions, state.db),
        asyncio.to_thread(policy_control.read, state.db),
        asyncio.to_thread(promotion_status, state.db, rule_of(state.settings)),
        asyncio.to_thread(policy_control.pins, state.db),
    )
    return render(
        state,
        "versions.html",
        title="Versions",
        versions=list(reversed(versions)),
        control=control,
        pins=pins,
        promo=promo,
        canary_since=dt.datetime.fromisoformat(promo["canary_started_at"]) if promo["canary_started_at"] else None,
        decisions=[_decision_view(d) for d in promo["decisions"]],
        error=error,
    )


def _decision_view(decision: dict[str, Any]) -> dict[str, Any]:
    """A decision as the history table shows it: its time back as a datetime, and each arm's n and mean when the
    decision was taken on evidence (a canary's start and an operator's decision carry none)."""
    evidence = decision["evidence"] or {}
    arms = {arm: evidence.get(arm) for arm in ("candidate", "incumbent")}
    return {
        **decision,
        "created_at": dt.datetime.fromisoformat(decision["created_at"]),
        "arms": arms if all(isinstance(a, dict) for a in arms.values()) else None,
        "share": evidence.get("share"),
    }


@router.post("/dashboard/policy/{action}")
async def policy_action(request: Request, state: State, action: str) -> Response:
    """The versions page's buttons: pin, unpin, roll back, promote or reject a candidate (the same changes as
    ``/v1/policy/...``)."""
    who = await viewer(request, state)
    if who is None:
        return _to_login(request)
    if not who.is_global:
        return _global_only(request, state)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    raw = (form.get("version") or [""])[0]
    changes: dict[str, Any] = {"pin": policy_control.pin, "rollback": policy_control.request_rollback}
    # A version names its lineage (a tenant's own policy, or the shared one); unpin without one is the shared pin.
    version = int(raw) if raw.isdigit() else None
    lineage = await asyncio.to_thread(lineage_for, state.db, None, version)
    try:
        if action == "unpin":
            await apply_change(state.db, state.policy, policy_control.unpin, lineage)
        elif action in changes and version is not None:
            await apply_change(state.db, state.policy, changes[action], version, lineage)
        elif action in ("promote", "reject") and version is not None:
            await apply_change(
                state.db, state.policy, promotion.decide_by_operator, action, version, "operator", lineage
            )
        else:
            raise NotFound(f"no policy action {action!r} for version {raw!r}")
    except (NotFound, policy_control.UnknownVersion, promotion.NotDecidable) as exc:
        return RedirectResponse("/dashboard/versions?" + urlencode({"error": str(exc)}), status_code=303)
    return RedirectResponse("/dashboard/versions", status_code=303)


__all__ = ["router"]
