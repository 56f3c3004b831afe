"""Following the trainer: load each newly published policy version into the engine, verify it, route to it.

The trainer publishes ``policy@vN`` by writing its directory and then committing a ``policy_versions`` row (see
``trainer/publish.py``); the row is the signal, so a half-written directory is never seen. Every gateway runs one
``PolicyFollower``: every ``policy_poll_interval`` seconds it looks for a version newer than the one it serves and

1. loads it into its engine under the version's own name (vLLM: ``POST /v1/load_lora_adapter``; the local engine:
   in-process) — a new name per version, because vLLM keys its prefix cache by adapter;
2. verifies it answers (a one-token generation through the adapter, on every replica of a vLLM cluster);
3. routes new calls to it (one assignment on the event loop, so a request sees either the old or the new version,
   never a mix); calls already running keep the version they started on, and each call records its version;
4. marks it current in the database (``is_current``, ``loaded_at``, ``current_at``: the swap latency;
   ``store/policy_versions.py``);
5. unloads versions beyond the newest ``policy_keep_loaded`` once no call of this gateway still runs on them and
   no other live gateway on the database reports serving them or running calls on them (``adapter_leases``:
   several gateways may share one engine).

A version that fails to load or to answer is reported (log, metric) and skipped; the gateway keeps serving the
version it had. If the engine lost the current adapter (a restarted engine), it is loaded again.

An operator's pin (``store/policy_control.py``) overrides everything: the follower swaps to the pinned version,
older or newer, serves it to all traffic and stays on it until it is unpinned.

Guarded promotion (``gateway/promotion``): "the newest" is the *incumbent*, the newest version promoted. During a
canary the follower also loads the candidate and routes a share of new conversations to it
(``promotion/routing.py``); its promoter takes the stage decisions at each poll.

Lineages (``gateway/store/lineages.py``): a tenant with a policy of its own has its own versions, pin and canary.
The shared lineage's follower (the one ``run`` loops) keeps one more follower per such tenant and syncs them at each
of its polls; each routes only its tenant's calls (``ChatService.lineage_routing``), and until the tenant's first
version serves, the tenant gets the shared policy. A vLLM server with too few ``--max-loras`` for every lineage's
adapters side by side is not given another lineage: the tenant stays on the shared policy and the gateway says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.engines.base import Engine
from gateway.faults import Fault, describe
from gateway.metrics import Metrics
from gateway.promotion.promoter import Promoter
from gateway.promotion.routing import Arm, Routed, Routing
from gateway.settings import Settings
from gateway.store import adapter_leases, api_keys, lineages, policy_versions, promotion
from gateway.store.models import PolicyVersion
from gateway.store.policy_versions import SHARED

log = logging.getLogger("clawgate.policy")
# While the database (or the engine) is unreachable the follower looks less and less often, up to this (seconds).
MAX_POLL_BACKOFF = 30.0


class PolicyFollower:
    """This gateway's side of the policy lifecycle (see the module docstring): it loads and verifies each version
    the database says to serve, routes the request core (``service``) to it, and unloads what nothing uses any more.
    ``sync`` runs one pass at once (an operator's change); ``run`` polls every ``policy_poll_interval`` seconds."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        service: Routed,
        db: sa.Engine,
        metrics: Metrics,
        probe_ids: list[int],
        gateway_id: str | None = None,
        promoter: Promoter | None = None,
        lineage: str = SHARED,
        base: Callable[[], Arm] | None = None,
    ) -> None:
        self.settings = settings
        self.lineage = lineage
        self.primary = lineage == SHARED  # the shared lineage's follower: it sets the gauges and runs the others
        # A tenant lineage's: what serves the tenant while the lineage has no version of its own (the shared one).
        self.base = base
        self.lineages: dict[str, PolicyFollower] = {}  # tenant -> its lineage's follower (primary only)
        self.refused: dict[str, str] = {}  # tenant -> why its own policy is not served here
        self.engine = engine
        self.service = service
        self.db = db
        self.metrics = metrics
        self.probe_ids = probe_ids or [0]
        # This process, as its adapter heartbeats name it (``adapter_leases``).
        self.gateway_id = gateway_id or adapter_leases.new_gateway_id()
        self.current: int | None = None
        self.loaded: dict[int, str] = {}  # version -> adapter name, of the versions this gateway loaded, oldest first
        self.failed: set[int] = set()
        self.pinned: int | None = None  # the operator's pin, as last read (store/policy_control.py)
        self.last_swap_seconds: float | None = None  # load + verify + route of the latest swap
        # Guarded promotion: stage changes are taken here, at each poll (None: this gateway takes no decisions).
        self.promoter = promoter
        self.state = promotion.State()  # stages as last read
        self.candidate: int | None = None  # the canary's version while this gateway routes to it
        self.evaluated: int | None = None  # a version being evaluated, loaded for the rollouts pinned to it
        self._lock = asyncio.Lock()
        self.fault = Fault(log, "policy follower: cannot look for new versions")

    # -- the loop ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        interval = self.settings.policy_poll_interval
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync()
            except Exception as exc:  # the database or the engine may be down for a while: look less often
                self.fault.failed(describe(exc), exc_info=exc)
                interval = min(max(interval, 0.5) * 2, MAX_POLL_BACKOFF)
                continue
            self.fault.cleared()
            interval = self.settings.policy_poll_interval

    async def sync(self) -> int | None:
        """One look at what to serve — the pinned version, else the incumbent (the newest promoted version) and,
        during a canary, the candidate beside it — loading and routing to what is not served yet; returns the
        incumbent served afterwards (None: the base model)."""
        async with self._lock:
            await self._ensure_current_loaded()
            state = await asyncio.to_thread(promotion.read_state, self.db, self.lineage)
            if self.promoter is not None and await asyncio.to_thread(self.promoter.step, state):
                state = await asyncio.to_thread(promotion.read_state, self.db, self.lineage)
            self.state = state
            self.pinned = state.pinned
            if state.pinned is not None:
                pinned = state.pinned
                row = None if pinned == self.current else await asyncio.to_thread(policy_versions.get, self.db, pinned)
            else:
                row = (
                    state.incumbent if state.incumbent is not None and state.incumbent.version != self.current else None
                )
            if row is not None and row.version not in self.failed:
                await self._swap_to(row)
            await self._route(state)
            await self._retire()
            if self.primary:
                await self._sync_lineages()
            return self.current

    async def _sync_lineages(self) -> None:
        """Open a follower for each tenant that has a policy of its own (room permitting), close those that no
        longer have one, and sync each (one lineage's failure does not stop the others)."""
        wanted = set(await asyncio.to_thread(lineages.own_policies, self.db))
        for tenant in [t for t in self.lineages if t not in wanted]:
            del self.lineages[tenant]
            with contextlib.suppress(KeyError):  # never served a version of its own here
                self.metrics.lineage_version.remove(tenant)
            self.service.use_lineage_routing(tenant, None)  # back on the shared policy
            log.info("tenant %s has no policy of its own any more: it is served the shared policy", tenant)
        for tenant in sorted(wanted - set(self.lineages)):
            reason = await self._no_room_for(len(self.lineages) + 2)
            if reason is not None:
                if self.refused.get(tenant) != reason:
                    log.error(
                        "tenant %s's own policy is not served: %s; it is served the shared policy", tenant, reason
                    )
                self.refused[tenant] = reason
                continue
            self.refused.pop(tenant, None)
            self.lineages[tenant] = PolicyFollower(
                self.settings,
                self.engine,
                LineageRoute(self.service, tenant),
                self.db,
                self.metrics,
                self.probe_ids,
                gateway_id=self.gateway_id,
                promoter=Promoter(self.settings, self.db, self.gateway_id) if self.promoter is not None else None,
                lineage=tenant,
                base=lambda: self.service.routing.incumbent,
            )
        for tenant, follower in list(self.lineages.items()):
            try:
                await follower.sync()
            except Exception as exc:
                log.warning("tenant %s's policy: %s", tenant, describe(exc))

    async def _no_room_for(self, lineages_served: int) -> str | None:
        """Why the engine cannot serve ``lineages_served`` lineages' adapters side by side (None: it can). Only a
        vLLM engine has a limit (``VLLMEngine.lora_slots``: its ``--max-loras``); the local engine has none."""
        read = getattr(self.engine, "lora_slots", None)
        slots = await read() if read is not None else {}
        reported = [n for n in slots.values() if n is not None]
        per_lineage = 2 if self.state.mode == promotion.GUARDED else 1  # the incumbent, and a canary's candidate
        needed = lineages_served * per_lineage
        if reported and min(reported) < needed:
            return f"vLLM's --max-loras is {min(reported)}, below the {needed} adapters served side by side"
        return None

    async def _route(self, state: promotion.State) -> None:
        """Route new conversations: all to the incumbent, or during a canary a share to the candidate (loaded and
        verified first; one that cannot be served is rejected with the reason, and the incumbent serves on). A
        version being evaluated is loaded the same way and serves only the rollouts pinned to it."""
        incumbent = Arm(self.service.adapter, self.service.policy_version)
        if self.current is None and self.base is not None:
            incumbent = self.base()  # a tenant lineage with no version serving yet: the shared incumbent
        canary = state.canary if state.pinned is None else None
        candidate: Arm | None = None
        if canary is not None and canary.version not in self.failed and await self._load(canary):
            candidate = Arm(canary.adapter_name, canary.version)
        live = set(state.promoted)
        self.evaluated = None
        if state.pinned is None and state.evaluating:
            evaluated = state.evaluating[-1]
            if evaluated.version not in self.failed and await self._load(evaluated):
                live.add(evaluated.version)
                self.evaluated = evaluated.version
        if self.current is None and self.base is not None and candidate is None and self.evaluated is None:
            routing = Routing()  # nothing of the tenant's own to serve: it follows the shared routing whole
        elif state.pinned is not None:
            routing = Routing(incumbent)
        else:
            kept = {v: Arm(name, v) for v, name in self.loaded.items() if v in live}
            if state.mode != promotion.GUARDED:
                routing = Routing(incumbent, kept=kept)
            else:
                share = canary.canary_share if canary is not None and canary.canary_share is not None else 0.0
                routing = Routing(incumbent, candidate, share, sticky=True, kept=kept)
        if routing != self.service.routing:
            self.service.use_routing(routing)
            self.candidate = candidate.version if candidate is not None else None
            if self.primary:
                self.metrics.canary_version.set(-1 if self.candidate is None else self.candidate)
                self.metrics.canary_share.set(routing.share if candidate is not None else 0.0)

    async def _load(self, row: PolicyVersion) -> bool:
        """Load and verify a canary's (or an evaluated version's) adapter once; False, and the version rejected,
        when it cannot serve."""
        name = row.adapter_name
        try:
            if name not in await self.engine.adapters():
                await self.engine.load_adapter(name, self._engine_path(row))
                await self._probe(name)
        except Exception as exc:
            self.failed.add(row.version)
            self.metrics.policy_swap_failures.inc()
            reason = f"load failed: {describe(exc)}"
            log.error("%s policy %s could not be served (%s): rejecting it", row.stage, name, reason)
            await asyncio.to_thread(
                promotion.move,
                self.db,
                row.version,
                expect=promotion.UNDECIDED,
                to="rejected",
                reason=reason,
                decided_by=self.gateway_id,
                incumbent=self.current,
            )
            return False
        if row.version not in self.loaded:
            self.loaded[row.version] = name
            log.info("%s policy %s loaded and verified", row.stage, name)
        return True

    def promotion_summary(self) -> dict[str, Any]:
        """Incumbent, candidate, stage and share as this gateway last read them (no database access: /health); the
        shared lineage's also hold each tenant lineage's (``lineages``)."""
        state, routing = self.state, self.service.routing
        undecided = state.undecided()
        last = self.promoter.last if self.promoter is not None else None
        summary: dict[str, Any] = {
            "mode": state.mode,
            "incumbent": routing.incumbent.version,
            "candidate": undecided.version if undecided is not None else None,
            "stage": undecided.stage if undecided is not None else None,
            "canary_share": routing.share if routing.candidate is not None else 0.0,
            "serving_candidate": routing.candidate is not None,
            "evaluating": self.evaluated,  # loaded here for the rollouts pinned to it (the evaluation gate)
            "last_look": None
            if last is None or self.promoter is None or self.promoter.last_version != self.candidate
            else {"outcome": last.outcome, "reason": last.reason},
        }
        if self.primary:
            summary["lineages"] = {tenant: f.promotion_summary() for tenant, f in self.lineages.items()}
        return summary

    # -- steps ---------------------------------------------------------------------------------------------

    def _engine_path(self, row: PolicyVersion) -> str:
        if self.settings.engine == "vllm" and self.settings.vllm_adapter_dir is not None:
            return str(Path(self.settings.vllm_adapter_dir) / row.adapter_name)
        return row.path

    async def _swap_to(self, row: PolicyVersion) -> None:
        name, version = row.adapter_name, row.version
        t0 = time.perf_counter()
        try:
            if name not in await self.engine.adapters():
                await self.engine.load_adapter(name, self._engine_path(row))
            loaded_at = dt.datetime.now(dt.UTC)
            await self._probe(name)
        except Exception as exc:
            self.failed.add(version)
            self.metrics.policy_swap_failures.inc()
            log.error("policy %s could not be served (%s); staying on %s", name, exc, self.service.adapter or "base")
            return
        self.loaded.setdefault(version, name)
        previous = self.service.adapter
        # The database says "current" before new calls go to it: what `clawgate policy list` shows is never behind
        # what is served. Only the incumbent changes here; ``_route`` then settles the canary around it.
        await asyncio.to_thread(policy_versions.mark_current, self.db, version, loaded_at)
        self.service.use_routing(replace(self.service.routing, incumbent=Arm(name, version)))
        self.current = version
        self.last_swap_seconds = time.perf_counter() - t0
        published = row.created_at.timestamp()
        if self.primary:
            self.metrics.policy_version.set(version)
        else:
            self.metrics.lineage_version.labels(self.lineage).set(version)
        self.metrics.policy_swaps.inc()
        self.metrics.policy_swap_seconds.observe(max(time.time() - published, 0.0))
        log.info(
            "serving %s%s (was %s): loaded and verified in %.2fs, %.2fs after it was published",
            name,
            "" if self.primary else f" to tenant {self.lineage}",
            previous or "the base model",
            time.perf_counter() - t0,
            time.time() - published,
        )

    async def _probe(self, name: str) -> None:
        await self.engine.verify_adapter(name, self.probe_ids)

    async def _ensure_current_loaded(self) -> None:
        if self.current is None:
            return
        name = self.service.adapter
        if name is None or name in await self.engine.adapters():
            return
        row = await asyncio.to_thread(policy_versions.get, self.db, self.current)
        if row is None:
            return
        log.warning("the engine lost %s (restarted?): loading it again", name)
        await self.engine.load_adapter(name, self._engine_path(row))

    async def _retire(self) -> None:
        keep = self.settings.policy_keep_loaded
        while len(self.loaded) > keep:
            version, name = next(iter(self.loaded.items()))
            if version in (self.current, self.candidate, self.evaluated):
                return
            if self.service.adapter_in_flight.get(name, 0) > 0:
                return  # calls still run on it: next time
            lease = self.settings.adapter_lease_seconds
            others = await asyncio.to_thread(adapter_leases.used_elsewhere, self.db, self.gateway_id, name, lease)
            if others:
                return  # another gateway on this engine still serves it or runs calls on it: next time
            try:
                await self.engine.unload_adapter(name)
            except Exception as exc:
                log.warning("could not unload %s: %s", name, exc)
            del self.loaded[version]
            await asyncio.to_thread(policy_versions.mark_retired, self.db, version)
            log.info("unloaded %s", name)


class LineageRoute:
    """A tenant lineage's view of the request core, for its follower (``Routed``): its routing is the tenant's
    entry in ``ChatService.lineage_routing`` (absent until its first version serves: the shared policy then)."""

    def __init__(self, service: Routed, tenant: str) -> None:
        self._service = service
        self.tenant = tenant

    @property
    def routing(self) -> Routing:
        return self._service.lineage_routing.get(self.tenant) or Routing()

    @property
    def adapter_in_flight(self) -> Counter[str]:
        return self._service.adapter_in_flight

    @property
    def adapter(self) -> str | None:
        return self.routing.incumbent.adapter

    @property
    def policy_version(self) -> int | None:
        return self.routing.incumbent.version

    def use_routing(self, routing: Routing) -> None:
        self._service.use_lineage_routing(self.tenant, routing if routing.incumbent.version is not None else None)

    def use_lineage_routing(self, tenant: str, routing: Routing | None) -> None:
        self._service.use_lineage_routing(tenant, routing)

    @property
    def lineage_routing(self) -> dict[str, Routing]:
        return self._service.lineage_routing


def lineage_for(db: sa.Engine, tenant: str | None, version: int | None) -> str:
    """The lineage an operator's change acts on: the named tenant's own policy, else the lineage of the version
    named (pinning or deciding a tenant's version needs no tenant), else the shared one. ValueError for a name
    that cannot be a tenant's."""
    if tenant:
        return api_keys.check_tenant_name(tenant)
    if version is not None:
        return policy_versions.lineage_of_version(db, version) or SHARED
    return SHARED


async def apply_change(
    db: sa.Engine, follower: PolicyFollower | None, change: Callable[..., object], *args: Any
) -> None:
    """Write an operator's change (``change(db, *args)``: pin, unpin, roll back, promote, reject) and let this
    gateway's follower act on it at once; the other gateways follow at their next poll. The change's own errors
    (``policy_control.UnknownVersion``, ``promotion.NotDecidable``) reach the caller before anything is synced."""
    await asyncio.to_thread(change, db, *args)
    if follower is not None:
        await follower.sync()
