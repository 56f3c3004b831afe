"""Initial schema: rollouts, calls, rewards, policy_versions.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("task_id", sa.String(), nullable=True),
        sa.Column("harness", sa.String(), nullable=True),
        sa.Column("group_key", sa.String(), nullable=True),
        sa.Column("status", sa.String(), server_default="open", nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("api_key_hash", sa.String(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_group_key", "rollouts", ["group_key"])
    op.create_index("ix_rollouts_status_updated_at", "rollouts", ["status", "updated_at"])

    op.create_table(
        "calls",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("request_id", sa.String(), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("api", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("adapter", sa.String(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("engine", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("render_mode", sa.String(), nullable=False),
        sa.Column("is_subagent", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("agent_id", sa.String(), nullable=True),
        sa.Column("request", sa.LargeBinary(), nullable=False),
        sa.Column("request_prefix_messages", sa.Integer(), server_default="0", nullable=False),
        sa.Column("parent_call_id", sa.String(40), nullable=True),
        sa.Column("prompt_prefix_len", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_delta", sa.LargeBinary(), nullable=False),
        sa.Column("prompt_len", sa.Integer(), nullable=False),
        sa.Column("completion_ids", sa.LargeBinary(), nullable=False),
        sa.Column("completion_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("completion_len", sa.Integer(), nullable=False),
        sa.Column("tail_hash", sa.String(32), nullable=True),
        _timestamp("started_at"),
        _timestamp("ended_at"),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("engine_ms", sa.Float(), nullable=True),
        sa.Column("gateway_ms", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_calls"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_calls_rollout_id_rollouts"),
        sa.ForeignKeyConstraint(["parent_call_id"], ["calls.id"], name="fk_calls_parent_call_id_calls"),
    )
    op.create_index("ix_calls_request_id", "calls", ["request_id"])
    op.create_index("ix_calls_parent_call_id", "calls", ["parent_call_id"])
    op.create_index("ix_calls_tail_hash", "calls", ["tail_hash"])
    op.create_index("ix_calls_rollout_id_started_at", "calls", ["rollout_id", "started_at"])

    op.create_table(
        "rewards",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("call_id", sa.String(40), nullable=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("source", sa.String(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_rewards"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_rewards_rollout_id_rollouts"),
        sa.ForeignKeyConstraint(["call_id"], ["calls.id"], name="fk_rewards_call_id_calls"),
    )
    op.create_index("ix_rewards_rollout_id", "rewards", ["rollout_id"])

    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("adapter_name", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("is_current", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("version", name="pk_policy_versions"),
        sa.UniqueConstraint("adapter_name", name="uq_policy_versions_adapter_name"),
    )


def downgrade() -> None:
    # Children before parents: with foreign keys enforced, dropping a referenced table first would fail.
    op.drop_table("policy_versions")
    op.drop_index("ix_rewards_rollout_id", table_name="rewards")
    op.drop_table("rewards")
    op.drop_index("ix_calls_rollout_id_started_at", table_name="calls")
    op.drop_index("ix_calls_tail_hash", table_name="calls")
    op.drop_index("ix_calls_parent_call_id", table_name="calls")
    op.drop_index("ix_calls_request_id", table_name="calls")
    op.drop_table("calls")
    op.drop_index("ix_rollouts_status_updated_at", table_name="rollouts")
    op.drop_index("ix_rollouts_group_key", table_name="rollouts")
    op.drop_table("rollouts")
