"""What a run reports: one ``RolloutResult`` per rollout, live progress on stderr, and the final ``RunReport``
(summary, rewards per task × harness, eval pass rates per policy version, JSON)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO


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
