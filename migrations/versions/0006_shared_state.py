"""Shared state for several gateway processes on one database: answer hashes, stored responses, adapter leases.

- ``calls.output_hash``: identifies the call's answer by its content, so any gateway can tell that an assistant
  turn it cannot splice was generated here (drift), not only the process that served it.
- ``stored_responses``: Responses-API answers that a later request may continue by ``previous_response_id``, each
  holding only the conversation items it added (its new input items and its answer) and a link to the response
  it continued.
- ``gateway_adapters``: which policy adapters each live gateway still runs calls on (a heartbeat), so no gateway
  unloads a version that another one sharing the engine still uses.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 01:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("output_hash", sa.String(32), nullable=True))
    op.create_index("ix_calls_output_hash", "calls", ["output_hash"])
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("call_id", sa.String(40), nullable=True),
        sa.Column("previous_id", sa.String(64), nullable=True),
        sa.Column("stored", sa.Boolean(), nullable=False),
        sa.Column("items", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
    )
    op.create_table(
        "gateway_adapters",
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.Column("adapter", sa.String(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("gateway_id", "adapter", name="pk_gateway_adapters"),
    )
    op.create_index("ix_gateway_adapters_adapter", "gateway_adapters", ["adapter"])


def downgrade() -> None:
    op.drop_index("ix_gateway_adapters_adapter", table_name="gateway_adapters")
    op.drop_table("gateway_adapters")
    op.drop_table("stored_responses")
    op.drop_index("ix_calls_output_hash", table_name="calls")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("output_hash")
