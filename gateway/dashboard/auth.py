"""The console's login: the admin key, typed once into a form, becomes a signed session cookie.

The key never travels in a URL and is never stored in the cookie. The cookie holds an expiry and a random nonce,
signed with HMAC-SHA256 under a secret derived from the admin key, so rotating the admin key logs everyone out. A
tenant's admin key signs in too: its session also names the key's public id, and each page checks that the key
is still valid (revoking it ends the session).
Written here rather than pulled from a session library because it is a dozen lines over ``hmac`` and the gateway
keeps no server-side session store.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

COOKIE = "clawgate_console"
LIFETIME_S = 12 * 3600


def _secret(admin_key: str) -> bytes:
    return hashlib.sha256(b"clawgate-console\0" + admin_key.encode()).digest()


def _sign(admin_key: str, payload: str) -> str:
    return hmac.new(_secret(admin_key), payload.encode(), hashlib.sha256).hexdigest()


def issue(admin_key: str, now: float | None = None, key_id: str | None = None) -> str:
    """A new session token, valid for ``LIFETIME_S``: the global admin's, or (``key_id``) a tenant admin key's."""
    expires = int((now if now is not None else time.time()) + LIFETIME_S)
    payload = f"{expires}.{secrets.token_hex(12)}" + (f".{key_id}" if key_id else "")
    return f"{payload}.{_sign(admin_key, payload)}"


def session(admin_key: str, token: str | None, now: float | None = None) -> str | None:
    """Whose session ``token`` is, if it was issued under ``admin_key`` and has not expired: ``""`` for the global
    admin, a tenant admin key's id, or None."""
    parts = token.split(".") if token else []
    if len(parts) not in (3, 4):
        return None
    payload, signature = ".".join(parts[:-1]), parts[-1]
    if not hmac.compare_digest(_sign(admin_key, payload), signature):
        return None
    try:
        alive = int(parts[0]) > (now if now is not None else time.time())
    except ValueError:
        return None
    return (parts[2] if len(parts) == 4 else "") if alive else None


def valid(admin_key: str, token: str | None, now: float | None = None) -> bool:
    """Whether ``token`` was issued under ``admin_key`` and has not expired."""
    return session(admin_key, token, now) is not None


__all__ = ["COOKIE", "LIFETIME_S", "issue", "session", "valid"]
