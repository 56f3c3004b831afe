"""Counterfactual groups: extra answers the gateway draws for a served turn's exact prompt, off the critical path
(``counterfactuals``), and per served turn the group they form with it (``counterfactual_groups``: how many were
asked for and drawn, and the served answer's score on the siblings' terms).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 13:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "counterfactual_groups",
        sa.Column("call_id", sa.String(40), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("drawn", sa.Integer(), nullable=False),
        sa.Column("served_reward", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("judged_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["call_id"], ["calls.id"], name="fk_counterfactual_groups_call_id_calls"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_counterfactual_groups_rollout_id_rollouts"),
        sa.PrimaryKeyConstraint("call_id", name="pk_counterfactual_groups"),
    )
    op.create_index("ix_counterfactual_groups_rollout_id", "counterfactual_groups", ["rollout_id"])
    op.create_table(
        "counterfactuals",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("call_id", sa.String(40), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("adapter", sa.String(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("engine", sa.String(), nullable=False),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("completion_ids", sa.LargeBinary(), nullable=False),
        sa.Column("completion_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("completion_len", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("details", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["call_id"], ["calls.id"], name="fk_counterfactuals_call_id_calls"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name="fk_counterfactuals_rollout_id_rollouts"),
        sa.PrimaryKeyConstraint("id", name="pk_counterfactuals"),
    )
    op.create_index("ix_counterfactuals_call_id", "counterfactuals", ["call_id"])
    op.create_index("ix_counterfactuals_rollout_id", "counterfactuals", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_counterfactuals_rollout_id", table_name="counterfactuals")
    op.drop_index("ix_counterfactuals_call_id", table_name="counterfactuals")
    op.drop_table("counterfactuals")
    op.drop_index("ix_counterfactual_groups_rollout_id", table_name="counterfactual_groups")
    op.drop_table("counterfactual_groups")
