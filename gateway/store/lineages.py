"""Policy lineages: which tenants have a policy of their own, and which traffic each lineage trains on.

A tenant with ``own_policy`` has a lineage named after it: versions trained only on its rollouts and turns, served
only to its keys. Every other tenant shares the shared lineage (``policy_versions.SHARED``), which trains on the
traffic of every tenant without a policy of its own. ``scope`` is that split as a condition on ``Rollout``: the
trainer adds it to every query that selects data (``readiness.py``, ``turns.py``), so a lineage's batches can only
hold its own tenant's data.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store.models import Rollout, Tenant
from gateway.store.policy_versions import SHARED


def scope(lineage: str | None) -> tuple[sa.ColumnElement[bool], ...]:
    """The rollouts whose data ``lineage`` trains on (None: every rollout, for counts over all lineages)."""
    if lineage is None:
        return ()
    if lineage == SHARED:
        own = sa.select(Tenant.name).where(Tenant.own_policy.is_(True))
        return (Rollout.tenant.not_in(own),)
    return (Rollout.tenant == lineage,)


def own_policies(db: sa.Engine) -> list[str]:
    """The tenants with a policy of their own, by name."""
    with Session(db) as session:
        query = sa.select(Tenant.name).where(Tenant.own_policy.is_(True)).order_by(Tenant.name)
        return list(session.scalars(query))


def set_own_policy(db: sa.Engine, tenant: str, on: bool) -> bool:
    """Give ``tenant`` a policy of its own (``on``) or put it back on the shared one; returns what it had before.
    A tenant that has no key yet is created."""
    with Session(db) as session, session.begin():
        row = session.get(Tenant, tenant, with_for_update=True)
        if row is None:
            row = Tenant(name=tenant, created_at=dt.datetime.now(dt.UTC))
            session.add(row)
        before, row.own_policy = bool(row.own_policy), on
        return before


__all__ = ["own_policies", "scope", "set_own_policy"]
