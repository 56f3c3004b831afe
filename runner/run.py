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
on) and reports pass rates per policy version, read from the versions that served each rollout's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from runner.harnesses import Harness, HarnessContext, Outcome
from runner.sandbox import SandboxError, SandboxFactory
from runner.tasks import Task
from runner.verify import verify

TRANSIENT_STATUS = (429, 502, 503, 504)


class InfraFailure(Exception):
    """Something outside the model failed (gateway unreachable, sandbox not starting): worth retrying."""


class RunAborted(Exception):
    """The run cannot go on at all (the gateway refuses the admin key, the model cannot be found)."""


class GatewayError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


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

    @property
    def base(self) -> str:
        return self.gateway_url.rstrip("/").removesuffix("/v1")


@dataclass(slots=True)
class RolloutResult:
    task_id: str
    harness: str
    index: int
    kind: str = "error"  # rewarded | harness_timeout | verifier_failed | infra | error
    status: str | None = None  # the rollout's final status at the gateway
    rollout_id: str | None = None
    group: str | None = None
    reward: float | None = None
    reason: str = ""
    outcome: str | None = None  # the harness's: done | gave_up | infra
    verifier: str | None = None  # scored | crashed | timed_out
    attempts: int = 0
    abandoned: list[str] = field(default_factory=list)  # rollouts aborted for infrastructure failures
    calls: int = 0
    policy_versions: list[int | None] = field(default_factory=list)
    duration: float = 0.0
    sandbox_removed: bool = True
    harness_log: str = ""  # the tail of the harness's stderr

    @property
    def label(self) -> str:
        return f"{self.task_id}::{self.harness}#{self.index}"

    @property
    def version(self) -> str:
        """The policy version that served this rollout: ``base`` (no adapter), ``vN``, or ``mixed(…)``."""
        found = sorted({v for v in self.policy_versions}, key=lambda v: -1 if v is None else v)
        if not found:
            return "none"
        names = ["base" if v is None else f"v{v}" for v in found]
        return names[0] if len(names) == 1 else f"mixed({','.join(names)})"


class GatewayClient:
    """The rollout API, with transient failures retried and then raised as ``InfraFailure``."""

    def __init__(self, base: str, admin_key: str | None, *, attempts: int = 3, backoff: float = 0.5) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.base = base
        self.attempts = attempts
        self.backoff = backoff
        self.http = httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(120.0, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, url: str, *, key: str | None = None, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = await self.http.request(method, url, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                last = f"{method} {url}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code in TRANSIENT_STATUS:
                last = f"{method} {url}: HTTP {resp.status_code}: {resp.text[:300]}"
                continue
            if resp.status_code in (401, 403) and key is None:
                raise RunAborted(f"the gateway refused the admin key ({method} {url}): {resp.text[:300]}")
            if resp.status_code >= 400:
                raise GatewayError(resp.status_code, f"{method} {url}: {resp.text[:500]}")
            return resp.json()
        raise InfraFailure(f"gateway unreachable: {last}")

    async def create_rollout(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", "/v1/rollouts", json=body)
        return result

    async def post_reward(self, rollout_id: str, value: float, details: dict[str, Any]) -> None:
        body = {"value": value, "source": "verifier", "details": details}
        await self.request("POST", f"/v1/rollouts/{rollout_id}/reward", json=body)

    async def finish(self, rollout_id: str, status: str, reason: str) -> None:
        body = {"status": status, "reason": reason[:2000]}
        await self.request("POST", f"/v1/rollouts/{rollout_id}/finish", json=body)

    async def rollout(self, rollout_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/v1/rollouts/{rollout_id}", params={"tokens": "false"})
        return result

    async def first_model(self, base_url: str, key: str) -> str:
        data = await self.request("GET", base_url.rstrip("/") + "/models", key=key)
        models = data.get("data") or []
        if not models:
            raise RunAborted("the gateway lists no models: pass --model")
        return str(models[0]["id"])


class Progress:
    """Progress on stderr: a redrawn bar on a terminal, one line per finished rollout otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.counts: dict[str, int] = defaultdict(int)
        self.t0 = time.monotonic()

    def _bar(self) -> str:
        width = 24
        filled = width * self.done // max(self.total, 1)
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        elapsed = time.monotonic() - self.t0
        return f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total} {counts} ({elapsed:.0f} s)"

    def note(self, message: str) -> None:
        prefix = "\r\033[K" if self.tty else ""
        print(f"{prefix}{message}", file=self.stream, flush=True)
        if self.tty:
            print(self._bar(), end="", file=self.stream, flush=True)

    def finished(self, result: RolloutResult) -> None:
        self.done += 1
        self.counts[result.kind] += 1
        reward = "-" if result.reward is None else f"{result.reward:g}"
        line = f"[{self.done}/{self.total}] {result.label} {result.kind} reward={reward} ({result.duration:.1f} s)"
        if result.kind != "rewarded":
            line += f": {result.reason[:200]}"
        if self.tty:
            self.note(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)


@dataclass(slots=True)
class RunReport:
    results: list[RolloutResult]
    harnesses: list[str]
    tasks: list[str]
    eval: bool
    pass_threshold: float
    sandbox: str
    retries: int = 0
    duration: float = 0.0
    leftover_sandboxes: int = 0

    def count(self, kind: str) -> int:
        return sum(r.kind == kind for r in self.results)

    @property
    def exit_code(self) -> int:
        """1 when some rollouts could not be run or judged (infrastructure, verifiers, errors), else 0."""
        bad = self.count("infra") + self.count("verifier_failed") + self.count("error") + self.leftover_sandboxes
        return 1 if bad else 0

    def summary(self) -> str:
        parts = [
            f"{len(self.results)} rollouts in {self.duration:.1f} s: {self.count('rewarded')} rewarded",
            f"{self.count('harness_timeout')} harness timeouts",
            f"{self.count('verifier_failed')} verifier failures",
            f"{self.count('infra')} infrastructure failures ({self.retries} retries)",
        ]
        if self.count("error"):
            parts.append(f"{self.count('error')} errors")
        if self.leftover_sandboxes:
            parts.append(f"{self.leftover_sandboxes} sandboxes NOT removed")
        return ", ".join(parts) + f"; sandbox: {self.sandbox}"

    def table(self) -> str:
        """Rewards per task × harness: mean reward and passed/scored, then markers for what was not scored."""
        cells: dict[tuple[str, str], list[RolloutResult]] = defaultdict(list)
        for r in self.results:
            cells[(r.task_id, r.harness)].append(r)
            cells[("(all)", r.harness)].append(r)
        rows = [*self.tasks, "(all)"]
        grid = [["task", *self.harnesses]]
        for task in rows:
            grid.append([task, *(self._cell(cells.get((task, h), [])) for h in self.harnesses)])
        widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in grid]
        legend = (
            f"rewards per task × harness: mean reward, passed (reward >= {self.pass_threshold:g})/scored; "
            "not scored: T harness timeout, V verifier failed, I infrastructure failure, E error"
        )
        return "\n".join([legend, *lines])

    def _cell(self, results: list[RolloutResult]) -> str:
        if not results:
            return "-"
        scored = [r.reward for r in results if r.reward is not None]
        text = "n/a" if not scored else f"{sum(scored) / len(scored):.2f} {self._passed(scored)}/{len(scored)}"
        marks = {"harness_timeout": "T", "verifier_failed": "V", "infra": "I", "error": "E"}
        for kind, mark in marks.items():
            count = sum(r.kind == kind for r in results)
            if count:
                text += f" {mark}{count}"
        return text

    def _passed(self, rewards: list[float]) -> int:
        return sum(r >= self.pass_threshold for r in rewards)

    def pass_rates(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(version, harness, task or "(all)") → (passed, judged). A harness timeout counts as not passed;
        rollouts that could not be judged (verifier or infrastructure failures) are left out."""
        rates: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.results:
            if r.kind not in ("rewarded", "harness_timeout"):
                continue
            passed = int(r.reward is not None and r.reward >= self.pass_threshold)
            for task in (r.task_id, "(all)"):
                cell = rates[(r.version, r.harness, task)]
                cell[0] += passed
                cell[1] += 1
        return {k: (v[0], v[1]) for k, v in rates.items()}

    def eval_table(self) -> str:
        rates = self.pass_rates()
        grid = [["version", "harness", "task", "passed", "rate"]]
        order = {t: i for i, t in enumerate([*self.tasks, "(all)"])}
        for (version, harness, task), (passed, judged) in sorted(
            rates.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 0))
        ):
            grid.append([version, harness, task, f"{passed}/{judged}", f"{100 * passed / judged:.0f}%"])
        widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in grid]
        head = f"eval pass rates by policy version (pass: reward >= {self.pass_threshold:g}; timeouts count as fails)"
        return "\n".join([head, *lines])

    def to_json(self) -> list[dict[str, Any]]:
        return [{**dataclasses.asdict(r), "version": r.version} for r in self.results]


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
