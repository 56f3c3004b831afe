"""Which policy adapters each gateway still needs loaded: heartbeats shared through the database.

Several gateway processes may serve through one engine (vLLM). Each unloads old versions on its own (its policy
follower keeps the newest few), but a version it no longer serves may still be another gateway's current one, or
have that gateway's calls running on it. So every gateway reports, every few seconds, the adapters it serves or
has calls on (one row per gateway and adapter in ``gateway_adapters``, ``seen_at`` refreshed), and a version is
unloaded only when no *live* gateway reports it. A gateway that stopped reporting (killed, partitioned) counts
as gone once its rows are older than the lease, so it cannot keep a version loaded forever.

``users`` is the pure rule; the rest are small synchronous transactions (run them in a worker thread).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store.models import GatewayAdapter, utcnow


def new_gateway_id() -> str:
    """An id for this gateway process: readable (host, pid) and unique across restarts."""
    return f"{socket.gethostname()[:32]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def users(
    rows: Iterable[tuple[str, str, dt.datetime]], adapter: str, *, me: str, now: dt.datetime, lease: dt.timedelta
) -> set[str]:
    """The other live gateways that report ``adapter``: rows are (gateway_id, adapter, seen_at)."""
    return {gw for gw, name, seen in rows if name == adapter and gw != me and now - seen <= lease}


def heartbeat(db: sa.Engine, gateway_id: str, adapters: Iterable[str]) -> None:
    """Report exactly ``adapters`` for this gateway (refreshing their time), in one transaction."""
    now = utcnow()
    names = sorted(set(adapters))
    with Session(db) as session, session.begin():
        session.execute(sa.delete(GatewayAdapter).where(GatewayAdapter.gateway_id == gateway_id))
        session.add_all(GatewayAdapter(gateway_id=gateway_id, adapter=name, seen_at=now) for name in names)


def forget(db: sa.Engine, gateway_id: str) -> None:
    """This gateway stops: it reports nothing any more."""
    with Session(db) as session, session.begin():
        session.execute(sa.delete(GatewayAdapter).where(GatewayAdapter.gateway_id == gateway_id))


def used_elsewhere(db: sa.Engine, gateway_id: str, adapter: str, lease_seconds: float) -> set[str]:
    """The other live gateways that still serve ``adapter`` or run calls on it."""
    with Session(db) as session:
        rows = session.execute(
            sa.select(GatewayAdapter.gateway_id, GatewayAdapter.adapter, GatewayAdapter.seen_at).where(
                GatewayAdapter.adapter == adapter
            )
        ).all()
    lease = dt.timedelta(seconds=lease_seconds)
    return users([r.tuple() for r in rows], adapter, me=gateway_id, now=utcnow(), lease=lease)
