"""Sharding the frozen base across the ranks (``clawgate train --shard`` under torchrun): FSDP2's ``fully_shard``.

Each decoder layer (the classes a Hugging Face model names in ``_no_split_modules``) is one FSDP unit and the root
model (embeddings, final norm, output projection) another: a rank holds 1/W of the base's weights and gathers one
unit's at a time for its forward and backward passes, so a base that does not fit one device fits W of them.

The LoRA weights stay outside the shards (``ignored_params``): they are replicated on every rank and trained as in
the unsharded data-parallel trainer (``distributed.py``): rank 0 broadcasts them before each update, the ranks sum
their gradients with ``all_reduce``, and rank 0 alone clips and takes the optimizer step. That keeps one design for
both modes, and it keeps save, publish, restore, rollback and a switch of lineage what they are on one process: the
adapter is whole on rank 0, so nothing is gathered to publish it (``get_model_state_dict`` with full state dicts
would do that for sharded trainable weights) and nothing is set on the other ranks but the next update's broadcast.
A LoRA's weights are a fraction of a percent of the base's (``README.md``: sizes), so replicating them costs little
memory and one broadcast and one all-reduce of that size per update.

The frozen base has no gradient, so FSDP reduces nothing; its collectives are the all-gathers of each unit's
weights, which every rank must join in the same order: every rank runs the same number of forward and backward
passes (``update.run`` pads a rank with fewer micro-batches with a pass whose loss is multiplied by 0), and no rank
runs the policy alone (PPO's V_old pass is shared the same way: ``ppo._old_values``).

Mixed precision (``--mixed-precision bf16``): the gathered weights are cast to bfloat16 for the computation
(``MixedPrecisionPolicy``); the shards stay in the dtype they were loaded in and the LoRA in float32. Activation
checkpointing (``--gradient-checkpointing``) is the model's own and recomputes inside the units.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from trainer.distributed import trainable

log = logging.getLogger("clawgate.trainer")

MIXED_PRECISION = ("no", "bf16")


def shard(policy: Any, *, device: str = "cpu", mixed_precision: str = "no") -> None:
    """Shard ``policy``'s frozen base in place over the default process group (its LoRA stays whole), and put it on
    ``device``: each rank's shards, the LoRA and the buffers; the base may be in host memory until then, so a rank's
    device never holds the whole of it."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import DTensor
    except ImportError as exc:
        raise RuntimeError(f"--shard needs FSDP2 (torch 2.7 or newer), this is {torch.__version__}") from exc
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise RuntimeError(f"--shard needs FSDP2 with ignored_params (torch 2.7 or newer), this is {torch.__version__}")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    base = policy.get_base_model()
    unit_names = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in base.modules() if type(m).__name__ in unit_names]
    if not units:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules) to shard by")
    lora = set(trainable(policy))
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None)
    for unit in units:
        fully_shard(unit, mp_policy=precision, ignored_params=lora)
    fully_shard(base, mp_policy=precision, ignored_params=lora)
    policy.to(device)
    frozen = [p for p in base.parameters() if not p.requires_grad]
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in frozen)
    log.info(
        "rank %d/%d: holds %d of the base's %d weights (%d units)",
        dist.get_rank(),
        dist.get_world_size(),
        held,
        sum(p.numel() for p in frozen),
        len(units) + 1,
    )


__all__ = ["MIXED_PRECISION", "shard"]
