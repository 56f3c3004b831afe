"""Rollout lifecycle on the store: create (with a per-rollout key), reward, finish, list, inspect.

These are synchronous database functions; the routes run them in a worker thread. Calls themselves are written by
the capture writer, so anything that must observe a rollout's calls (finishing it, rewarding it, reading it)
first waits for the writer to flush what was already submitted.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import codec, policy_versions, repo
from gateway.store.counterfactuals import group_record, groups_of
from gateway.store.errors import InvalidInput, RecordNotFound
from gateway.store.models import Call, Reward, Rollout, utcnow
from gateway.store.secret_spans import redact_ids, sequence_spans

ROLLOUT_KEY_PREFIX = "cgr-"
FINISHED = ("completed", "failed", "aborted")


class VersionNotServable(ValueError):
    """A rollout was to be pinned to a version that was never published (``stage`` None) or was rejected."""

    def __init__(self, version: int, stage: str | None) -> None:
        what = "was never published" if stage is None else "was rejected"
        super().__init__(f"policy@v{version} {what}: no rollout can be served by it")
        self.version, self.stage = version, stage


# Harness session headers, in priority order after the explicit ones, with the prefix their rollout id gets.
SESSION_HEADERS = (
    ("x-claude-code-session-id", "claude-code-"),
    ("session-id", "codex-"),
    ("thread-id", "codex-"),
)


def new_rollout_key() -> str:
    return ROLLOUT_KEY_PREFIX + secrets.token_urlsafe(24)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, key_hash: str | None) -> bool:
    return key_hash is not None and hmac.compare_digest(hash_key(key), key_hash)


def default_group(task_id: str | None, harness: str | None) -> str | None:
    """The GRPO baseline group: a task–harness pair (different harnesses never share a baseline)."""
    if task_id is None:
        return None
    return f"{task_id}::{harness or 'unknown'}"


def create(
    db: sa.Engine,
    *,
    task_id: str | None,
    harness: str | None,
    group: str | None,
    metadata: dict[str, Any] | None,
    eval: bool = False,
    policy_version: int | None = None,
    tenant: str = "default",
) -> tuple[Rollout, str]:
    """A new explicit rollout of ``tenant`` and its key. ``policy_version``: every call is served by that version,
    which must be published, not rejected and of the shared policy or the tenant's own (``VersionNotServable``
    otherwise; another tenant's version reads as one never published)."""
    key = new_rollout_key()
    now = utcnow()
    rollout = Rollout(
        id=f"ro-{uuid.uuid4().hex[:24]}",
        kind="explicit",
        task_id=task_id,
        harness=harness,
        group_key=group or default_group(task_id, harness),
        status="open",
        metadata_=metadata,
        eval=eval,
        policy_version=policy_version,
        api_key_hash=hash_key(key),
        tenant=tenant,
        created_at=now,
        updated_at=now,
    )
    with Session(db, expire_on_commit=False) as session, session.begin():
        if policy_version is not None:
            stage = policy_versions.stage(session, policy_version)
            if policy_versions.lineage_of(session, policy_version) not in (policy_versions.SHARED, tenant):
                stage = None
            if stage is None or stage == "rejected":
                raise VersionNotServable(policy_version, stage)
        session.add(rollout)
    return rollout, key


@dataclass(frozen=True, slots=True)
class Access:
    """What serving needs of an explicit rollout: its key's hash (None: no key), the version it is pinned to and
    its tenant (None: the rollout does not exist, as far as this process knows)."""

    key_hash: str | None = None
    policy_version: int | None = None
    tenant: str | None = None


def access_of(db: sa.Engine, rollout_id: str) -> Access:
    """A rollout that does not exist (yet: a client may name one on its first call) has none of them."""
    with Session(db) as session:
        row = session.execute(
            sa.select(Rollout.api_key_hash, Rollout.policy_version, Rollout.tenant).where(Rollout.id == rollout_id)
        ).one_or_none()
    return Access() if row is None else Access(row[0], row[1], row[2])


def _get(session: Session, rollout_id: str) -> Rollout:
    rollout = session.get(Rollout, rollout_id)
    if rollout is None:
        raise RecordNotFound(f"rollout {rollout_id!r} not found", param="rollout_id")
    return rollout


def add_reward(
    db: sa.Engine,
    rollout_id: str,
    value: float,
    *,
    source: str | None,
    details: dict[str, Any] | None,
    call_id: str | None = None,
) -> Reward:
    with Session(db, expire_on_commit=False) as session, session.begin():
        _get(session, rollout_id)
        reward = Reward(
            rollout_id=rollout_id, call_id=call_id, value=value, source=source, details=details, created_at=utcnow()
        )
        session.add(reward)
    return reward


def call_rollout(db: sa.Engine, call_id: str) -> str:
    with Session(db) as session:
        rollout_id = session.scalar(sa.select(Call.rollout_id).where(Call.id == call_id))
    if rollout_id is None:
        raise RecordNotFound(f"call {call_id!r} not found", param="call_id")
    return rollout_id


def calls_of_request(db: sa.Engine, request_id: str) -> list[tuple[str, str]]:
    """(call id, rollout id) of every choice of one API response id (chatcmpl-…, msg_…, resp_…)."""
    with Session(db) as session:
        rows = session.execute(
            sa.select(Call.id, Call.rollout_id).where(Call.request_id == request_id).order_by(Call.choice_index)
        ).all()
    return [(r[0], r[1]) for r in rows]


def close_idle(db: sa.Engine, idle_seconds: float) -> list[str]:
    """Mark implicit and harness-session rollouts idle for ``idle_seconds`` as completed; returns their ids."""
    now = utcnow()
    idle = (
        Rollout.kind.in_(("implicit", "session")),
        Rollout.status == "open",
        Rollout.updated_at < now - dt.timedelta(seconds=idle_seconds),
    )
    with Session(db) as session, session.begin():
        ids = list(session.scalars(sa.select(Rollout.id).where(*idle).with_for_update()))
        if ids:
            session.execute(
                sa.update(Rollout)
                .where(Rollout.id.in_(ids), Rollout.status == "open")
                .values(status="completed", finished_at=now)
            )
    return ids


def claim_open(db: sa.Engine, rollout_id: str) -> bool:
    """Touch an open rollout so that no idle close takes it now; False when it is already closed.

    The conditional update and ``close_idle``'s locking read exclude each other on the row: either this touch
    commits first (the close then finds the rollout no longer idle) or the close does (the touch matches nothing),
    whichever gateway process runs them. A rollout not stored yet is not closed.
    """
    now = utcnow()
    with Session(db) as session, session.begin():
        touched = session.execute(
            sa.update(Rollout).where(Rollout.id == rollout_id, Rollout.status == "open").values(updated_at=now)
        )
        if cast("sa.CursorResult[Any]", touched).rowcount:
            return True
        return session.scalar(sa.select(Rollout.id).where(Rollout.id == rollout_id)) is None


def closed_since(db: sa.Engine, since: dt.datetime) -> list[str]:
    """Implicit and harness-session rollouts finished at or after ``since`` (by any gateway process)."""
    with Session(db) as session:
        query = sa.select(Rollout.id).where(
            Rollout.kind.in_(("implicit", "session")), Rollout.status != "open", Rollout.finished_at >= since
        )
        return list(session.scalars(query))


def finish(db: sa.Engine, rollout_id: str, status: str, reason: str | None = None) -> Rollout:
    if status not in FINISHED:
        raise InvalidInput(f"status must be one of {', '.join(FINISHED)}", param="status")
    with Session(db, expire_on_commit=False) as session, session.begin():
        rollout = _get(session, rollout_id)
        if rollout.status in FINISHED and rollout.status != status:
            raise InvalidInput(f"rollout {rollout_id!r} is already {rollout.status}", param="status")
        now = utcnow()
        rollout.status = status
        rollout.finish_reason = reason or rollout.finish_reason
        rollout.finished_at = rollout.finished_at or now
        rollout.updated_at = max(rollout.updated_at, now)
    return rollout


@dataclass(frozen=True, slots=True)
class RolloutFilter:
    task_id: str | None = None
    harness: str | None = None
    status: str | None = None
    group: str | None = None
    policy_version: int | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    eval: bool | None = None
    tenant: str | None = None


def encode_cursor(rollout: Rollout) -> str:
    raw = f"{rollout.created_at.isoformat()}|{rollout.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, rollout_id = raw.split("|", 1)
        return dt.datetime.fromisoformat(stamp), rollout_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput("invalid cursor", param="cursor") from exc


def list_rollouts(
    db: sa.Engine, f: RolloutFilter, *, limit: int, cursor: str | None
) -> tuple[list[Rollout], str | None]:
    """Newest first, keyset-paginated by (created_at, id)."""
    query = sa.select(Rollout)
    for column, value in (
        (Rollout.task_id, f.task_id),
        (Rollout.harness, f.harness),
        (Rollout.status, f.status),
        (Rollout.group_key, f.group),
        (Rollout.tenant, f.tenant),
    ):
        if value is not None:
            query = query.where(column == value)
    if f.eval is not None:
        query = query.where(Rollout.eval == f.eval)
    if f.since is not None:
        query = query.where(Rollout.created_at >= f.since)
    if f.until is not None:
        query = query.where(Rollout.created_at < f.until)
    if f.policy_version is not None:
        query = query.where(sa.exists().where(Call.rollout_id == Rollout.id, Call.policy_version == f.policy_version))
    if cursor is not None:
        stamp, last_id = _decode_cursor(cursor)
        query = query.where(
            sa.or_(Rollout.created_at < stamp, sa.and_(Rollout.created_at == stamp, Rollout.id < last_id))
        )
    query = query.order_by(Rollout.created_at.desc(), Rollout.id.desc()).limit(limit + 1)
    with Session(db, expire_on_commit=False) as session:
        rows = list(session.scalars(query))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (encode_cursor(rows[-1]) if more and rows else None)


def summary(rollout: Rollout) -> dict[str, Any]:
    return {
        "id": rollout.id,
        "object": "rollout",
        "kind": rollout.kind,
        "task_id": rollout.task_id,
        "harness": rollout.harness,
        "group": rollout.group_key,
        "status": rollout.status,
        "finish_reason": rollout.finish_reason,
        "eval": rollout.eval,
        "policy_version": rollout.policy_version,
        "tenant": rollout.tenant,
        "metadata": rollout.metadata_,
        "created_at": rollout.created_at.isoformat(),
        "updated_at": rollout.updated_at.isoformat(),
        "finished_at": rollout.finished_at.isoformat() if rollout.finished_at else None,
    }


def reward_dict(reward: Reward) -> dict[str, Any]:
    return {
        "id": reward.id,
        "rollout_id": reward.rollout_id,
        "call_id": reward.call_id,
        "value": reward.value,
        "source": reward.source,
        "details": reward.details,
        "created_at": reward.created_at.isoformat(),
    }


def detail(
    db: sa.Engine, rollout_id: str, *, with_tokens: bool = True, raw: bool = False, counterfactuals: bool = False
) -> dict[str, Any]:
    """A rollout with its calls (token ids and logprobs, versions, status) and rewards.

    Each call lists the credentials its tokens hold (``secrets``: kind and positions in prompt + completion); their
    token ids read -1 unless ``raw``. ``counterfactuals``: each call also carries its ``counterfactual_group``
    (``counterfactuals.group_record``; None when no siblings were drawn for it), redacted the same way.
    """
    with Session(db) as session:
        rollout = _get(session, rollout_id)
        cache = repo.CallCache.for_rollout(session, rollout_id)
        calls = []
        rows = repo.calls_for_rollout(session, rollout_id)
        spans = sequence_spans(session, rows)
        groups = groups_of(session, [c.id for c in rows]) if counterfactuals else {}
        for call in rows:
            item: dict[str, Any] = {
                "id": call.id,
                "request_id": call.request_id,
                "choice_index": call.choice_index,
                "api": call.api,
                "model": call.model,
                "adapter": call.adapter,
                "policy_version": call.policy_version,
                "engine": call.engine,
                "status": call.status,
                "error": call.error,
                "finish_reason": call.finish_reason,
                "render_mode": call.render_mode,
                "is_subagent": call.is_subagent,
                "agent_id": call.agent_id,
                "constrained": call.constrained,
                "parent_call_id": call.parent_call_id,
                "prompt_tokens": call.prompt_len,
                "completion_tokens": call.completion_len,
                "started_at": call.started_at.isoformat(),
                "ended_at": call.ended_at.isoformat() if call.ended_at else None,
                "ttft_ms": call.ttft_ms,
                "secrets": [{"kind": k, "start": a, "end": b} for k, a, b in spans[call.id]],
            }
            if with_tokens:
                prompt, completion = repo.full_prompt_ids(cache, call), codec.unpack_ids(call.completion_ids)
                if not raw:
                    prompt = redact_ids(prompt, spans[call.id])
                    completion = redact_ids(completion, spans[call.id], offset=call.prompt_len)
                item["prompt_token_ids"] = prompt
                item["completion_token_ids"] = completion
                item["completion_logprobs"] = codec.unpack_logprobs(call.completion_logprobs)
            if counterfactuals:
                group = groups.get(call.id)
                item["counterfactual_group"] = (
                    None
                    if group is None
                    else group_record(group, with_tokens=with_tokens, raw=raw, held=bool(spans[call.id]))
                )
            calls.append(item)
        rewards = [
            reward_dict(r)
            for r in session.scalars(sa.select(Reward).where(Reward.rollout_id == rollout_id).order_by(Reward.id))
        ]
        out = summary(rollout)
    out["calls"] = calls
    out["rewards"] = rewards
    rollout_level = [r for r in rewards if r["call_id"] is None]
    out["reward"] = rollout_level[-1]["value"] if rollout_level else None
    return out
