"""SQLAlchemy models of what the gateway records: rollouts, calls, rewards and policy versions.

The schema is created and changed only by the Alembic migrations in ``migrations/``; these classes describe
it for queries and for the test that checks the migrated schema still matches them. Token arrays are stored
packed (``codec.py``): a call's prompt is kept as a delta against its parent call's prompt + completion, so a
rollout's storage grows with its unique tokens, not with turns².

Timestamps are UTC and timezone-aware on the way in and out, also on SQLite, which stores them without an
offset.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Named constraints keep migrations reproducible across dialects (SQLite batch mode alters them by name).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(sa.types.TypeDecorator[dt.datetime]):
    """``DateTime(timezone=True)`` that always binds UTC and always returns aware UTC datetimes.

    SQLite drops the offset, so values are converted to UTC before binding (which also keeps its text
    representation sortable, as the rollout upsert's ``max(updated_at, ...)`` relies on); naive values are
    taken to be UTC already.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


# SQL NULL (not JSON 'null') for a missing value, so COALESCE in the rollout upsert can fill it later.
JSONValue = sa.JSON(none_as_null=True)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Rollout(Base):
    """One episode of one harness on one task (opened explicitly, or grouped implicitly by prefix match)."""

    __tablename__ = "rollouts"

    id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String)  # "explicit" | "implicit"
    task_id: Mapped[str | None] = mapped_column(sa.String)
    harness: Mapped[str | None] = mapped_column(sa.String)
    # The GRPO baseline group: a task–harness pair.
    group_key: Mapped[str | None] = mapped_column(sa.String, index=True)
    # "open" | "completed" | "failed" | "aborted"
    status: Mapped[str] = mapped_column(sa.String, default="open", server_default="open")
    # Why a rollout failed or was aborted (a timeout, a harness crash), for the runner's report.
    finish_reason: Mapped[str | None] = mapped_column(sa.Text)
    # Evaluation rollouts measure a policy version; the trainer never trains on them.
    eval: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    # Every call is served by this policy version (an evaluation of a version that serves no traffic yet); None:
    # routed like any other conversation.
    policy_version: Mapped[int | None] = mapped_column(sa.Integer)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONValue)
    api_key_hash: Mapped[str | None] = mapped_column(sa.String)
    # The tenant whose key served (or created) it: only that tenant's keys and the global admin see it.
    tenant: Mapped[str] = mapped_column(sa.String(64), default="default", server_default="default", index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Time of the latest activity; the trainer looks for rollouts by (status, updated_at).
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())

    calls: Mapped[list[Call]] = relationship(back_populates="rollout", order_by="Call.started_at", viewonly=True)
    rewards: Mapped[list[Reward]] = relationship(back_populates="rollout", viewonly=True)

    __table_args__ = (sa.Index("ix_rollouts_status_updated_at", "status", "updated_at"),)


class Call(Base):
    """One model invocation at the serving boundary, with its exact tokens and sampled-token logprobs.

    Full prompt = (parent's full prompt + parent's completion)[:prompt_prefix_len] + prompt_delta.
    Full request messages = parent's full request messages[:request_prefix_messages] + stored messages.
    ``repo.py`` reconstructs both.
    """

    __tablename__ = "calls"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    # The API response id, shared by the n choices of one request.
    request_id: Mapped[str] = mapped_column(sa.String, index=True)
    choice_index: Mapped[int] = mapped_column(sa.Integer, default=0)
    # Indexed through ix_calls_rollout_id_started_at (a leading column serves lookups by rollout alone).
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"))
    api: Mapped[str] = mapped_column(sa.String)  # "chat" | "completions" | "messages" | "responses"
    model: Mapped[str] = mapped_column(sa.String)
    adapter: Mapped[str | None] = mapped_column(sa.String)
    policy_version: Mapped[int | None] = mapped_column(sa.Integer)
    engine: Mapped[str] = mapped_column(sa.String)
    status: Mapped[str] = mapped_column(sa.String)  # "ok" | "failed" | "cancelled"
    error: Mapped[str | None] = mapped_column(sa.Text)
    finish_reason: Mapped[str | None] = mapped_column(sa.String)
    render_mode: Mapped[str] = mapped_column(sa.String)  # "fresh" | "spliced" | "drifted" | "raw"
    is_subagent: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    agent_id: Mapped[str | None] = mapped_column(sa.String)
    # Sampled under a grammar: the completion's logprobs are the masked distribution's (context, never trained on).
    constrained: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())

    # zlib JSON of the request body, its message list cut to the messages after request_prefix_messages.
    request: Mapped[bytes] = mapped_column(sa.LargeBinary)
    request_prefix_messages: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")

    parent_call_id: Mapped[str | None] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), index=True)
    prompt_prefix_len: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    prompt_delta: Mapped[bytes] = mapped_column(sa.LargeBinary)  # little-endian uint32 token ids
    prompt_len: Mapped[int] = mapped_column(sa.Integer)
    completion_ids: Mapped[bytes] = mapped_column(sa.LargeBinary)  # little-endian uint32
    completion_logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)  # little-endian float32
    completion_len: Mapped[int] = mapped_column(sa.Integer)

    # The turn's next state: the first call that continued this one (its prompt holds, after this call's prompt +
    # completion, what the harness added: tool results, the user's next message). Set when that call is recorded.
    next_call_id: Mapped[str | None] = mapped_column(sa.String(40))
    # Hash of the conversation after this call; finds the parent of the next call after a restart.
    tail_hash: Mapped[str | None] = mapped_column(sa.String(32), index=True)
    # Hash of this call's answer alone (``conversation.output_hash``): any gateway can tell an echoed turn is ours.
    output_hash: Mapped[str | None] = mapped_column(sa.String(32), index=True)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    ttft_ms: Mapped[float | None] = mapped_column(sa.Float)
    engine_ms: Mapped[float | None] = mapped_column(sa.Float)
    gateway_ms: Mapped[float | None] = mapped_column(sa.Float)

    rollout: Mapped[Rollout] = relationship(back_populates="calls", viewonly=True)

    __table_args__ = (
        sa.Index("ix_calls_rollout_id_started_at", "rollout_id", "started_at"),
        # A canary's evidence: the calls each arm's version served since the canary began.
        sa.Index("ix_calls_policy_version_started_at", "policy_version", "started_at"),
    )


class Reward(Base):
    """A scalar reward for a rollout (or one call of it: a turn), from a verifier, feedback, a rule or a judge.

    ``source`` names where it came from ("verifier", "feedback", "judge", "rule:tool_error", "function:<name>");
    a turn's reward is the sum over sources of each source's latest value (``store/turns.py``).
    """

    __tablename__ = "rewards"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    call_id: Mapped[str | None] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), index=True)
    value: Mapped[float] = mapped_column(sa.Float)
    source: Mapped[str | None] = mapped_column(sa.String)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    rollout: Mapped[Rollout] = relationship(back_populates="rewards", viewonly=True)


class PolicyVersion(Base):
    """A LoRA adapter the trainer published (``policy@vN``) and whether engines serve it."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    adapter_name: Mapped[str] = mapped_column(sa.String, unique=True)
    path: Mapped[str] = mapped_column(sa.String)
    base_model: Mapped[str] = mapped_column(sa.String)
    status: Mapped[str] = mapped_column(sa.String)  # "published" | "loaded" | "retired"
    is_current: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    step: Mapped[int | None] = mapped_column(sa.Integer)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # When a gateway first had it loaded in its engine, and when it first routed new calls to it.
    loaded_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    current_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    # The version it was trained from; a rollback republishes an earlier version's weights as a new version.
    parent_version: Mapped[int | None] = mapped_column(sa.Integer)
    rolled_back_from: Mapped[int | None] = mapped_column(sa.Integer)  # the version whose weights it copies
    # Guarded promotion (``gateway/promotion``): [evaluating ->] candidate -> canary -> promoted | rejected. The
    # newest promoted version is the incumbent; a canary serves ``canary_share`` of new conversations from
    # ``stage_at`` on; an evaluating version serves only the rollouts pinned to it (the evaluation gate).
    stage: Mapped[str] = mapped_column(sa.String, default="promoted", server_default="promoted")
    stage_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    canary_share: Mapped[float | None] = mapped_column(sa.Float)
    # The lineage it belongs to: a tenant's own policy (the tenant's name) or the shared one (""). Version numbers
    # are global; a lineage's versions are the rows with its name.
    lineage: Mapped[str] = mapped_column(sa.String(64), default="", server_default="")

    __table_args__ = (sa.Index("ix_policy_versions_lineage", "lineage", "version"),)


class PolicyControl(Base):
    """The operator's hold on what is served (one row per lineage; the shared lineage's is id 1): a pinned version
    every gateway serves until unpinned, and a rollback the trainer has yet to carry out (republish that version's
    weights as a new version and train on from it). Versions themselves stay immutable and their numbers monotonic."""

    __tablename__ = "policy_control"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    pinned_version: Mapped[int | None] = mapped_column(sa.Integer)
    rollback_to: Mapped[int | None] = mapped_column(sa.Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # "guarded" | "immediate", as the gateways last said (the trainer publishes candidates or promoted versions).
    promotion: Mapped[str | None] = mapped_column(sa.String)
    lineage: Mapped[str] = mapped_column(sa.String(64), default="", server_default="", unique=True)


class TrainStep(Base):
    """One optimization step of the trainer: what it consumed, what it produced, its metrics."""

    __tablename__ = "train_steps"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    version: Mapped[int | None] = mapped_column(sa.Integer)  # the policy version it published
    base_version: Mapped[int | None] = mapped_column(sa.Integer)  # the version it started from
    algorithm: Mapped[str] = mapped_column(sa.String)  # "grpo" | "ppo"
    status: Mapped[str] = mapped_column(sa.String)  # "ok" | "failed"
    n_rollouts: Mapped[int] = mapped_column(sa.Integer)
    n_paths: Mapped[int] = mapped_column(sa.Integer)
    tokens_processed: Mapped[int] = mapped_column(sa.Integer)
    trainable_tokens: Mapped[int] = mapped_column(sa.Integer)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    error: Mapped[str | None] = mapped_column(sa.Text)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class TrainedRollout(Base):
    """A rollout consumed by a train step, once per epoch (the primary key makes double training impossible)."""

    __tablename__ = "trained_rollouts"

    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), primary_key=True)
    epoch: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    step_id: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("train_steps.id"), index=True)
    version: Mapped[int] = mapped_column(sa.Integer)
    advantage: Mapped[float | None] = mapped_column(sa.Float)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


# Judgement statuses after which the reward worker will not touch a turn again.
FINAL_JUDGEMENTS = ("done", "unparseable", "failed")


class Judgement(Base):
    """The reward worker's verdict on one turn (the judge, reward functions): claimed, done, or given up on.

    The primary key makes a second verdict on a turn impossible; a worker claims a turn with a random ``claim``
    token and a lease (``claimed_until``) and commits its rewards only while it still holds that claim.
    """

    __tablename__ = "judgements"

    call_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    # "running" (claimed or waiting for a retry) | "done" | "unparseable" | "failed" (the last three are final)
    status: Mapped[str] = mapped_column(sa.String, index=True)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    claim: Mapped[str | None] = mapped_column(sa.String(32))
    claimed_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    retry_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    score: Mapped[float | None] = mapped_column(sa.Float)
    reason: Mapped[str | None] = mapped_column(sa.Text)
    model: Mapped[str | None] = mapped_column(sa.String)
    prompt_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    completion_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    cost_usd: Mapped[float | None] = mapped_column(sa.Float)
    error: Mapped[str | None] = mapped_column(sa.Text)
    had_next_state: Mapped[bool | None] = mapped_column(sa.Boolean)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    judged_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class TrainedTurn(Base):
    """A turn (one call of a rollout without a group) consumed by a train step, once per epoch."""

    __tablename__ = "trained_turns"

    call_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), primary_key=True)
    epoch: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    step_id: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("train_steps.id"), index=True)
    version: Mapped[int] = mapped_column(sa.Integer)
    reward: Mapped[float | None] = mapped_column(sa.Float)
    advantage: Mapped[float | None] = mapped_column(sa.Float)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class StoredResponse(Base):
    """A Responses-API answer that a later request may continue (``previous_response_id``), from any gateway.

    ``items`` holds only what this response added to the conversation it continued (its new input items and its
    answer, as internal messages: zlib JSON); the whole conversation is the chain through ``previous_id``. A
    response created with ``store: false`` has a row without items, so a continuation can be refused clearly.
    """

    __tablename__ = "stored_responses"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    call_id: Mapped[str | None] = mapped_column(sa.String(40), index=True)
    previous_id: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    stored: Mapped[bool] = mapped_column(sa.Boolean)
    items: Mapped[bytes | None] = mapped_column(sa.LargeBinary)
    # Only a key of this tenant may continue it (another tenant's request reads "not found").
    tenant: Mapped[str] = mapped_column(sa.String(64), default="default", server_default="default")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class GatewayAdapter(Base):
    """A gateway's heartbeat for an adapter it serves or still runs calls on: versions in use stay loaded."""

    __tablename__ = "gateway_adapters"

    gateway_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    adapter: Mapped[str] = mapped_column(sa.String, primary_key=True, index=True)
    seen_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class PromotionDecision(Base):
    """A stage change of a policy version (canary started, promoted, rejected), why, and the evidence it used."""

    __tablename__ = "promotion_decisions"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(sa.Integer, index=True)
    incumbent_version: Mapped[int | None] = mapped_column(sa.Integer)
    outcome: Mapped[str] = mapped_column(sa.String)  # "canary" | "promoted" | "rejected"
    # "evidence" | "time limit" | "operator" | "load failed" | "superseded" | "immediate" | "first version" | ...
    reason: Mapped[str] = mapped_column(sa.String)
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    decided_by: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SecretFinding(Base):
    """A credential found in a captured call (``gateway/credentials``): where, and what kind; never its text.

    ``part`` "prompt": token positions ``[start, end)`` in the call's full prompt (found in its ``prompt_delta``);
    "completion": positions in its completion. A call's answer with a finding is not trained on (``secrets`` mode
    "exclude"; "mask" leaves only the finding's tokens out of the loss), and its text is redacted where shown.
    """

    __tablename__ = "secret_findings"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    call_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"))
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    part: Mapped[str] = mapped_column(sa.String(16))  # "prompt" | "completion"
    kind: Mapped[str] = mapped_column(sa.String)
    start: Mapped[int] = mapped_column(sa.Integer)
    end: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    # One row per finding however often its batch is replayed (insert-or-ignore); the leading column serves
    # lookups by call.
    __table_args__ = (sa.UniqueConstraint("call_id", "part", "start", name="uq_secret_findings_call_id_part_start"),)


class Export(Base):
    """A file `clawgate export` wrote, and where: forgetting a rollout it holds rewrites it without that rollout."""

    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    path: Mapped[str] = mapped_column(sa.Text)
    host: Mapped[str] = mapped_column(sa.String)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ExportRollout(Base):
    """A rollout written to an export file (one JSON line)."""

    __tablename__ = "export_rollouts"

    export_id: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("exports.id"), primary_key=True)
    # No foreign key: the file keeps what it holds whatever happens to the rows (a prune); a forget cleans both.
    rollout_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True, index=True)


class Tenant(Base):
    """A team or product served by this clawgate (``gateway/tenants``): its keys and its data are its own."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Quotas over all of the tenant's keys (None: unlimited); ``gateway/tenants/quotas.py`` enforces them.
    requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    # A policy of its own: a lineage trained only on this tenant's traffic and served only to its keys.
    own_policy: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())


class ApiKey(Base):
    """A client or tenant-admin key. Only an HMAC-SHA256 of the key is stored; ``id`` is the key's public part."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("tenants.name"), index=True)
    role: Mapped[str] = mapped_column(sa.String(16))  # "user" | "admin"
    key_hash: Mapped[str] = mapped_column(sa.String(64))
    name: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(sa.Integer)


class QuotaUsage(Base):
    """Requests and tokens (prompt + completion) counted against a quota's subject (``tenant:NAME`` or
    ``key:ID``) in one minute (minutes since the epoch, UTC); every gateway process adds its own counts."""

    __tablename__ = "quota_usage"

    subject: Mapped[str] = mapped_column(sa.String(80), primary_key=True)
    minute: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")


class CounterfactualGroup(Base):
    """The counterfactual group of a served turn (``gateway/core/counterfactuals.py``): ``k`` siblings were asked
    for, the rows of ``counterfactuals`` are those that were drawn whole. ``served_reward`` is the served answer's
    score on the same terms as its siblings' (pointwise, without its next state), so the group's rewards compare."""

    __tablename__ = "counterfactual_groups"

    call_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    k: Mapped[int] = mapped_column(sa.Integer)
    drawn: Mapped[int] = mapped_column(sa.Integer)
    served_reward: Mapped[float | None] = mapped_column(sa.Float)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    judged_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    # Set while its siblings are drawn: the time by which they are recorded or given up (``open_group``).
    drawing_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class Counterfactual(Base):
    """An extra answer drawn for a served turn's exact prompt ids with its sampling settings and policy version,
    off the critical path. Never returned to a client, never spliced, never a parent: it lives only here (its
    prompt is its turn's), so nothing that serves, links or continues conversations can see it."""

    __tablename__ = "counterfactuals"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    call_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("calls.id"), index=True)
    rollout_id: Mapped[str] = mapped_column(sa.String(128), sa.ForeignKey("rollouts.id"), index=True)
    adapter: Mapped[str | None] = mapped_column(sa.String)
    policy_version: Mapped[int | None] = mapped_column(sa.Integer)
    engine: Mapped[str] = mapped_column(sa.String)
    finish_reason: Mapped[str | None] = mapped_column(sa.String)
    completion_ids: Mapped[bytes] = mapped_column(sa.LargeBinary)  # little-endian uint32
    completion_logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)  # little-endian float32
    completion_len: Mapped[int] = mapped_column(sa.Integer)
    reward: Mapped[float | None] = mapped_column(sa.Float)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The answer as the served call's parser read it ({"content", "reasoning", "tool_calls": [{"name", "arguments"}]}),
    # and its credentials as token spans of the completion ([[kind, start, end], …]; None: not scanned).
    message: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    secret_spans: Mapped[list[Any] | None] = mapped_column(JSONValue)
