"""Tenants and their keys (``models.Tenant``, ``models.ApiKey``, ``gateway/tenants``); the tenant of each rollout and
stored Responses answer; quotas of tenants and keys and the usage counted against them (``quota_usage``: requests and
tokens per subject and minute). Existing data belongs to the tenant ``default``, as do the keys of
``CLAWGATE_API_KEYS``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_tenants"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column(
            "tenant", sa.String(64), sa.ForeignKey("tenants.name", name="fk_api_keys_tenant_tenants"), nullable=False
        ),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
    )
    op.create_table(
        "quota_usage",
        sa.Column("subject", sa.String(80), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("subject", "minute", name="pk_quota_usage"),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("tenant", sa.String(64), nullable=False, server_default="default"))
    op.create_index("ix_rollouts_tenant", "rollouts", ["tenant"])
    with op.batch_alter_table("stored_responses") as batch:
        batch.add_column(sa.Column("tenant", sa.String(64), nullable=False, server_default="default"))


def downgrade() -> None:
    with op.batch_alter_table("stored_responses") as batch:
        batch.drop_column("tenant")
    op.drop_index("ix_rollouts_tenant", table_name="rollouts")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("tenant")
    op.drop_table("quota_usage")
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
