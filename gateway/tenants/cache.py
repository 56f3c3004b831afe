"""Each gateway process's memory of the tenant keys it checked, so a call costs a dict lookup, not a query.

An entry, valid or not, is trusted for ``ttl`` seconds (0.5 by default), then read again: a key revoked on any
process, or expired, is refused everywhere within that time, with no message between processes. While the database
is unreachable a key that was valid stays valid for ``grace`` seconds more (fail-open for known keys, so an outage
does not take serving down with it); an unknown key is then refused with a 503.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from gateway.bounded import LRUDict
from gateway.store.api_keys import KeyInfo, lookup


class KeysUnavailable(RuntimeError):
    """The database cannot be read to check a key this process has not seen valid lately."""


@dataclass(slots=True)
class _Entry:
    info: KeyInfo | None
    checked: float


class KeyCache:
    def __init__(
        self,
        db: sa.Engine,
        secret: bytes | None,
        *,
        ttl: float = 0.5,
        grace: float = 60.0,
        max_keys: int = 4096,
    ) -> None:
        self.db = db
        self.secret = secret
        self.ttl = ttl
        self.grace = grace
        self._entries: LRUDict[str, _Entry] = LRUDict(max_keys)
        self.hits = 0
        self.reads = 0

    def cached(self, key: str) -> KeyInfo | bool | None:
        """The fresh verdict on ``key`` (a ``KeyInfo``, or None for an invalid key), or False if it must be read."""
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry.checked >= self.ttl:
            return False
        self.hits += 1
        return entry.info

    async def check(self, key: str) -> KeyInfo | None:
        """The key's record if it is valid now, else None (``KeysUnavailable`` if that cannot be told)."""
        verdict = self.cached(key)
        if verdict is not False:
            return verdict  # type: ignore[return-value]
        self.reads += 1
        try:
            info = await asyncio.to_thread(lookup, self.db, key, self.secret)
        except SQLAlchemyError as exc:
            entry = self._entries.get(key)
            if entry is not None and entry.info is not None and time.monotonic() - entry.checked < self.grace:
                return entry.info
            raise KeysUnavailable(str(exc)) from exc
        self._entries[key] = _Entry(info, time.monotonic())
        return info

    def forget(self) -> None:
        self._entries.clear()
