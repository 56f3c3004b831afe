"""A counterfactual group is opened when its draw starts (``drawing_until``: the time by which its siblings are
recorded or given up), so the reward worker waits for a group being drawn instead of judging its turn alone.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 05:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("counterfactual_groups") as batch:
        batch.add_column(sa.Column("drawing_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("counterfactual_groups") as batch:
        batch.drop_column("drawing_until")
