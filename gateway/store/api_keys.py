"""Tenant keys in the database: created (shown once), listed, revoked, checked.

A key reads ``cgk-<id>-<secret>``: ``id`` (12 hex digits) is its public part, the row's primary key, so a check
reads one row; ``secret`` is 256 random bits. Only ``HMAC-SHA256(server secret, key)`` is stored. With 256-bit
random keys a fast keyed hash is the standard choice (a slow password hash such as scrypt defends low-entropy
passwords, and would cost milliseconds on every uncached check); the server secret (``CLAWGATE_KEY_SECRET``) means
a copy of the database alone cannot even test a guess. Changing that secret invalidates every key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store.errors import InvalidInput, RecordNotFound
from gateway.store.models import ApiKey, Tenant, utcnow

PREFIX = "cgk-"
_KEY = re.compile(r"cgk-([0-9a-f]{12})-[A-Za-z0-9_-]{43}")
ROLES = ("user", "admin")
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
# Without CLAWGATE_KEY_SECRET keys are hashed under this public label: still safe for 256-bit keys, but a stolen
# database then suffices to check a guessed key.
_UNSET_SECRET = b"clawgate-keys-v1"


def check_tenant_name(name: str) -> str:
    """A tenant name as stored: lower-case letters, digits, ``_``, ``.`` and ``-``, at most 64 characters."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"invalid tenant name {name!r}: 1-64 characters of a-z, 0-9, '_', '.', '-', starting with a letter or digit"
        )
    return name


def key_id(key: str) -> str | None:
    """The public id of a well-formed tenant key, else None."""
    m = _KEY.fullmatch(key)
    return m.group(1) if m else None


def hash_key(key: str, secret: bytes | None) -> str:
    return hmac.new(secret or _UNSET_SECRET, key.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    tenant: str
    role: str
    name: str | None
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "object": "api_key",
            "id": self.id,
            "tenant": self.tenant,
            "role": self.role,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
        }


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        row.id,
        row.tenant,
        row.role,
        row.name,
        row.created_at,
        row.expires_at,
        row.revoked_at,
        row.requests_per_minute,
        row.tokens_per_minute,
    )


def create(
    db: sa.Engine,
    tenant: str,
    *,
    role: str = "user",
    name: str | None = None,
    expires_at: dt.datetime | None = None,
    secret: bytes | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> tuple[KeyInfo, str]:
    """A new key for ``tenant`` (created on its first key) and the key itself, which is never stored."""
    try:
        check_tenant_name(tenant)
    except ValueError as exc:
        raise InvalidInput(str(exc), param="tenant") from None
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}, not {role!r}", param="role")
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidInput("expires_at is in the past", param="expires_at")
    if name is not None and len(name) > 200:
        raise InvalidInput("name is longer than 200 characters", param="name")
    for param, limit in (("requests_per_minute", requests_per_minute), ("tokens_per_minute", tokens_per_minute)):
        if limit is not None and limit < 1:
            raise InvalidInput(f"{param} must be a positive integer (or none, for no limit)", param=param)
    kid = secrets.token_hex(6)
    key = f"{PREFIX}{kid}-{secrets.token_urlsafe(32)}"
    with Session(db) as session, session.begin():
        if session.get(Tenant, tenant) is None:
            session.add(Tenant(name=tenant))
            session.flush()
        row = ApiKey(
            id=kid,
            tenant=tenant,
            role=role,
            key_hash=hash_key(key, secret),
            name=name,
            created_at=utcnow(),
            expires_at=expires_at,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
        )
        session.add(row)
        session.flush()
        info = _info(row)
    return info, key


def list_keys(db: sa.Engine, tenant: str | None = None, *, revoked: bool = False) -> list[KeyInfo]:
    """Keys, newest first: of one tenant or all (``tenant`` None); revoked ones only with ``revoked``."""
    query = sa.select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    if not revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    with Session(db) as session:
        return [_info(row) for row in session.scalars(query)]


def revoke(db: sa.Engine, kid: str, tenant: str | None = None) -> KeyInfo:
    """Revoke a key (idempotent: a revoked key keeps its first revocation time). ``tenant``: only that tenant's
    keys are found (another tenant's id reads "not found")."""
    with Session(db) as session, session.begin():
        row = session.get(ApiKey, kid)
        if row is None or (tenant is not None and row.tenant != tenant):
            raise RecordNotFound(f"api key {kid!r} not found", param="id")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
        session.flush()
        return _info(row)


def lookup(db: sa.Engine, key: str, secret: bytes | None, now: dt.datetime | None = None) -> KeyInfo | None:
    """The key's record if ``key`` is a valid, unrevoked, unexpired key; else None."""
    kid = key_id(key)
    if kid is None:
        return None
    with Session(db) as session:
        row = session.get(ApiKey, kid)
        if row is None:
            return None
        info, stored = _info(row), row.key_hash
    if not hmac.compare_digest(hash_key(key, secret), stored):
        return None
    if info.revoked_at is not None or (info.expires_at is not None and info.expires_at <= (now or utcnow())):
        return None
    return info


def valid_by_id(db: sa.Engine, kid: str, now: dt.datetime | None = None) -> KeyInfo | None:
    """The key with this public id if it is unrevoked and unexpired (a console session's check), else None."""
    with Session(db) as session:
        row = session.get(ApiKey, kid)
        info = _info(row) if row is not None else None
    if info is None or info.revoked_at is not None:
        return None
    if info.expires_at is not None and info.expires_at <= (now or utcnow()):
        return None
    return info


def tenants(db: sa.Engine) -> list[str]:
    with Session(db) as session:
        return list(session.scalars(sa.select(Tenant.name).order_by(Tenant.name)))
