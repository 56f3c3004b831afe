"""The console's login: the admin key, typed once into a form, becomes a signed session cookie.

The key never travels in a URL and is never stored in the cookie. The cookie holds an expiry and a random nonce,
signed with HMAC-SHA256 under a secret derived from the admin key, so rotating the admin key logs everyone out.
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


def issue(admin_key: str, now: float | None = None) -> str:
    """A new session token, valid for ``LIFETIME_S``."""
    expires = int((now if now is not None else time.time()) + LIFETIME_S)
    payload = f"{expires}.{secrets.token_hex(12)}"
    return f"{payload}.{_sign(admin_key, payload)}"


def valid(admin_key: str, token: str | None, now: float | None = None) -> bool:
    """Whether ``token`` was issued under ``admin_key`` and has not expired."""
    if not token or token.count(".") != 2:
        return False
    expires, nonce, signature = token.split(".")
    if not hmac.compare_digest(_sign(admin_key, f"{expires}.{nonce}"), signature):
        return False
    try:
        return int(expires) > (now if now is not None else time.time())
    except ValueError:
        return False


__all__ = ["COOKIE", "LIFETIME_S", "issue", "valid"]
