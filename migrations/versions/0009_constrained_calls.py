"""Grammar-constrained calls: ``calls.constrained``.

- ``calls.constrained``: the completion was sampled under a grammar (a JSON schema, a forced tool call), so its
  recorded logprobs are the masked distribution's. The prefix tree keeps such a completion as context: the
  trainer recomputes unmasked logprobs, and comparing the two would give a spurious importance ratio. Existing
  rows were all sampled without a grammar: false.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("constrained", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("constrained")
