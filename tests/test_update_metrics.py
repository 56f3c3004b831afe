"""The figures a step reports (``loss``, ``tokens``, ``is_weight_max``, …) mean the same for GRPO and PPO and do not
change with how the step's trees were split into micro-batches (``trainer/update.py`` defines them).

The same four two-branch trees go through a GRPO ``Trainer``'s update and through ``ppo.optimize`` on the same
policy, packed as one micro-batch, a few, and one path per micro-batch (tree and path layouts). With a fresh value
head (V_old = 0) and γ = λ = 1 every PPO advantage is its rollout's reward, so GRPO given the rewards as credits
computes the same per-token policy loss as PPO: the two must report the same figures. Learning rates are 0, so
every update starts from the same weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gateway.store.db import connect
from prefix_tree import RolloutTree
from tests.test_ppo import two_branch_tree
from trainer import ppo
from trainer.batch import Strategy, pack_trees
from trainer.config import TrainConfig
from trainer.step import Trainer

TREES = [two_branch_tree(seed) for seed in range(4)]
REWARDS = [1.0, -1.0, 0.5, -0.5]
# (strategy, max_tokens_per_bin): every tree in one micro-batch, a tree or two per micro-batch, one path each.
SPLITS: list[tuple[Strategy, int]] = [("tree", 16384), ("tree", 64), ("paths", 64), ("tree", 27)]
SHARED = ("loss", "pg_loss", "tokens", "trainable_tokens", "is_weight_max", "is_weight_mean", "approx_kl")


@pytest.fixture
def trainer(tiny_model_dir, sqlite_url, tmp_path) -> Iterator[Trainer]:
    engine = connect(sqlite_url)
    config = TrainConfig(
        model=str(tiny_model_dir), database_url=sqlite_url, adapter_dir=tmp_path / "adapters", device="cpu"
    )
    yield Trainer(config, engine)
    engine.dispose()


def frozen(params: Any) -> torch.optim.AdamW:
    """An optimizer that leaves the weights as they are: each update computes its figures from the same policy."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=0.0, weight_decay=0.0)


def grpo(
    trainer: Trainer, trees: list[RolloutTree], credits: list[float], strategy: str, budget: int
) -> dict[str, float]:
    trainer.config = dataclasses.replace(trainer.config, strategy=strategy, max_tokens_per_bin=budget)
    trainer.optimizer = frozen(trainer.policy.parameters())
    return trainer._optimize(trees, list(credits))


def ppo_step(
    trainer: Trainer, trees: list[RolloutTree], rewards: list[float], strategy: str, budget: int
) -> dict[str, float]:
    config = dataclasses.replace(
        trainer.config, algorithm="ppo", gamma=1.0, lam=1.0, strategy=strategy, max_tokens_per_bin=budget
    )
    critic = ppo.Critic.for_policy(trainer.policy, lr=0.0)  # zero-initialized: V_old = 0, A = R = the reward
    return ppo.optimize(trainer.policy, frozen(trainer.policy.parameters()), critic, trees, list(rewards), config)


def test_grpo_and_ppo_report_the_same_figures_however_the_batch_is_split(trainer):
    sizes = [len([b for b in pack_trees(TREES, s, n) if b.num_predictions]) for s, n in SPLITS]
    assert sizes[0] == 1 and sizes[-1] == 8, f"the splits differ ({sizes} micro-batches)"
    # Each tree alone: every ratio is 1 and no clip is active, so ℓ_t = −w_t·A_t and its loss is −r·mean(w).
    alone = [grpo(trainer, [tree], [r], *SPLITS[0]) for tree, r in zip(TREES, REWARDS, strict=True)]
    for m, r, tree in zip(alone, REWARDS, TREES, strict=True):
        assert m["loss"] == pytest.approx(-r * m["is_weight_mean"], rel=1e-5)
        assert m["tokens"] == tree.report.trainable_tokens
    maxima = [m["is_weight_max"] for m in alone]
    assert len(set(maxima)) == len(maxima), "the trees' maxima differ: a mean of maxima would show"
    # The step over all four: its tokens are theirs, its loss the token-weighted mean of theirs, its max the max.
    tokens = sum(m["tokens"] for m in alone)
    reference = grpo(trainer, TREES, REWARDS, *SPLITS[0])
    assert reference["tokens"] == reference["trainable_tokens"] == tokens == 56
    assert reference["loss"] == pytest.approx(sum(m["loss"] * m["tokens"] for m in alone) / tokens, rel=1e-5)
    assert reference["is_weight_max"] == pytest.approx(max(maxima), rel=1e-6)
    # Any split, either algorithm: the same figures.
    for split in SPLITS:
        for name, metrics in (
            ("grpo", grpo(trainer, TREES, REWARDS, *split)),
            ("ppo", ppo_step(trainer, TREES, REWARDS, *split)),
        ):
            for key in SHARED:
                assert metrics[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-9), (name, split, key)
            if name == "grpo":  # the gradient does not depend on the split either (PPO's has the value term too)
                assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), split
