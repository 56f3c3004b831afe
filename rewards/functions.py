"""Users' own reward functions: ``module:function`` or ``path/to/file.py:function``, called once per turn.

A function receives the turn (``turns.TurnView``: its context, reply, next state, token ids, the rollout's
metadata) and returns the turn's reward from that source: a number, a bool (1.0 / 0.0), None (no reward from
this function for this turn), or ``{"reward": number, "details": {...}}``. It runs on a worker thread, so it may
block (read files, call a service). Its reward is recorded with source ``function:<spec>``.

A function that raises, or returns something else, gives no reward for that turn; the error is logged and kept
with the turn's verdict, never swallowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.turns import TurnView


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded, or returned a value that is not a reward."""


@dataclass(frozen=True, slots=True)
class FunctionReward:
    value: float
    details: dict[str, Any] | None


@dataclass(frozen=True)
class RewardFunction:
    spec: str
    fn: Callable[[TurnView], Any]

    @property
    def source(self) -> str:
        return f"function:{self.spec}"

    def __call__(self, turn: TurnView) -> FunctionReward | None:
        return interpret(self.fn(turn), self.spec)


def load(spec: str) -> RewardFunction:
    """Import ``module:function`` or ``file.py:function``; raises ``RewardFunctionError`` with the reason."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(f"reward function {spec!r}: expected module:function or path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise RewardFunctionError(f"reward function {spec!r}: no file {path}")
            unique = f"clawgate_reward_{abs(hash(str(path)))}"
            loader = importlib.util.spec_from_file_location(unique, path)
            if loader is None or loader.loader is None:
                raise RewardFunctionError(f"reward function {spec!r}: cannot load {path}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[unique] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except RewardFunctionError:
        raise
    except Exception as error:
        raise RewardFunctionError(
            f"reward function {spec!r}: import failed: {type(error).__name__}: {error}"
        ) from error
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {attr!r} is not a function of {module_name}")
    return RewardFunction(spec, fn)


def interpret(value: Any, spec: str) -> FunctionReward | None:
    """A function's return value as a reward (see the module docstring)."""
    details: dict[str, Any] | None = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardFunctionError(f"reward function {spec!r} returned a dict without 'reward'")
        raw_details = value.get("details")
        details = raw_details if isinstance(raw_details, dict) else None
        value = value["reward"]
    if value is None:
        return None
    if isinstance(value, bool):
        return FunctionReward(1.0 if value else 0.0, details)
    if isinstance(value, int | float) and math.isfinite(float(value)):
        return FunctionReward(float(value), details)
    raise RewardFunctionError(f"reward function {spec!r} returned {value!r}, not a finite number, bool or None")


__all__ = ["FunctionReward", "RewardFunction", "RewardFunctionError", "interpret", "load"]
