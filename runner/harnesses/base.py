"""The harness interface: how one agent program is configured, started and judged inside a sandbox.

An adapter knows four things about its harness, and nothing about rollouts, rewards or training:

- ``detect``: whether it is installed here (and a working version of what it runs on), with an install hint;
- ``prepare``: the files it needs (configuration in the sandbox's private home, never in the user's) and the
  command line and environment that point it at the rollout's ``base_url`` with the rollout's own key;
- ``outcome``: how to read its exit — the episode ended (``DONE``), the agent gave up or hit a limit
  (``GAVE_UP``: still verified, the model is responsible), or the infrastructure failed (``INFRA``: the
  gateway was unreachable; the runner retries those and never posts a reward for them).

The process is the unit of completion: a harness run is over when its process exits (or is killed at the
task's time limit by the sandbox).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import ClassVar

from runner.sandbox import Network

# Messages that mean the harness could not reach the gateway at all (not a model failure).
CONNECTION_ERRORS = re.compile(
    r"ECONNREFUSED|ECONNRESET|Connection refused|Connection error|connect error|error sending request|"
    r"failed to connect|Unable to connect",
    re.IGNORECASE,
)


class Outcome(Enum):
    DONE = "done"
    GAVE_UP = "gave_up"
    INFRA = "infra"


@dataclass(frozen=True, slots=True)
class HarnessContext:
    """What a harness run needs to know: all paths and URLs as seen from inside the sandbox."""

    rollout_id: str
    instruction: str
    workspace: Path
    home: Path
    base_url: str  # the rollout's OpenAI-style base URL, ending in /v1
    api_key: str  # the rollout's own key: it works for this rollout only
    model: str
    max_turns: int
    timeout: float


@dataclass(frozen=True, slots=True)
class Invocation:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the sandbox's base environment
    network: Network = "gateway"


@dataclass(frozen=True, slots=True)
class Detection:
    name: str
    available: bool
    executable: str | None = None
    version: str | None = None
    problem: str | None = None  # why it is unavailable
    install_hint: str = ""

    def describe(self) -> str:
        if self.available:
            return f"{self.name}: {self.executable} ({self.version or 'version unknown'})"
        return f"{self.name}: unavailable — {self.problem}. Install: {self.install_hint}"


class Harness(ABC):
    name: ClassVar[str]
    binary: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""

    def __init__(self, executable: str | None = None) -> None:
        self._executable = executable

    def executable(self) -> str | None:
        if self._executable is not None:
            return self._executable if Path(self._executable).exists() else None
        return shutil.which(self.binary) if self.binary else None

    def detect(self) -> Detection:
        exe = self.executable()
        problem = self.requirement_problem()
        if exe is None:
            where = self._executable or f"`{self.binary}` on PATH"
            missing = f"{where} not found" + (f"; {problem}" if problem else "")
            return Detection(self.name, False, problem=missing, install_hint=self.install_hint)
        if problem is not None:
            return Detection(self.name, False, exe, problem=problem, install_hint=self.install_hint)
        version, error = run_version(exe)
        if version is None:
            return Detection(
                self.name, False, exe, problem=f"`{exe} --version` failed: {error}", install_hint=self.install_hint
            )
        return Detection(self.name, True, exe, version, install_hint=self.install_hint)

    def requirement_problem(self) -> str | None:
        """What else the harness needs that is missing here (a runtime version), or None."""
        return None

    @abstractmethod
    def prepare(self, ctx: HarnessContext) -> Invocation: ...

    def outcome(self, exit_code: int, stdout: str, stderr: str) -> tuple[Outcome, str]:
        if exit_code == 0:
            return Outcome.DONE, "exit 0"
        text = stdout[-4000:] + stderr[-4000:]
        if CONNECTION_ERRORS.search(text):
            return Outcome.INFRA, f"exit {exit_code}: could not reach the gateway: {last_line(text)}"
        return Outcome.GAVE_UP, f"exit {exit_code}: {last_line(text)}"


def last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else "(no output)"


def run_version(exe: str, flag: str = "--version") -> tuple[str | None, str]:
    try:
        proc = subprocess.run([exe, flag], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if proc.returncode != 0:
        return None, last_line(proc.stderr or proc.stdout)
    return last_line(proc.stdout or proc.stderr, 120), ""


def node_version(node: str | None = None) -> tuple[int, int, int] | None:
    exe = node or shutil.which("node")
    if exe is None:
        return None
    version, _ = run_version(exe)
    match = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def node_problem(minimum: tuple[int, int, int]) -> str | None:
    found = node_version()
    want = ".".join(map(str, minimum))
    if found is None:
        return f"Node.js >= {want} is needed and `node` was not found"
    if found < minimum:
        return f"Node.js >= {want} is needed, this machine has {'.'.join(map(str, found))}"
    return None
