"""Credentials found in captured calls (``gateway/credentials``, ``models.SecretFinding``).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 18:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "secret_findings",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column(
            "call_id", sa.String(40), sa.ForeignKey("calls.id", name="fk_secret_findings_call_id_calls"), nullable=False
        ),
        sa.Column(
            "rollout_id",
            sa.String(128),
            sa.ForeignKey("rollouts.id", name="fk_secret_findings_rollout_id_rollouts"),
            nullable=False,
        ),
        sa.Column("part", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("end", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_secret_findings"),
        sa.UniqueConstraint("call_id", "part", "start", name="uq_secret_findings_call_id_part_start"),
    )
    op.create_index("ix_secret_findings_rollout_id", "secret_findings", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_secret_findings_rollout_id", table_name="secret_findings")
    op.drop_table("secret_findings")
