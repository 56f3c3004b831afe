"""One update of the LoRA policy over packed micro-batches: the loop GRPO (``step.py``) and PPO (``ppo.py``) share.

An algorithm brings only its loss per micro-batch (``MicroBatchLoss``): Σ_t u_t·ℓ_t over the micro-batch's
trained tokens (``aggregation="token_sum"``, u_t the token weights of ``batch.py``) and that micro-batch's metrics.
GRPO's is the policy loss with per-token credit; PPO's adds ``value_coef`` times the value loss of its head. The
loop (``run``) zeroes the gradient, runs forward and backward over every micro-batch of ``pack`` with the loss
divided by the step's trainable tokens U = Σ u_t (Dr. GRPO: a constant normalizer, not per-sequence lengths),
clips the policy's gradient norm at ``MAX_GRAD_NORM`` and takes one optimizer step. Summed over the micro-batches
the gradient is that of (1/U)·Σ_t u_t·ℓ_t over the whole step, whatever the split.

Step metrics, defined here once for both algorithms. Up to float rounding none depends on how the trees were split
into micro-batches (bin budget, tree or path layout) but ``tokens_processed``, which measures exactly that:

- ``tokens`` and ``trainable_tokens``: U, the distinct trainable tokens of the step (a shared prefix counts once);
- ``loss``, ``pg_loss``, ``value_loss``: the micro-batches' token sums added up and divided by U, i.e. the mean over
  the step's distinct trainable tokens, with the normalization the gradient uses. ``loss`` is the policy loss ℓ
  of ``loss.policy_loss`` for GRPO and PPO alike, so ``clawgate_trainer_loss`` compares across algorithms; PPO's
  objective is ``loss + value_coef·value_loss`` (during critic warm-up only the second term has a gradient);
- ``is_weight_max``: the largest untruncated importance weight of any trained token of the step;
- every other micro-batch metric (``clip_frac_low``, ``is_weight_mean``, ``approx_kl``, ``value_mean``, …) is a
  token-weighted mean: each micro-batch's mean weighted by its trainable tokens, i.e. the mean over the step;
- ``grad_norm``: the policy's gradient norm before clipping (0 when the step leaves the policy as it is);
- ``tokens_processed``: the tokens the forward passes ran, padding included (``PackedBatch.num_tokens``).

Under ``torchrun`` (``world``, ``distributed.py``) each rank runs forward and backward on its share of the
micro-batches with the same normalizer U, the gradients and metric sums are added up over the ranks, and rank 0
alone clips and steps: the step is the one process's, up to the order of float additions. With the base sharded
(``sharding.py``) a rank with fewer micro-batches than another runs padding passes that add nothing.

Pure torch on the model side; no database.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from prefix_tree import RolloutTree
from trainer.batch import PackedBatch, pack_trees
from trainer.loss import policy_loss

if TYPE_CHECKING:
    from trainer.distributed import World

log = logging.getLogger("clawgate.trainer")

__all__ = ["MAX_GRAD_NORM", "MicroBatchLoss", "Progress", "UpdateSettings", "pack", "policy_term", "run"]

MAX_GRAD_NORM = 1.0
Progress = Callable[[str, int, int], None]  # (phase, micro-batches done, micro-batches)
# A micro-batch (on the policy's device) -> Σ_t u_t·ℓ_t over its trained tokens, and its metrics.
MicroBatchLoss = Callable[[PackedBatch], tuple[Tensor, dict[str, float]]]

# How micro-batch metrics combine into the step's (the module docstring); any other is a token-weighted mean.
_TOKEN_SUMS = frozenset({"loss", "pg_loss", "value_loss"})  # divided by U, as the gradient is
_COUNTS = frozenset({"tokens"})  # added up
_MAXIMA = frozenset({"is_weight_max"})


class UpdateSettings(Protocol):
    """What the update reads from the trainer's configuration (``config.TrainConfig`` has all of it)."""

    clip_low: float
    clip_high: float
    is_cap: float
    temperature: float
    strategy: str
    max_tokens_per_bin: int


def pack(trees: Sequence[RolloutTree], config: UpdateSettings) -> list[PackedBatch]:
    """The step's micro-batches: ``trees`` packed within the bin budget; a bin without a prediction (it would
    need no forward pass and carries no gradient) is left out."""
    batches = pack_trees(trees, config.strategy, config.max_tokens_per_bin)  # type: ignore[arg-type]
    return [b for b in batches if b.num_predictions]


def policy_term(
    logp: Tensor, batch: PackedBatch, advantages: Tensor, config: UpdateSettings
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip with truncated IS (``loss.policy_loss``), summed over ``batch``'s trained tokens with their weights.

    One update per batch: the "old" policy is the current one, so every ratio is 1 and the gradient is that of
    −w·A·logp with w the truncated importance weight against the engine's logprobs.
    """
    return policy_loss(
        logp,
        logp.detach(),
        batch.rollout_logprobs,
        advantages,
        batch.trainable,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        is_cap=config.is_cap,
        aggregation="token_sum",
        weights=batch.weights,
    )


def run(
    policy: Any,
    optimizer: torch.optim.Optimizer | None,
    batches: Sequence[PackedBatch],
    loss_fn: MicroBatchLoss,
    *,
    train_policy: bool = True,
    progress: Progress | None = None,
    world: World | None = None,
    extra: list[torch.nn.Parameter] | None = None,
) -> dict[str, float]:
    """One update of ``policy`` (whose trainable parameters ``optimizer`` holds) over ``batches``.

    ``loss_fn`` may reach other parameters too (PPO's value head): their gradients accumulate with the same
    normalization and their optimizer is the caller's. With ``train_policy=False`` the policy's optimizer takes no
    step (PPO's critic warm-up). With ``world`` this rank trains on its share of ``batches`` and the ranks' gradients
    are added up (``extra``: other parameters ``loss_fn`` reaches, PPO's value head); a rank other than 0 has no
    optimizer and takes no step. Returns the step metrics of the module docstring.
    """
    device = policy.get_input_embeddings().weight.device
    total = float(sum(float(b.weights[b.trainable].sum()) for b in batches))
    normalizer = total or 1.0
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        policy.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    processed = 0
    mine = list(range(len(batches))) if world is None else world.indices(len(batches))
    tokens = 0.0
    for done, i in enumerate(mine):
        b = batches[i].to(device)
        loss, metrics = loss_fn(b)
        (loss / normalizer).backward()
        if progress is not None:
            progress("train", done + 1, len(mine))
        processed += b.num_tokens
        tokens += float(b.weights[b.trainable].sum())
        _accumulate(sums, metrics, float(b.weights[b.trainable].sum()))
    if world is not None and batches:
        for _ in range(world.padding(len(batches))):
            # The sharded base's all-gathers need this rank in as many passes as the busiest rank: the smallest
            # micro-batch again, its loss times 0 (a gradient of zeros, no metrics).
            loss, _ = loss_fn(min(batches, key=lambda b: b.num_tokens).to(device))
            (loss * 0.0).backward()
    if world is not None:
        log.info("rank %d/%d: %d tokens", world.rank, world.size, round(tokens))
        world.sum_gradients(policy, extra)
        sums, processed = _combine(world.gather((sums, processed)))
    grad_norm = 0.0
    if train_policy and optimizer is not None:
        trainable = [p for p in policy.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_norm=MAX_GRAD_NORM))
        optimizer.step()
    step = {k: v if k in _COUNTS or k in _MAXIMA else v / normalizer for k, v in sums.items()}
    step.update({"grad_norm": grad_norm, "tokens_processed": float(processed), "trainable_tokens": total})
    return step


def _combine(shares: list[tuple[dict[str, float], int]]) -> tuple[dict[str, float], int]:
    """The ranks' metric sums and processed tokens, as if one process had run every micro-batch."""
    sums: dict[str, float] = {}
    for share, _ in shares:
        for name, value in share.items():
            sums[name] = max(sums.get(name, value), value) if name in _MAXIMA else sums.get(name, 0.0) + value
    return sums, sum(processed for _, processed in shares)


def _accumulate(sums: dict[str, float], metrics: Mapping[str, float], tokens: float) -> None:
    """Add one micro-batch's metrics (its trainable tokens: ``tokens``); ``run`` divides by U at the end."""
    for name, value in metrics.items():
        if name in _MAXIMA:
            sums[name] = max(sums.get(name, value), value)
        else:
            sums[name] = sums.get(name, 0.0) + (value if name in _TOKEN_SUMS or name in _COUNTS else value * tokens)
