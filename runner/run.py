"""The runner: tasks × harnesses × N rollouts through the gateway, each in its own sandbox, verified and rewarded.

For every rollout: create it through the gateway API (admin key; its group is ``<task>::<harness>``, so GRPO
never mixes harnesses in one baseline), make a fresh sandbox with the task's workspace, point the harness at
the rollout's ``base_url`` with the rollout's own key, run it under the task's time limit, run the verifier on
the final workspace, post the reward, finish the rollout, remove the sandbox. Outcomes:

- rewarded (``completed``): the harness ended (or gave up: still the model's doing) and the verifier scored it;
- harness timeout (``aborted``, reason says so): the process tree was killed at the time limit, no reward;
- verifier failure (``failed``): the verifier crashed or timed out; no reward, since that says nothing about
  the model;
- infrastructure failure (``aborted``): the gateway was unreachable, the sandbox could not start. Only these are
  retried, a bounded number of times, each time as a new rollout (the abandoned one is aborted with the reason),
  and every retry is reported.

Evaluation mode creates the rollouts with ``eval: true`` (recorded and rewarded like any other, never trained
on) and reports pass rates per policy version, read from the versions that served each rollout's calls. With a
``policy_version`` every rollout is pinned to that version (one that serves no traffic yet can be evaluated).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, TextIO

from runner.client import GatewayClient, GatewayError, InfraFailure, RunAborted
from runner.harnesses import Harness, HarnessContext, Outcome
from runner.report import Progress, RolloutResult, RunReport
from runner.sandbox import SandboxError, SandboxFactory
from runner.tasks import Task
from runner.verify import verify


@dataclass(frozen=True, slots=True)
class RunConfig:
    gateway_url: str  # http://host:port (a trailing /v1 is ignored)
    admin_key: str | None
    n: int = 1
    concurrency: int = 2
    eval: bool = False
    model: str | None = None  # default: the first model the gateway lists
    retries: int = 2  # extra attempts per rollout, for infrastructure failures only
    retry_backoff: float = 1.0
    max_turns: int = 8
    pass_threshold: float = 1.0
    policy_version: int | None = None  # serve every rollout by this version (None: as the gateway routes it)
    tenant: str | None = None  # the rollouts' tenant (the admin key's choice; a tenant's own policy serves it)

    @property
    def base(self) -> str:
        return self.gateway_url.rstrip("/").removesuffix("/v1")


class Runner:
    def __init__(
        self,
        config: RunConfig,
        tasks: list[Task],
        harnesses: list[Harness],
        sandboxes: SandboxFactory,
        progress_stream: TextIO | None = None,
    ) -> None:
        self.config = config
        self.tasks = tasks
        self.harnesses = harnesses
        self.sandboxes = sandboxes
        self.progress = Progress(len(tasks) * len(harnesses) * config.n, progress_stream)
        self.gateway = GatewayClient(config.base, config.admin_key, backoff=config.retry_backoff / 2)
        self._model: str | None = config.model
        self._model_lock = asyncio.Lock()
        self.retries = 0

    async def run(self) -> RunReport:
        t0 = time.monotonic()
        if self.sandboxes.warning:
            self.progress.note(self.sandboxes.warning)
        limit = asyncio.Semaphore(max(1, self.config.concurrency))
        results: list[RolloutResult] = []

        async def one(task: Task, harness: Harness, index: int) -> None:
            async with limit:
                result = await self._rollout(task, harness, index)
            results.append(result)
            self.progress.finished(result)

        try:
            async with asyncio.TaskGroup() as group:
                for task in self.tasks:
                    for harness in self.harnesses:
                        for index in range(self.config.n):
                            group.create_task(one(task, harness, index))
        except* RunAborted as eg:
            raise eg.exceptions[0] from None
        finally:
            self.progress.close()
            await self.gateway.close()
        leftovers = len(self.sandboxes.leftovers())
        order = {(t.id, h.name): (i, j) for i, t in enumerate(self.tasks) for j, h in enumerate(self.harnesses)}
        results.sort(key=lambda r: (*order[(r.task_id, r.harness)], r.index))
        sandbox = "bubblewrap, network: the gateway only" if self.sandboxes.kind == "bwrap" else "NONE (plain dirs)"
        return RunReport(
            results,
            [h.name for h in self.harnesses],
            [t.id for t in self.tasks],
            self.config.eval,
            self.config.pass_threshold,
            sandbox,
            self.retries,
            time.monotonic() - t0,
            leftovers,
        )

    async def _rollout(self, task: Task, harness: Harness, index: int) -> RolloutResult:
        """One rollout with bounded retries of infrastructure failures; never raises except ``RunAborted``."""
        result = RolloutResult(task.id, harness.name, index)
        t0 = time.monotonic()
        attempts = self.config.retries + 1
        for attempt in range(1, attempts + 1):
            result.attempts = attempt
            try:
                await self._attempt(task, harness, index, attempt, result)
                break
            except InfraFailure as exc:
                result.kind, result.status, result.reason = "infra", "aborted", f"infrastructure failure: {exc}"
                if result.rollout_id:
                    result.abandoned.append(result.rollout_id)
                if attempt < attempts:
                    self.retries += 1
                    self.progress.note(f"{result.label}: {result.reason}; retry {attempt}/{self.config.retries}")
                    await asyncio.sleep(self.config.retry_backoff * 2 ** (attempt - 1))
                    result.rollout_id = None
            except RunAborted:
                raise
            except Exception as exc:  # a bug or an unexpected answer: this rollout fails, the run goes on
                result.kind, result.reason = "error", f"{type(exc).__name__}: {exc}"
                if result.rollout_id:
                    result.status = "aborted"
                    with contextlib.suppress(Exception):
                        await self.gateway.finish(result.rollout_id, "aborted", f"runner error: {result.reason}")
                break
        result.duration = time.monotonic() - t0
        return result

    async def _model_name(self, created: dict[str, Any]) -> str:
        async with self._model_lock:
            if self._model is None:
                self._model = await self.gateway.first_model(created["base_url"], created["api_key"])
            return self._model

    async def _attempt(self, task: Task, harness: Harness, index: int, attempt: int, result: RolloutResult) -> None:
        created = await self.gateway.create_rollout(
            {
                "task_id": task.id,
                "harness": harness.name,
                "eval": self.config.eval,
                **({"policy_version": self.config.policy_version} if self.config.policy_version is not None else {}),
                **({"tenant": self.config.tenant} if self.config.tenant is not None else {}),
                "metadata": {
                    "runner": {
                        "index": index,
                        "attempt": attempt,
                        "sandbox": self.sandboxes.kind,
                        "tags": list(task.tags),
                        "task_source": task.source,
                    }
                },
            }
        )
        rid = result.rollout_id = created["id"]
        result.group = created.get("group")
        try:
            await self._episode(task, harness, created, result)
        except InfraFailure as exc:
            with contextlib.suppress(InfraFailure, GatewayError):
                await self.gateway.finish(rid, "aborted", f"infrastructure failure: {exc}")
            raise
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.gateway.finish(rid, "aborted", "the runner was interrupted"))
            raise
        with contextlib.suppress(InfraFailure, GatewayError):
            detail = await self.gateway.rollout(rid)
            ok = [c for c in detail.get("calls", []) if c.get("status") == "ok"]
            result.calls = len(ok)
            result.policy_versions = [c.get("policy_version") for c in ok]

    async def _episode(self, task: Task, harness: Harness, created: dict[str, Any], result: RolloutResult) -> None:
        rid = created["id"]
        model = await self._model_name(created)
        try:
            sandbox = self.sandboxes.create(task)
        except SandboxError as exc:
            raise InfraFailure(str(exc)) from exc
        try:
            ctx = HarnessContext(
                rollout_id=rid,
                instruction=task.instruction,
                workspace=sandbox.workspace,
                home=sandbox.home,
                base_url=sandbox.url_for(created["base_url"]),
                api_key=created["api_key"],
                model=model,
                max_turns=self.config.max_turns,
                timeout=task.timeout,
            )
            try:
                invocation = harness.prepare(ctx)
            except OSError as exc:
                raise InfraFailure(f"cannot prepare {harness.name}: {exc}") from exc
            try:
                proc = await sandbox.run(
                    invocation.argv,
                    env={**sandbox.base_env(), **invocation.env},
                    timeout=task.timeout,
                    network=invocation.network,
                    gateway_url=created["base_url"],
                )
            except SandboxError as exc:
                raise InfraFailure(str(exc)) from exc
            result.harness_log = proc.stderr[-2000:]
            if proc.timed_out:
                reason = f"harness timed out after {task.timeout:g} s (process tree killed)"
                result.kind, result.status, result.reason = "harness_timeout", "aborted", reason
                await self.gateway.finish(rid, "aborted", reason)
                return
            assert proc.exit_code is not None
            outcome, note = harness.outcome(proc.exit_code, proc.stdout, proc.stderr)
            result.outcome = outcome.value
            if outcome is Outcome.INFRA:
                raise InfraFailure(note)
            verdict = await verify(task, sandbox)
        finally:
            sandbox.close()
            result.sandbox_removed = sandbox.removed
        result.verifier = verdict.status
        if verdict.status != "scored" or verdict.reward is None:
            what = "crashed" if verdict.status == "crashed" else "timed out"
            reason = f"verifier {what}: {verdict.detail}"
            result.kind, result.status, result.reason = "verifier_failed", "failed", reason
            await self.gateway.finish(rid, "failed", reason)
            return
        details = {
            "verifier": task.verifier.spec[:500],
            "verdict": verdict.detail,
            "harness_outcome": outcome.value,
            "harness_note": note[:500],
            **verdict.details,
        }
        await self.gateway.post_reward(rid, verdict.reward, details)
        reason = f"{outcome.value}: {note}"
        await self.gateway.finish(rid, "completed", reason)
        result.kind, result.status, result.reward, result.reason = "rewarded", "completed", verdict.reward, reason
