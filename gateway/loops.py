"""The background loops every gateway process runs beside serving: closing idle session rollouts, the adapter
heartbeat, the quota counters' exchange and (with CLAWGATE_RETENTION_DAYS) retention. Each keeps trying while the
database is down and says so once (``gateway/faults.py``)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from gateway.core.service import ChatService
from gateway.faults import Fault, describe
from gateway.state import AppState
from gateway.store import adapter_leases, retention, rollout_lifecycle
from gateway.store.writer import CallWriter

log = logging.getLogger("clawgate")


def start_loops(state: AppState, gateway_id: str) -> list[asyncio.Task[None]]:
    """The idle-session closer, the adapter heartbeat, the quota counters' exchange and (with
    CLAWGATE_RETENTION_DAYS) retention, running."""
    settings, database = state.settings, state.db
    assert state.quotas is not None
    tasks = [
        asyncio.create_task(state.quotas.run()),
        asyncio.create_task(close_idle_sessions(database, state.writer, state.service, settings.session_idle_timeout)),
        asyncio.create_task(report_adapters(database, gateway_id, state.service, settings.adapter_heartbeat_interval)),
    ]
    if settings.retention_days is not None:
        tasks.append(
            asyncio.create_task(
                apply_retention(database, state.writer, settings.retention_days, settings.retention_interval)
            )
        )
    return tasks


async def close_idle_sessions(
    database: sa.Engine, writer: CallWriter, service: ChatService, idle_seconds: float
) -> None:
    """Finish implicit and harness-session rollouts nobody has used for ``idle_seconds`` (they have no explicit end),
    and learn which ones other gateway processes finished (so none of their conversations is extended here)."""
    interval = min(60.0, idle_seconds / 4)
    fault = Fault(log, "session closer: cannot close idle sessions")
    since = datetime.now(UTC)
    while True:
        await asyncio.sleep(interval)
        if writer.degraded:
            continue  # the writer reports the outage; closing must wait until the calls before it are stored
        try:
            await writer.flush()
            closed = await asyncio.to_thread(rollout_lifecycle.close_idle, database, idle_seconds)
            # Overlapping windows: a close committed while the last look ran is not missed.
            looked, since = since, datetime.now(UTC) - timedelta(seconds=interval)
            service.close_rollouts(await asyncio.to_thread(rollout_lifecycle.closed_since, database, looked))
        except Exception as exc:  # the database may be down; try again later
            fault.failed(describe(exc), exc)
            continue
        fault.cleared()
        if closed:
            service.close_rollouts(closed)
            log.info("closed %d idle session rollout(s)", len(closed))


async def apply_retention(database: sa.Engine, writer: CallWriter, days: float, interval: float) -> None:
    """Every ``interval`` seconds, delete the rollouts idle for ``days`` (``retention.prune``) and the spool lines
    older than that in this process's own spool directory."""
    fault = Fault(log, "retention: cannot prune captured traffic")
    window = timedelta(days=days)
    while True:
        try:
            report = await asyncio.to_thread(retention.prune, database, older_than=window)
            lines, files = await writer.clean_spool(cutoff=datetime.now(UTC) - window)
        except Exception as exc:  # the database may be down; the next run catches up
            fault.failed(describe(exc), exc)
        else:
            fault.cleared()
            if report.rows or lines or files:
                log.info(
                    "retention (%g days): deleted %d rows (%s), %d spool lines, %d pending files",
                    days,
                    report.rows,
                    ", ".join(f"{n} {table}" for table, n in report.deleted.items() if n),
                    lines,
                    files,
                )
        await asyncio.sleep(interval)


async def report_adapters(database: sa.Engine, gateway_id: str, service: ChatService, interval: float) -> None:
    """Heartbeat the adapters this gateway serves or runs calls on, so no other gateway unloads them."""
    fault = Fault(log, "adapter heartbeat: cannot report the adapters in use")
    reported: set[str] | None = None
    while True:
        in_use = {name for name, n in service.adapter_in_flight.items() if n > 0}
        in_use.update(arm.adapter for arm in service.routing.arms() if arm.adapter is not None)
        if not in_use and reported == set():  # serving the base model: nothing to keep loaded, nothing to write
            await asyncio.sleep(interval)
            continue
        try:
            await asyncio.to_thread(adapter_leases.heartbeat, database, gateway_id, in_use)
        except Exception as exc:
            fault.failed(describe(exc), exc)
        else:
            reported = in_use
            fault.cleared()
        await asyncio.sleep(interval)
