"""Guarded promotion: a published version's stage, the canary it serves, and every decision taken on it.

- ``policy_versions.stage``: ``candidate`` (published, not yet serving), ``canary`` (serving a share of new
  conversations beside the incumbent), ``promoted`` (served to everything outside a canary; the newest promoted
  version is the incumbent) or ``rejected``. Versions published before this revision were all served: promoted.
- ``policy_versions.stage_at``: when the stage last changed (a canary's start, for its time limit).
- ``policy_versions.canary_share``: the share of new conversations the candidate serves, fixed when its canary
  starts so that every gateway assigns conversations alike.
- ``policy_control.promotion``: ``guarded`` or ``immediate``, as the gateways last said; the trainer reads it to
  publish candidates (guarded) or promoted versions (immediate).
- ``promotion_decisions``: each stage change with its reason and the evidence it rested on.
- ``ix_calls_policy_version_started_at``: a canary's evidence is the calls each arm served since it began.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("stage", sa.String(), nullable=False, server_default="promoted"))
        batch.add_column(sa.Column("stage_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("canary_share", sa.Float(), nullable=True))
    with op.batch_alter_table("policy_control") as batch:
        batch.add_column(sa.Column("promotion", sa.String(), nullable=True))
    op.create_table(
        "promotion_decisions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("incumbent_version", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("evidence", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("decided_by", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_promotion_decisions"),
    )
    op.create_index("ix_promotion_decisions_version", "promotion_decisions", ["version"])
    op.create_index("ix_calls_policy_version_started_at", "calls", ["policy_version", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_calls_policy_version_started_at", table_name="calls")
    op.drop_index("ix_promotion_decisions_version", table_name="promotion_decisions")
    op.drop_table("promotion_decisions")
    with op.batch_alter_table("policy_control") as batch:
        batch.drop_column("promotion")
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("canary_share")
        batch.drop_column("stage_at")
        batch.drop_column("stage")
