"""Policy lineages: a tenant may have a policy of its own (``tenants.own_policy``), trained only on its traffic and
served only to its keys. Each published version belongs to one lineage (``policy_versions.lineage``: the tenant's
name, or "" for the shared policy); version numbers stay global. The operator's pin, rollback and promotion mode are
held per lineage (``policy_control.lineage``; the existing row is the shared lineage's).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 08:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("own_policy", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("lineage", sa.String(64), nullable=False, server_default=""))
    op.create_index("ix_policy_versions_lineage", "policy_versions", ["lineage", "version"])
    with op.batch_alter_table("policy_control") as batch:
        batch.add_column(sa.Column("lineage", sa.String(64), nullable=False, server_default=""))
        batch.create_unique_constraint("uq_policy_control_lineage", ["lineage"])


def downgrade() -> None:
    with op.batch_alter_table("policy_control") as batch:
        batch.drop_constraint("uq_policy_control_lineage", type_="unique")
        batch.drop_column("lineage")
    op.drop_index("ix_policy_versions_lineage", table_name="policy_versions")
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("lineage")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("own_policy")
