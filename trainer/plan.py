"""One step's data on its way through the step (``StepPlan``), and what the step reports (``StepResult``).

``StepPlan`` holds what was loaded, what can train, the advantages, and why the rest is consumed untrained;
``StepResult`` is what a published step returns, and ``describe`` its one-line summary for the logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.store.training_data import RolloutData, TurnData


@dataclass(slots=True)
class StepResult:
    step_id: int
    version: int
    rollouts: int
    trained_rollouts: int
    skipped: dict[str, str]  # rollout or call id -> why it was consumed without training
    metrics: dict[str, float]
    seconds: float
    turns: int = 0
    trained_turns: int = 0
    lineage: str = ""  # "" the shared policy, else the tenant whose own policy the step trained


@dataclass(slots=True)
class StepPlan:
    """One step's data: what was loaded, what can train, the advantages, and why the rest is skipped."""

    rollouts: list[RolloutData]
    turns: list[TurnData]
    usable: list[RolloutData] = field(default_factory=list)
    usable_turns: list[TurnData] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # versions behind, per usable item
    skipped: dict[str, str] = field(default_factory=dict)  # rollout or call id -> why it is not trained
    advantages: dict[str, float] = field(default_factory=dict)  # rollout id -> advantage
    turn_advantages: dict[str, float] = field(default_factory=dict)  # call id -> advantage
    trained: list[RolloutData] = field(default_factory=list)
    trained_turns: list[TurnData] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        out = {
            "rollouts": float(len(self.rollouts)),
            "rollouts_trained": float(len(self.trained)),
            "turns": float(len(self.turns)),
            "turns_trained": float(len(self.trained_turns)),
            "staleness_max": float(max(self.staleness, default=0)),
        }
        # Means of nothing are left out, not NaN: PostgreSQL's JSON has no NaN.
        rewards = [d.reward for d in self.usable if d.reward is not None]
        if rewards:
            out["reward_mean"] = _mean(rewards)
        turn_rewards = [t.reward.value for t in self.usable_turns if t.reward is not None]
        if turn_rewards:
            out["turn_reward_mean"] = _mean(turn_rewards)
        if self.staleness:
            out["staleness_mean"] = _mean([float(x) for x in self.staleness])
        return out


def group_of(d: RolloutData) -> str:
    return d.rollout.group_key or d.rollout.task_id or d.rollout.id


def served_version(d: RolloutData) -> int:
    """The oldest version that served a call of the rollout (calls served by the base model count as v0)."""
    return min((v or 0 for v in d.served_versions), default=0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def describe(result: StepResult) -> str:
    m = result.metrics
    parts = [
        f"step {result.step_id} -> policy@v{result.version}"
        + (f" (tenant {result.lineage})" if result.lineage else ""),
        f"rollouts {result.trained_rollouts}/{result.rollouts}",
    ]
    if result.turns:
        parts.append(f"turns {result.trained_turns}/{result.turns}")
    for key in (
        "reward_mean",
        "turn_reward_mean",
        "loss",
        "value_loss",
        "explained_variance",
        "clip_frac_high",
        "is_weight_mean",
        "approx_kl",
        "grad_norm",
        "tokens_processed",
    ):
        if key in m:
            parts.append(f"{key} {m[key]:.4g}")
    parts.append(f"{result.seconds:.2f}s")
    return "  ".join(parts)


__all__ = ["StepPlan", "StepResult", "describe", "group_of", "served_version"]
