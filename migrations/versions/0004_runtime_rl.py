"""Runtime RL: where each turn's next state is, the reward worker's verdicts, and turns consumed by training.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("next_call_id", sa.String(40), nullable=True))
    op.create_index("ix_rewards_call_id", "rewards", ["call_id"])
    op.create_table(
        "judgements",
        sa.Column("call_id", sa.String(40), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("claim", sa.String(32), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("model", sa.String(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cost_usd", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("had_next_state", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("judged_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["call_id"], ["calls.id"], name="fk_judgements_call_id_calls"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_judgements_rollout_id_rollouts"),
        sa.PrimaryKeyConstraint("call_id", name="pk_judgements"),
    )
    op.create_index("ix_judgements_status", "judgements", ["status"])
    op.create_table(
        "trained_turns",
        sa.Column("call_id", sa.String(40), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["call_id"], ["calls.id"], name="fk_trained_turns_call_id_calls"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_trained_turns_rollout_id_rollouts"),
        sa.ForeignKeyConstraint(["step_id"], ["train_steps.id"], name="fk_trained_turns_step_id_train_steps"),
        sa.PrimaryKeyConstraint("call_id", "epoch", name="pk_trained_turns"),
    )
    op.create_index("ix_trained_turns_step_id", "trained_turns", ["step_id"])


def downgrade() -> None:
    op.drop_index("ix_trained_turns_step_id", table_name="trained_turns")
    op.drop_table("trained_turns")
    op.drop_index("ix_judgements_status", table_name="judgements")
    op.drop_table("judgements")
    op.drop_index("ix_rewards_call_id", table_name="rewards")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("next_call_id")
