"""Files `clawgate export` wrote and the rollouts in each, so that forgetting a rollout also removes it from them
(``models.Export``, ``models.ExportRollout``, ``gateway/store/exports.py``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 19:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "exports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_exports"),
    )
    op.create_table(
        "export_rollouts",
        sa.Column(
            "export_id",
            sa.Integer(),
            sa.ForeignKey("exports.id", name="fk_export_rollouts_export_id_exports"),
            nullable=False,
        ),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("export_id", "rollout_id", name="pk_export_rollouts"),
    )
    op.create_index("ix_export_rollouts_rollout_id", "export_rollouts", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_export_rollouts_rollout_id", table_name="export_rollouts")
    op.drop_table("export_rollouts")
    op.drop_table("exports")
