"""The trainer's configuration (``TrainConfig``): algorithm, advantages, clipping, batching, staleness, device.

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
    max_rollouts: int = 256
    min_rollouts: int = 1
    max_tokens_per_bin: int = 16384
    strategy: str = "tree"
    # Rollouts whose calls were served by a version more than this many versions older than the one being trained
    # are consumed without training (None: no bound). Truncated IS corrects small gaps, not arbitrary ones.
    max_staleness: int | None = None
    # A group with a single ready member waits this many seconds (from its finish) for more members before it is
    # consumed without signal; 0 consumes it at once (a one-shot run).
    group_wait: float = 0.0
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
    # "group" (GRPO for rollouts with a group, a batch baseline for turns), "batch" (a batch baseline for both),
    # "critic" (PPO's value head for both; the same as algorithm="ppo").
    advantage: str = "group"
    # Turns wait for the reward worker's verdict (a judge runs) before they are ready.
    await_judge: bool = False

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
