"""Tenant keys and quotas: what checking a key costs per call, from the cache and from the database, and what a
quota check costs.

1. ``require_client`` (the serving routes' key check, as a request goes through it) with an environment key, a
   tenant key from the cache, and a tenant key read from the database on every call (the cache's TTL set to 0).
2. The database read alone (one primary-key row and an HMAC), on SQLite and on Postgres.
3. A quota check (``QuotaBook.admit``, in memory) with a tenant and a key limit, and with none; one exchange of the
   counts with the database (``QuotaBook.sync``: an upsert, the limits, the totals), which runs 4 times a second.

    .venv/bin/python bench/tenant_keys.py [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from starlette.requests import Request  # noqa: E402

from gateway import deps  # noqa: E402
from gateway.state import AppState  # noqa: E402
from gateway.store import api_keys, db, quotas  # noqa: E402
from gateway.store.quotas import Limits  # noqa: E402
from gateway.tenants.cache import KeyCache  # noqa: E402
from gateway.tenants.principal import Principal  # noqa: E402
from gateway.tenants.quotas import QuotaBook  # noqa: E402

SECRET = b"bench-secret"


class _Settings:
    def __init__(self, keys: list[str]) -> None:
        self.api_keys = keys


def request_with(key: str) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"authorization", f"Bearer {key}".encode())], "query_string": b""}  # fmt: skip
    return Request(scope)


def per_call_us(fn: Any, n: int) -> float:
    """Microseconds per awaited call, the median of 5 runs of ``n``."""

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await fn()
        return (time.perf_counter() - start) / n * 1e6

    return statistics.median(asyncio.run(run()) for _ in range(5))


def measure(url: str, label: str) -> None:
    db.upgrade(url)
    engine = db.connect(url)
    _, key = api_keys.create(engine, "bench", secret=SECRET)
    state: Any = AppState.__new__(AppState)
    state.settings = _Settings(["env-client-key"])
    state.keys = KeyCache(engine, SECRET, ttl=3600)
    env_request, tenant_request = request_with("env-client-key"), request_with(key)
    print(f"{label}:")
    rows = [
        ("environment key, require_client", lambda: deps.require_client(env_request, state), 20000),
        ("tenant key from the cache", lambda: deps.require_client(tenant_request, state), 20000),
        ("KeyCache.check alone (cache hit)", lambda: state.keys.check(key), 20000),
    ]
    for what, fn, n in rows:
        print(f"  {what + ':':<40}{per_call_us(fn, n):8.2f} us/call")
    state.keys = KeyCache(engine, SECRET, ttl=1e-9)
    uncached = per_call_us(lambda: deps.require_client(tenant_request, state), 300)
    print(f"  {'tenant key read from the database:':<40}{uncached:8.2f} us/call")
    lookups = []
    for _ in range(300):
        start = time.perf_counter()
        api_keys.lookup(engine, key, SECRET)
        lookups.append((time.perf_counter() - start) * 1e3)
    print(f"  lookup (row + HMAC), median / p99:     {statistics.median(lookups):.3f} / "
          f"{sorted(lookups)[int(len(lookups) * 0.99)]:.3f} ms")  # fmt: skip
    book = QuotaBook(engine)
    principal = Principal(tenant="bench", role="user", key_id="0123456789ab")
    free = Principal(tenant="other", role="user")
    book.limits = {"tenant:bench": Limits(10**9, 10**12), "key:0123456789ab": Limits(10**9, 10**12)}

    async def admit(p: Principal) -> None:
        book.admit(p)

    print(f"  {'quota check, tenant + key limits:':<40}{per_call_us(lambda: admit(principal), 20000):8.2f} us/call")
    print(f"  {'quota check, no limit:':<40}{per_call_us(lambda: admit(free), 20000):8.2f} us/call")
    quotas.set_limits(engine, tenant="bench", requests_per_minute=10**9)
    syncs = []
    for _ in range(50):
        book.admit(principal)
        start = time.perf_counter()
        asyncio.run(book.sync())
        syncs.append((time.perf_counter() - start) * 1e3)
    print(f"  {'quota counts exchange, median:':<40}{statistics.median(syncs):8.2f} ms (4 per second)")
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", help="a Postgres server URL (default: 127.0.0.1:5432, else a throw-away one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(f"sqlite:///{tmp}/keys.db", "SQLite")
    from tests import pg

    with pg.postgres_server(args.postgres) as server, pg.fresh_database(server) as url:
        measure(url, "Postgres")


if __name__ == "__main__":
    main()
