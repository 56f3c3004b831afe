"""Harness adapters by name, and detection of which ones can run here."""

from __future__ import annotations

from runner.harnesses.base import Detection, Harness, HarnessContext, Invocation, Outcome
from runner.harnesses.builtin import BuiltinHarness
from runner.harnesses.claude_code import ClaudeCodeHarness
from runner.harnesses.codex import CodexHarness
from runner.harnesses.openclaw import OpenClawHarness

HARNESSES: dict[str, type[Harness]] = {
    cls.name: cls for cls in (BuiltinHarness, ClaudeCodeHarness, CodexHarness, OpenClawHarness)
}


def make_harness(name: str, executable: str | None = None) -> Harness:
    try:
        cls = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r} (known: {', '.join(HARNESSES)})") from None
    return cls(executable)


def detect_all(executables: dict[str, str] | None = None) -> list[Detection]:
    return [make_harness(name, (executables or {}).get(name)).detect() for name in HARNESSES]


__all__ = [
    "HARNESSES",
    "Detection",
    "Harness",
    "HarnessContext",
    "Invocation",
    "Outcome",
    "detect_all",
    "make_harness",
]
