"""The trainer's one configuration (``TrainConfig``): algorithm, advantages, clipping, batching, staleness, device,
and when the daemon steps (``Trigger``). Validated once, when it is built.

`clawgate train` builds it from ``Settings`` (``trainer/cli.py``); tests and benchmarks build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from prefix_tree import TreeConfig
from trainer import lora

ALGORITHMS = ("grpo", "ppo")
ADVANTAGES = ("group", "batch", "critic")


@dataclass(slots=True)
class Trigger:
    """When the daemon takes a step (``loop.should_step``): ``min_rollouts`` ready rollouts of task runs in at least
    ``min_groups`` groups of two or more, or ``min_turns`` ready turns of everyday traffic, or the oldest ready one
    waited ``TrainConfig.group_wait``. `clawgate train --once` applies the two minimums when they are given."""

    min_rollouts: int = 8
    min_groups: int = 1
    min_turns: int = 16
    interval: float = 5.0  # seconds between looks while waiting
    max_steps: int | None = None  # stop after this many published steps (None: run until stopped)
    max_backoff: float = 300.0  # the longest wait after failed steps

    def __post_init__(self) -> None:
        if self.min_rollouts < 1 or self.min_turns < 1 or self.min_groups < 0:
            raise ValueError("min_rollouts and min_turns must be >= 1, min_groups >= 0")
        if self.interval <= 0 or self.max_backoff <= 0:
            raise ValueError("interval and max_backoff must be > 0")


@dataclass(slots=True)
class TrainConfig:
    model: str
    database_url: str
    adapter_dir: Path = Path("adapters")
    lr: float = 1e-5
    lora: lora.LoraSettings = field(default_factory=lora.LoraSettings)
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    scale_by_std: bool = True
    baseline: str = "mean"
    # Sampling temperature the logprobs were recorded at (engines report processed logprobs).
    temperature: float = 1.0
    # At most this many ready rollouts of task runs, and this many ready turns of everyday traffic, per step.
    max_rollouts: int = 256
    max_turns: int = 256
    max_tokens_per_bin: int = 16384
    strategy: str = "tree"
    # Rollouts whose calls were served by a version more than this many versions older than the one being trained
    # are consumed without training (None: no bound). Truncated IS corrects small gaps, not arbitrary ones.
    max_staleness: int | None = None
    # A group with a single ready member waits this many seconds (from its finish) for more members before it is
    # consumed without signal, and the daemon steps once the oldest ready rollout or turn waited this long; 0
    # consumes it at once (a one-shot run).
    group_wait: float = 0.0
    trigger: Trigger = field(default_factory=Trigger)
    epoch: int = 0
    dtype: str = "float32"
    seed: int = 0
    tree: TreeConfig = field(default_factory=TreeConfig)
    # "grpo" (group-normalized advantages) or "ppo" (a value head and GAE per branch: trainer/ppo.py).
    algorithm: str = "grpo"
    gamma: float = 1.0
    lam: float = 0.95
    # Weight of the value loss next to the policy loss (the LoRA trunk is shared); value_clip bounds V − V_old.
    value_coef: float = 0.1
    value_clip: float | None = 0.2
    # An Adam step of the head moves a value by up to about critic_lr · ‖h‖₁ (h: the last hidden state).
    critic_lr: float = 1e-5
    # Steps that train only the value head (the policy stays as it is) before PPO updates the policy.
    critic_warmup_steps: int = 0
    gradient_checkpointing: bool = False
    device: str = "auto"  # "auto": cuda when available, else cpu
    # Under torchrun: shard the frozen base over the ranks (FSDP2, ``sharding.py``), its computation in bfloat16
    # with mixed_precision "bf16" ("no": the dtype it was loaded in).
    shard: bool = False
    mixed_precision: str = "no"
    # "group" (GRPO for rollouts with a group, a batch baseline for turns), "batch" (a batch baseline for both),
    # "critic" (PPO's value head for both; the same as algorithm="ppo").
    advantage: str = "group"
    # Turns wait for the reward worker's verdict (a judge runs) before they are ready.
    await_judge: bool = False
    # Under guarded promotion each new version is published ``evaluating``: the loop's evaluation gate
    # (``trainer/eval_gate.py``) runs a held-out suite on it before it may serve traffic.
    eval_gate: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if self.algorithm == "ppo" and self.advantage not in ("group", "critic"):
            raise ValueError(
                f"algorithm ppo estimates advantages with its critic; advantage {self.advantage!r} "
                "cannot be used with it"
            )
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        if self.advantage == "critic":
            self.algorithm = "ppo"
        elif self.algorithm == "ppo":
            self.advantage = "critic"


def resolve_device(name: str) -> str:
    """``"auto"``: the GPU when there is one, else the CPU; any other name as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


__all__ = ["ADVANTAGES", "ALGORITHMS", "TrainConfig", "resolve_device"]
