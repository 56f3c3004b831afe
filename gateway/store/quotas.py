"""Quotas in the database: the limits set on tenants and keys, and the usage every gateway process counts.

A quota's subject is ``tenant:NAME`` (all of a tenant's calls, through any of its keys) or ``key:ID`` (one
database key). ``quota_usage`` holds, per subject and minute, the requests and tokens every process has added;
``gateway/tenants/quotas.py`` reads and adds to it a few times a second and decides each call on what it read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from gateway.store.errors import InvalidInput, RecordNotFound
from gateway.store.models import ApiKey, QuotaUsage, Tenant


@dataclass(frozen=True, slots=True)
class Limits:
    """Requests and tokens (prompt + completion) per minute; None: no limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __bool__(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def tenant_subject(name: str) -> str:
    return f"tenant:{name}"


def key_subject(key_id: str) -> str:
    return f"key:{key_id}"


_UNSET = object()


def set_limits(
    db: sa.Engine,
    *,
    tenant: str | None = None,
    key_id: str | None = None,
    requests_per_minute: int | object | None = _UNSET,
    tokens_per_minute: int | object | None = _UNSET,
) -> Limits:
    """Set (an int), remove (None) or keep (not given) a tenant's or a key's limits; returns them as they are now.
    A tenant is created by its first limit (the default tenant's keys are the environment's)."""
    if (tenant is None) == (key_id is None):
        raise InvalidInput("name a tenant or a key", param="tenant")
    for name, value in (("requests_per_minute", requests_per_minute), ("tokens_per_minute", tokens_per_minute)):
        if value is not _UNSET and value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidInput(f"{name} must be a positive integer (or none, for no limit)", param=name)
    with Session(db) as session, session.begin():
        row: Tenant | ApiKey | None
        if tenant is not None:
            row = session.get(Tenant, tenant)
            if row is None:
                from gateway.store.api_keys import check_tenant_name

                try:
                    check_tenant_name(tenant)
                except ValueError as exc:
                    raise InvalidInput(str(exc), param="tenant") from None
                row = Tenant(name=tenant)
                session.add(row)
        else:
            row = session.get(ApiKey, key_id)
            if row is None:
                raise RecordNotFound(f"api key {key_id!r} not found", param="id")
        if requests_per_minute is not _UNSET:
            row.requests_per_minute = requests_per_minute  # type: ignore[assignment]
        if tokens_per_minute is not _UNSET:
            row.tokens_per_minute = tokens_per_minute  # type: ignore[assignment]
        session.flush()
        return Limits(row.requests_per_minute, row.tokens_per_minute)


def all_limits(db: sa.Engine) -> dict[str, Limits]:
    """Every subject with a limit, by subject."""
    found: dict[str, Limits] = {}
    with Session(db) as session:
        for name, rpm, tpm in session.execute(
            sa.select(Tenant.name, Tenant.requests_per_minute, Tenant.tokens_per_minute).where(
                sa.or_(Tenant.requests_per_minute.is_not(None), Tenant.tokens_per_minute.is_not(None))
            )
        ):
            found[tenant_subject(name)] = Limits(rpm, tpm)
        for kid, rpm, tpm in session.execute(
            sa.select(ApiKey.id, ApiKey.requests_per_minute, ApiKey.tokens_per_minute).where(
                ApiKey.revoked_at.is_(None),
                sa.or_(ApiKey.requests_per_minute.is_not(None), ApiKey.tokens_per_minute.is_not(None)),
            )
        ):
            found[key_subject(kid)] = Limits(rpm, tpm)
    return found


def add_usage(db: sa.Engine, counts: Mapping[tuple[str, int], tuple[int, int]]) -> None:
    """Add ``(requests, tokens)`` to each ``(subject, minute)``, in one transaction (an upsert each)."""
    if not counts:
        return
    rows = [{"subject": s, "minute": m, "requests": r, "tokens": t} for (s, m), (r, t) in counts.items()]
    with db.begin() as connection:
        insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
        statement = insert(QuotaUsage)
        statement = statement.on_conflict_do_update(
            index_elements=["subject", "minute"],
            set_={
                "requests": QuotaUsage.requests + statement.excluded.requests,
                "tokens": QuotaUsage.tokens + statement.excluded.tokens,
            },
        )
        connection.execute(statement, sorted(rows, key=lambda r: (r["subject"], r["minute"])))


def usage(db: sa.Engine, subjects: Iterable[str], minutes: Iterable[int]) -> dict[tuple[str, int], tuple[int, int]]:
    """The ``(requests, tokens)`` counted for each of ``subjects`` in each of ``minutes`` (absent: none)."""
    subjects, minutes = list(subjects), list(minutes)
    if not subjects:
        return {}
    query = sa.select(QuotaUsage.subject, QuotaUsage.minute, QuotaUsage.requests, QuotaUsage.tokens).where(
        QuotaUsage.subject.in_(subjects), QuotaUsage.minute.in_(minutes)
    )
    with db.connect() as connection:
        return {(s, m): (int(r), int(t)) for s, m, r, t in connection.execute(query)}


def prune_usage(db: sa.Engine, before_minute: int) -> int:
    """Delete the counts of minutes before ``before_minute`` (no limit looks further back than a minute)."""
    with db.begin() as connection:
        return connection.execute(sa.delete(QuotaUsage).where(QuotaUsage.minute < before_minute)).rowcount or 0


@dataclass(frozen=True, slots=True)
class Quota:
    """A subject with its limits, as listed to an operator."""

    subject: str
    tenant: str
    key_id: str | None
    limits: Limits


def quotas(db: sa.Engine, tenant: str | None = None) -> list[Quota]:
    """The tenants and unrevoked keys with a limit (of one tenant, or all), tenants first."""
    out: list[Quota] = []
    with Session(db) as session:
        query = sa.select(Tenant).where(
            sa.or_(Tenant.requests_per_minute.is_not(None), Tenant.tokens_per_minute.is_not(None))
        )
        if tenant is not None:
            query = query.where(Tenant.name == tenant)
        for t in session.scalars(query.order_by(Tenant.name)):
            out.append(Quota(tenant_subject(t.name), t.name, None, Limits(t.requests_per_minute, t.tokens_per_minute)))
        keys = sa.select(ApiKey).where(
            ApiKey.revoked_at.is_(None),
            sa.or_(ApiKey.requests_per_minute.is_not(None), ApiKey.tokens_per_minute.is_not(None)),
        )
        if tenant is not None:
            keys = keys.where(ApiKey.tenant == tenant)
        for k in session.scalars(keys.order_by(ApiKey.tenant, ApiKey.id)):
            out.append(Quota(key_subject(k.id), k.tenant, k.id, Limits(k.requests_per_minute, k.tokens_per_minute)))
    return out


def key_tenant(db: sa.Engine, key_id: str) -> str | None:
    with Session(db) as session:
        row = session.get(ApiKey, key_id)
        return row.tenant if row is not None else None
