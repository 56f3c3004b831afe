"""Evaluation before traffic: a rollout may be served by one named policy version.

- ``rollouts.policy_version``: every call of the rollout is served by this version (an evaluation of a version
  that serves no traffic yet: the evaluation gate of guarded promotion, or ``clawgate rollout --policy-version``).
  NULL: the gateway routes its calls as any other (the incumbent, or a canary's arm).

The ``evaluating`` stage of ``policy_versions.stage`` needs no change to the schema (the column is a string).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 12:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("policy_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("policy_version")
