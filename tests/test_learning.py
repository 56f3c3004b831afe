"""The learning check: GRPO through the whole system (rollout API, gateway serving and capture, store, trees,
advantages, tree-packed loss, LoRA versions loaded back into the engine) raises the reward of a synthetic task on
the tiny model far beyond noise, while a learning-rate-0 control stays flat. See bench/learning_check.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "learning_check", Path(__file__).parent.parent / "bench" / "learning_check.py"
)
assert _spec is not None and _spec.loader is not None
learning_check = importlib.util.module_from_spec(_spec)
sys.modules["learning_check"] = learning_check
_spec.loader.exec_module(learning_check)

STEPS = 18


def curve_of(model_dir: Path, workdir: Path, **run: object) -> list[float]:
    """The learning check's reward per step on the synthetic task: 8 prompts x 8 samples, 24 tokens, 50 targets."""
    return learning_check.run(
        model_dir, prompts=8, group=8, max_tokens=24, target_size=50, workdir=workdir, log=False, **run
    )


def head_tail(curve: list[float]) -> tuple[float, float]:
    return sum(curve[:3]) / 3, sum(curve[-3:]) / 3


# Measured (20 steps, lr 5e-3, 8 prompts x 8 samples): seeds 0/1/2 went 0.03/0.03/0.02 -> 0.96/0.91/0.88;
# seed 2 is the slowest to take off (0.58 at step 14), so it is the one checked here: one seed proves the point.
@pytest.mark.parametrize("seed", [2])
def test_grpo_raises_reward_through_the_gateway(seed, tiny_model_dir, tmp_path):
    curve = curve_of(
        tiny_model_dir,
        tmp_path,
        steps=STEPS,
        lr=1e-2,
        seed=seed,
    )
    start, end = head_tail(curve)
    assert start < 0.1, curve  # a random policy hits ~50/2048 of the vocabulary
    assert end >= start + 0.3, curve


# Measured (lr 1e-2, seed 0): 0.03 0.04 0.05 0.09 0.60 0.25 0.88 0.93, then 0.92-0.94 to step 18.
def test_ppo_with_its_critic_raises_reward_through_the_gateway(tiny_model_dir, tmp_path):
    """PPO (a value head, GAE per branch; ``--advantage critic`` is the same configuration) learns the task too."""
    curve = curve_of(
        tiny_model_dir,
        tmp_path,
        steps=10,  # at 0.9 from step 6 on
        lr=1e-2,
        seed=0,
        algorithm="ppo",
    )
    start, end = head_tail(curve)
    assert start < 0.1, curve
    assert end >= start + 0.3, curve


def test_learning_rate_zero_control_stays_flat(tiny_model_dir, tmp_path):
    """The control of both learning tests: with a learning rate of 0 no weight moves, whichever the algorithm (GRPO
    or PPO), so the served policy and the seeded samples stay those of step 0 and the reward stays flat."""
    curve = curve_of(
        tiny_model_dir,
        tmp_path,
        steps=8,  # flat is flat: fewer steps say as much
        lr=0.0,
        seed=0,
    )
    start, end = head_tail(curve)
    assert abs(end - start) < 0.05, curve
