"""Policy control: the operator's pin on a served version and a requested rollback.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_control",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("pinned_version", sa.Integer(), nullable=True),
        sa.Column("rollback_to", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_policy_control"),
    )
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("parent_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("rolled_back_from", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("rolled_back_from")
        batch.drop_column("parent_version")
    op.drop_table("policy_control")
