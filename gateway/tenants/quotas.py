"""Quotas and rate limits per tenant and per key, enforced across gateway processes through the database.

Each limit is per minute, over a sliding window: the estimate of the last 60 s is this minute's count plus the
previous minute's, weighted by the share of the previous minute still inside the window (the usual sliding-window
counter: exact when the previous minute's traffic was even, off by at most that minute's unevenness otherwise).

Every process keeps the totals it last read for the current and previous minutes, adds its own traffic to them at
once, and every ``interval`` seconds (0.25) writes what it added and reads the totals again (one upsert and one
read, whatever the traffic). A call is decided in memory, before any engine work: a request is refused while the
requests in the window would pass the limit with it, and while the tokens already used (prompt + completion of
the calls that ended) reach the token limit. The error margin: another process's traffic is seen up to one
``interval`` (plus a query) late, so a fleet of P processes may admit up to (P - 1) x (its rate per process) x
``interval`` more than the limit in a burst; tokens are counted when a call ends, so the calls in flight when the
limit is reached may take it past by their own length.

While the database is unreachable the limits stay enforced on what this process knows: the totals it read last
and its own traffic since (fail-open across processes, closed within one); its counts are written once the
database is back, so nothing is lost from the next minutes' totals.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from gateway.errors import RateLimited
from gateway.faults import Fault, describe
from gateway.store import quotas as store
from gateway.store.quotas import Limits
from gateway.tenants.principal import Principal

log = logging.getLogger("clawgate")

WINDOW_S = 60.0
LIMITS_EVERY_S = 1.0  # how often each process reads the limits again (a change reaches every process within it)


def minute_of(now: float) -> int:
    return int(now // WINDOW_S)


def window_estimate(previous: float, current: float, elapsed: float) -> float:
    """The sliding window's count: all of this minute's and the part of the previous minute still in the window."""
    return previous * (1.0 - elapsed / WINDOW_S) + current


def seconds_until_below(previous: float, current: float, elapsed: float, threshold: float) -> float:
    """Seconds until the window's estimate is at most ``threshold``, with no further traffic."""
    if window_estimate(previous, current, elapsed) <= threshold:
        return 0.0
    if current <= threshold and previous > 0:  # within this minute, as the previous one slides out
        return WINDOW_S * (1.0 - (threshold - current) / previous) - elapsed
    # Only once this minute is the previous one: at a point t into the next minute, current * (1 - t/60) <= threshold.
    into_next = WINDOW_S * (1.0 - threshold / current) if current > 0 else 0.0
    return (WINDOW_S - elapsed) + into_next


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    tokens: int = 0


@dataclass(slots=True)
class Meter:
    """The subjects one call counts against; ``charge`` adds its tokens when it ends."""

    book: QuotaBook
    subjects: tuple[str, ...]

    def charge(self, tokens: int) -> None:
        self.book.add(self.subjects, requests=0, tokens=tokens)


@dataclass
class QuotaBook:
    db: sa.Engine
    interval: float = 0.25
    clock: Callable[[], float] = time.time
    limits: dict[str, Limits] = field(default_factory=dict)
    # Totals read from the database (every process's, this one's included as of its last write) and what this
    # process added since, per (subject, minute).
    read: dict[tuple[str, int], _Counts] = field(default_factory=dict)
    pending: dict[tuple[str, int], _Counts] = field(default_factory=dict)
    inflight: dict[tuple[str, int], _Counts] = field(default_factory=dict)
    refused: int = 0
    fault: Fault = field(default_factory=lambda: Fault(log, "quota counters"))
    _pruned_minute: int = -1
    _limits_at: float = -1e9
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def subjects_of(self, principal: Principal) -> tuple[str, ...]:
        subjects = [store.tenant_subject(principal.serving_tenant)]
        if principal.key_id is not None:
            subjects.append(store.key_subject(principal.key_id))
        return tuple(subjects)

    def _count(self, subject: str, minute: int) -> _Counts:
        total = _Counts()
        for counts in (self.read, self.inflight, self.pending):
            found = counts.get((subject, minute))
            if found is not None:
                total.requests += found.requests
                total.tokens += found.tokens
        return total

    def admit(self, principal: Principal) -> Meter | None:
        """Count one request against the principal's quotas, or raise ``RateLimited`` (429, Retry-After) when a
        limit is reached. None when no limit applies (nothing to charge)."""
        subjects = self.subjects_of(principal)
        limited = [(s, self.limits[s]) for s in subjects if s in self.limits]
        if not limited:
            return None
        now = self.clock()
        minute, elapsed = minute_of(now), now % WINDOW_S
        waits: list[tuple[float, str]] = []
        for subject, limits in limited:
            previous, current = self._count(subject, minute - 1), self._count(subject, minute)
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            if rpm is not None and window_estimate(previous.requests, current.requests, elapsed) + 1 > rpm:
                wait = seconds_until_below(previous.requests, current.requests, elapsed, rpm - 1)
                waits.append((wait, f"{rpm} requests per minute"))
            if tpm is not None and window_estimate(previous.tokens, current.tokens, elapsed) >= tpm:
                wait = seconds_until_below(previous.tokens, current.tokens, elapsed, tpm - 1)
                waits.append((wait, f"{tpm} tokens per minute"))
            if waits:
                self.refused += 1
                wait, what = max(waits)
                whose = "this key's" if subject.startswith("key:") else "the tenant's"
                raise RateLimited(
                    f"Rate limit reached: {whose} quota of {what}. Retry after {math.ceil(wait)} s.",
                    code="rate_limit_exceeded",
                    retry_after=max(1, math.ceil(wait)),
                )
        self.add(subjects, requests=1, tokens=0, minute=minute)
        return Meter(self, subjects)

    def add(self, subjects: tuple[str, ...], *, requests: int, tokens: int, minute: int | None = None) -> None:
        minute = minute_of(self.clock()) if minute is None else minute
        for subject in subjects:
            counts = self.pending.setdefault((subject, minute), _Counts())
            counts.requests += requests
            counts.tokens += tokens

    # -- the loop that shares the counts ----------------------------------------------------------------------------

    def _exchange(
        self, taken: dict[tuple[str, int], _Counts], limits: dict[str, Limits] | None
    ) -> tuple[dict[str, Limits], dict[tuple[str, int], tuple[int, int]]]:
        """Write ``taken``, read the limits (unless given) and every process's totals of the limited subjects (in a
        thread)."""
        store.add_usage(self.db, {k: (c.requests, c.tokens) for k, c in taken.items() if c.requests or c.tokens})
        if limits is None:
            limits = store.all_limits(self.db)
        minute = minute_of(self.clock())
        fresh = store.usage(self.db, set(limits), (minute - 1, minute)) if limits else {}
        if minute - 2 > self._pruned_minute:
            store.prune_usage(self.db, minute - 2)
            self._pruned_minute = minute - 2
        return limits, fresh

    async def sync(self, *, limits_too: bool = True) -> None:
        """One exchange with the database (``limits_too``: the limits are read again as well). What this process
        added is swapped out here, on the event loop, and counted as in flight until the totals that include it are
        read (or put back, if the write failed)."""
        async with self._lock:
            self.inflight, self.pending = self.pending, {}
            known = None if limits_too else self.limits
            try:
                limits, fresh = await asyncio.to_thread(self._exchange, self.inflight, known)
            except BaseException:
                for key, counts in self.inflight.items():  # kept for the next try: nothing is lost from the totals
                    mine = self.pending.setdefault(key, _Counts())
                    mine.requests += counts.requests
                    mine.tokens += counts.tokens
                self.inflight = {}
                raise
            self.limits, self.read, self.inflight = limits, {k: _Counts(*c) for k, c in fresh.items()}, {}
            if limits_too:
                self._limits_at = time.monotonic()

    async def run(self) -> None:
        while True:
            try:
                # The limits change rarely: read once a second (a process setting one applies it at once).
                await self.sync(limits_too=time.monotonic() - self._limits_at >= LIMITS_EVERY_S)
                self.fault.cleared()
            except SQLAlchemyError as exc:
                self.fault.failed(describe(exc), exc)
            await asyncio.sleep(self.interval)


def estimate(counts: dict[tuple[str, int], tuple[int, int]], subject: str, now: float) -> tuple[float, float]:
    """The sliding window's requests and tokens of ``subject`` from counts read for the current and previous
    minutes."""
    minute, elapsed = minute_of(now), now % WINDOW_S
    previous, current = counts.get((subject, minute - 1), (0, 0)), counts.get((subject, minute), (0, 0))
    return (
        window_estimate(previous[0], current[0], elapsed),
        window_estimate(previous[1], current[1], elapsed),
    )
