"""Indexes for retention and forgetting (``gateway/store/retention.py``).

Deleting a rollout or a call looks up the rows that name it. ``rewards``, ``calls`` and the trained-row tables
already had an index for each such lookup but four: without them every deletion batch scanned those tables whole
(measured on Postgres with a million calls: about 1,200 rows deleted a second).

- ``judgements.rollout_id``, ``trained_turns.rollout_id``: rows of a rollout being deleted;
- ``stored_responses.call_id``, ``stored_responses.previous_id``: the Responses-API answers stored with a deleted
  call, and those that continued them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 15:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = [
    ("ix_judgements_rollout_id", "judgements", "rollout_id"),
    ("ix_trained_turns_rollout_id", "trained_turns", "rollout_id"),
    ("ix_stored_responses_call_id", "stored_responses", "call_id"),
    ("ix_stored_responses_previous_id", "stored_responses", "previous_id"),
]


def upgrade() -> None:
    for name, table, column in INDEXES:
        op.create_index(name, table, [column])


def downgrade() -> None:
    for name, table, _ in INDEXES:
        op.drop_index(name, table_name=table)
