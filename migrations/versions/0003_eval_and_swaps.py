"""Evaluation rollouts, finish reasons, and when each policy version went live.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 11:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("eval", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch.add_column(sa.Column("finish_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("current_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("current_at")
        batch.drop_column("loaded_at")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("finish_reason")
        batch.drop_column("eval")
