"""Python verifiers of the bundled task suite (``module:function`` entry points, called with the workspace)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

CASES = {1: "1", 3: "Fizz", 5: "Buzz", 9: "Fizz", 10: "Buzz", 15: "FizzBuzz", 30: "FizzBuzz", 7: "7"}


def fizzbuzz(workspace: Path) -> dict[str, Any]:
    """Partial credit: the share of cases ``fizzbuzz.fizzbuzz(n)`` gets right (0 if it cannot be imported)."""
    spec = importlib.util.spec_from_file_location("fizzbuzz", workspace / "fizzbuzz.py")
    if spec is None or spec.loader is None:
        return {"reward": 0.0, "error": "fizzbuzz.py is missing"}
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        return {"reward": 0.0, "error": f"import failed: {exc}"}
    right = []
    for n, want in CASES.items():
        try:
            if str(module.fizzbuzz(n)) == want:
                right.append(n)
        except Exception:
            pass
    return {"reward": len(right) / len(CASES), "passed": right}
