"""The trainer on several processes: ``clawgate train`` under ``torchrun`` (or any launcher that sets the
torch.distributed environment: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), data-parallel over the
LoRA update.

Rank 0 is the trainer as on one process: it alone opens the database (claims what is ready, builds the trees and
the micro-batches, publishes). The other ranks only compute gradients. At each update (``update.run``):

1. rank 0 sends the step's work to every rank (``broadcast_object_list``): the micro-batches and what gives each
   trained token its target: GRPO's credit table (``credit.CreditTable``, read by the batch's contents), or PPO's
   advantages, returns and old values per token with the value head's weights (rank 0 computes V_old and GAE);
2. rank 0 broadcasts the policy's trainable (LoRA) weights, so every rank computes with the weights rank 0 holds,
   after a restore, a rollback or a switch of lineage as much as after a step;
3. micro-batch i goes to rank i mod W; each rank runs forward and backward on its share with the loss divided by
   the whole step's trainable tokens U (``update.run``'s normalizer, the same on every rank);
4. the gradients (the LoRA's, and PPO's value head's) are summed over the ranks (``all_reduce``): Σ over
   micro-batches of their gradients, as on one process up to the order of float additions; rank 0 clips and takes
   the optimizer steps (the others keep no optimizer: their weights come from rank 0 at the next update). The
   metrics' sums are combined the same way.

Rank 0 builds the batches and sends them, rather than each rank building its own shard from a deterministic split,
because what is ready is whatever the database holds at the moment of the claim, and only one process may claim it
(each turn and rollout is consumed exactly once); a LoRA step's batches (token ids, logprobs) are small beside the
model. Each rank logs one line per update, ``rank R/W: N tokens`` (the trainable tokens it trained on).

A rank that dies ends the next collective on every rank with an error: rank 0 has not published (publishing comes
after the update), raises ``WorldLost`` and exits, so the launcher restarts the group (``torchrun --max-restarts``);
the new rank 0 resumes from the last published version and what the lost step would have consumed is still ready.

PPO's V_old pass (forward only, about a third of a PPO step) is shared the same way before the update: rank 0 sends
the micro-batches and the value head (``Work.values``), each rank computes V_old on its share, and rank 0 gathers the
sums (``ppo._old_values``).

With ``--shard`` (``sharding.py``) the frozen base is sharded over the ranks with FSDP2 instead of held whole by each;
the LoRA and everything above stay as described here. The sharded units' all-gathers need every rank in every
forward and backward pass: a rank with fewer micro-batches than another runs a padding pass (``World.padding``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from trainer.batch import PackedBatch
from trainer.credit import CreditTable

log = logging.getLogger("clawgate.trainer")

# How long a collective waits for the other ranks (a rank whose process died is usually noticed at once).
TIMEOUT = dt.timedelta(minutes=30)


class WorldLost(RuntimeError):
    """A collective failed: a rank died or cannot be reached. The group must be restarted by its launcher."""


@dataclass(slots=True)
class UpdateConfig:
    """What a rank's loss reads of the trainer's configuration (``update.UpdateSettings``, ``ppo.PPOSettings``)."""

    temperature: float
    clip_low: float
    clip_high: float
    is_cap: float
    value_coef: float = 0.0
    value_clip: float | None = None
    gamma: float = 1.0
    lam: float = 1.0
    critic_warmup_steps: int = 0
    strategy: str = ""
    max_tokens_per_bin: int = 0

    @classmethod
    def of(cls, config: Any) -> UpdateConfig:
        return cls(
            config.temperature,
            config.clip_low,
            config.clip_high,
            config.is_cap,
            config.value_coef,
            config.value_clip,
            config.gamma,
            config.lam,
            config.critic_warmup_steps,
        )


TokenTargets = tuple[dict[Any, float], dict[Any, float], dict[Any, float]]


@dataclass(frozen=True, slots=True)
class Work:
    """One update, as rank 0 sends it: the micro-batches and their tokens' targets, GRPO's or PPO's."""

    batches: list[PackedBatch]
    config: UpdateConfig
    credits: CreditTable | None = None  # GRPO: each trained token's advantage
    targets: TokenTargets | None = None  # PPO: advantages, returns and V_old per token
    head: dict[str, torch.Tensor] | None = None  # PPO: the value head's weights
    warmup: bool = False  # PPO's critic warm-up: the value loss alone
    values: bool = False  # PPO: only V_old of the batches (forward, no update), gathered to rank 0


@dataclass(frozen=True, slots=True)
class World:
    rank: int
    size: int
    sharded: bool = False  # the base is sharded (FSDP2): every rank runs the same number of passes

    @property
    def main(self) -> bool:
        return self.rank == 0

    def indices(self, n: int) -> list[int]:
        """The micro-batches of ``n`` this rank trains on."""
        return list(range(self.rank, n, self.size))

    def padding(self, n: int) -> int:
        """The padding passes this rank runs beside its share of ``n`` micro-batches: with the base sharded, as many
        as it has fewer than the busiest rank (every rank must join every pass's all-gathers); else none."""
        return -(-n // self.size) - len(self.indices(n)) if self.sharded else 0

    def send(self, work: Work | None) -> Work | None:
        """Rank 0: send ``work`` (None: stop); the others: receive it."""
        import torch.distributed as dist

        box: list[Any] = [work if self.main else None]
        _collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def share_weights(self, policy: Any) -> None:
        """Every rank gets rank 0's trainable weights."""
        import torch.distributed as dist

        with torch.no_grad():
            for param in trainable(policy):
                _collective(dist.broadcast, param.data, src=0)

    def sum_gradients(self, policy: Any, extra: list[torch.nn.Parameter] | None = None) -> None:
        """Add up the gradients of the trainable parameters (and of ``extra``: PPO's value head) over the ranks (a
        rank with none adds zeros)."""
        import torch.distributed as dist

        for param in [*trainable(policy), *(extra or [])]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            _collective(dist.all_reduce, param.grad, op=dist.ReduceOp.SUM)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        _collective(dist.all_gather_object, out, value)
        return out


def trainable(policy: Any) -> list[torch.nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def _collective(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, ...) when a peer is gone
        raise WorldLost(f"another trainer rank is gone ({type(exc).__name__}: {exc})") from exc


def from_env(device: str, *, shard: bool = False) -> World | None:
    """The process group of this launch (None: one process). ``device`` is the trainer's resolved device: NCCL on
    GPUs (each rank on its ``LOCAL_RANK``'s GPU), gloo on CPUs. ``shard``: the base is to be sharded
    (``sharding.py``)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return World(dist.get_rank(), dist.get_world_size(), sharded=shard)


def close(world: World | None) -> None:
    if world is None:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its work is done and its group closed, without the interpreter's
    finalization.

    After a clean ``destroy_process_group``, torch's distributed runtime sometimes aborts in its C++ destructors at
    interpreter exit (``terminate called without an active exception``, SIGABRT: measured in 2 of 45 two-rank sharded
    steps on CPU). The launcher reads that as a failed rank and the group's exit status as a failure although the step
    was published. Nothing of the rank's work is left to finalize here (the database is disposed, the adapter
    directory's lock released), so the output is flushed and the process ends at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(world: World, policy: Any) -> int:
    """A rank other than 0: compute gradients for every update rank 0 sends, until it says stop; the number of
    updates served."""
    from trainer import ppo, update

    served = 0
    policy.train()
    critic: ppo.Critic | None = None
    while True:
        work = world.send(None)
        if work is None:
            return served
        world.share_weights(policy)
        if work.head is not None:  # PPO
            critic = critic or ppo.Critic.for_policy(policy, lr=0.0)
            critic.head.load_state_dict(work.head)
            critic.head.zero_grad(set_to_none=True)
        if work.values:
            assert critic is not None
            world.gather(ppo.value_sums(policy, critic, work.batches, work.config.temperature, world))
            continue
        if work.targets is not None and critic is not None:
            loss = ppo.micro_batch_loss(policy, critic, work.config, work.targets, warmup=work.warmup)
            head = list(critic.head.parameters())
            update.run(policy, None, work.batches, loss, train_policy=not work.warmup, world=world, extra=head)
        else:
            assert work.credits is not None
            update.run(policy, None, work.batches, _grpo_loss(policy, work.credits, work.config), world=world)
        served += 1


def _grpo_loss(policy: Any, credits: CreditTable, config: UpdateConfig) -> Any:
    """GRPO's loss of one micro-batch, as rank 0's ``Trainer._optimize`` builds it."""
    from trainer import update
    from trainer.logprobs import sequence_logprobs

    def loss(batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = sequence_logprobs(policy, batch, temperature=config.temperature)
        return update.policy_term(logp, batch, credits.for_batch(batch), config)

    return loss


__all__ = [
    "TIMEOUT",
    "UpdateConfig",
    "Work",
    "World",
    "WorldLost",
    "close",
    "exit_rank",
    "from_env",
    "serve",
    "trainable",
]
