"""A counterfactual sibling's answer as the served call's parser read it (``message``: content, reasoning, tool
calls) and the credentials found in it (``secret_spans``), so siblings are judged, trained and shown on the terms
their served call is.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("counterfactuals") as batch:
        batch.add_column(sa.Column("message", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("secret_spans", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("counterfactuals") as batch:
        batch.drop_column("secret_spans")
        batch.drop_column("message")
