"""Training bookkeeping: train steps and which rollouts each step consumed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 10:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "train_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("base_version", sa.Integer(), nullable=True),
        sa.Column("algorithm", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("n_rollouts", sa.Integer(), nullable=False),
        sa.Column("n_paths", sa.Integer(), nullable=False),
        sa.Column("tokens_processed", sa.Integer(), nullable=False),
        sa.Column("trainable_tokens", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_train_steps"),
    )
    op.create_table(
        "trained_rollouts",
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_trained_rollouts_rollout_id_rollouts"),
        sa.ForeignKeyConstraint(["step_id"], ["train_steps.id"], name="fk_trained_rollouts_step_id_train_steps"),
        sa.PrimaryKeyConstraint("rollout_id", "epoch", name="pk_trained_rollouts"),
    )
    op.create_index("ix_trained_rollouts_step_id", "trained_rollouts", ["step_id"])


def downgrade() -> None:
    op.drop_index("ix_trained_rollouts_step_id", table_name="trained_rollouts")
    op.drop_table("trained_rollouts")
    op.drop_table("train_steps")
