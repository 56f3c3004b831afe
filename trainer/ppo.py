"""PPO over packed prefix trees: a value head on the policy's last hidden states and GAE along every branch.

The critic is a ``Linear(hidden, 1)`` (``ValueHead``) on the final hidden state the policy's output projection
reads; the LoRA model is the shared trunk. The value of trained token t is read where the logits that predict t
are read (its prediction's source position), so V_t is the value of the state in which token t was sampled. The
head has its own parameters and optimizer (``Critic``) and is saved as ``value_head.safetensors`` inside each
policy version, with the number of updates it has had (for the warm-up).

One step (``optimize``):

1. a forward pass without gradient gives V_old at every trained token of every tree (``pack_trees`` layout; it
   costs about a third of the training pass);
2. GAE along each kept root-to-leaf path of each tree, separately (``advantages.gae``; the rollout reward is the
   terminal reward of every path's last trained token, ``advantages.terminal_rewards``). A path's steps are its
   trained tokens in order; context between them is the environment's transition. Values are never mixed across
   sibling branches: a branch's GAE reads only the values on its own path;
3. a forward pass with gradient: PPO-clip with truncated IS (``loss.policy_loss``) plus ``value_coef`` times the
   clipped value loss (``loss.value_loss``) against the returns, both summed over distinct trained tokens and
   divided by their number, in the update loop GRPO uses too (``update.run``, which also defines the step's
   metrics); then one optimizer step for the LoRA and one for the head.

A shared prefix token lies on c kept paths, and each path gives it its own advantage and return (they differ
when γ < 1 or λ < 1: the futures below the branch point differ). The token's advantage and return are defined as
their **mean over the c kept paths through it**. Why: the per-path layout gives every copy the weight 1/c, so
per-path PPO sums (1/c)·ℓ(A_p, R_p) over the copies. With one update per batch, logp_old is the current policy and
V_old the current head, so every ratio is 1, V = V_old and no clip is active; there the gradients are linear in
the targets (−w·A·∇logp for the policy, (V − R)·∇V for the value), so Σ_p (1/c)·∇ℓ(A_p, R_p) = ∇ℓ(mean A, mean R):
the mean gives per-path PPO's exact gradient while a shared prefix is computed and counted once, and the tree
and per-path layouts give the same loss, gradients and metrics (a sub-forest split of a large tree splits the
token's weight, not its targets). Only the reported value loss is lower than a per-path one, by the variance of
the returns across the branches (½·Var_p R_p per shared token). Several epochs over one batch would make the
ratios move and the two differ; this step does not do that. A root's first token has no prediction, hence no
value, and is no step.

Critic warm-up: while the head has had fewer than ``critic_warmup_steps`` updates, the step trains only the head
(the trunk runs without gradient, the LoRA weights stay as they are), so the first policy updates use a critic
that already predicts the returns rather than the zero-initialized head. The rollouts of a warm-up step are
consumed like any other: the trainer trains on each rollout once. ``value_coef`` scales the value loss for the
trunk and the head alike; the head's Adam step hardly depends on that scale, but 0 leaves the critic untrained.

Pure torch on the model side; no database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_

from prefix_tree import RolloutTree
from trainer import update
from trainer.advantages import gae, terminal_rewards
from trainer.batch import PackedBatch
from trainer.distributed import UpdateConfig, Work, World
from trainer.logprobs import logprobs_from_logits
from trainer.loss import value_loss
from trainer.update import UpdateSettings

__all__ = [
    "VALUE_HEAD",
    "Branch",
    "Critic",
    "Key",
    "PPOSettings",
    "ValueHead",
    "branch_gae",
    "explained_variance",
    "optimize",
    "token_targets",
]

VALUE_HEAD = "value_head.safetensors"
Key = tuple[int, int]  # (node id, position in the path): one token of one tree
TokenKey = tuple[int, int, int]  # (tree index, node id, position): one token of one step


class PPOSettings(UpdateSettings, Protocol):
    """What ``optimize`` reads from the trainer's configuration (``config.TrainConfig`` has all of it)."""

    gamma: float
    lam: float
    value_coef: float
    value_clip: float | None
    critic_warmup_steps: int


# ------------------------------------------------------------------------------------------------ the critic


class ValueHead(nn.Module):
    """V(s) = w·h + b on the last hidden state h, in float32 whatever the trunk's dtype.

    Zero-initialized: every value starts at 0 (the advantage of the first steps is then the plain return), and
    the gradient into the shared trunk starts at 0 too, so a fresh head cannot disturb the policy.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] hidden states -> [...] values."""
        out: Tensor = self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)
        return out


class Critic:
    """The value head, its own optimizer, and how many updates it has had (the warm-up counts them)."""

    def __init__(self, hidden_size: int, *, lr: float, device: torch.device | str = "cpu", updates: int = 0) -> None:
        self.head = ValueHead(hidden_size).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=0.0)
        self.updates = updates

    @staticmethod
    def hidden_size(policy: Any) -> int:
        """The width of the hidden state the policy's output projection reads."""
        return int(policy.get_output_embeddings().weight.shape[1])

    @classmethod
    def for_policy(cls, policy: Any, *, lr: float) -> Critic:
        """A fresh head on the policy's device."""
        return cls(cls.hidden_size(policy), lr=lr, device=policy.get_input_embeddings().weight.device)

    def save(self, directory: Path) -> None:
        """Write ``directory/value_head.safetensors`` (usable as ``lora.save_version``'s ``extra``)."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(tensors, str(Path(directory) / VALUE_HEAD), metadata={"updates": str(self.updates)})

    @classmethod
    def load(cls, directory: Path, *, lr: float, device: torch.device | str = "cpu") -> Critic:
        """The head saved in a version directory (its optimizer state starts afresh, as the policy's does)."""
        path = Path(directory) / VALUE_HEAD
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
            meta = f.metadata() or {}
        critic = cls(int(tensors["linear.weight"].shape[1]), lr=lr, device=device, updates=int(meta.get("updates", 0)))
        critic.head.load_state_dict(tensors)
        return critic

    @staticmethod
    def saved_in(directory: Path) -> bool:
        return (Path(directory) / VALUE_HEAD).exists()


# ------------------------------------------------------------------------------------------------ GAE on a tree


@dataclass(frozen=True)
class Branch:
    """GAE along one kept root-to-leaf path: its steps (trained tokens, in order) and their targets."""

    leaf: int  # node id
    keys: tuple[Key, ...]
    values: npt.NDArray[np.float64]
    advantages: npt.NDArray[np.float64]
    returns: npt.NDArray[np.float64]


def branch_gae(
    tree: RolloutTree,
    reward: float | Mapping[str, float],
    values: Mapping[Key, float],
    *,
    gamma: float,
    lam: float,
) -> list[Branch]:
    """GAE along every kept path of one rollout's tree, each path on its own (see the module docstring).

    ``values`` maps (node id, position) of every trained token but a root's first to V_old. A path with no
    trained token yields no branch. ``reward`` is the rollout's reward (at the path's last trained token), or
    a reward per generating call for a tree of turns: then each turn's tokens are an episode of their own, with
    the turn's reward at its last token and nothing after it (its next state was the environment's answer, and
    the turns that follow are credited by their own rewards).
    """
    out: list[Branch] = []
    for leaf in tree.leaves():
        located = [
            ((node.id, node.depth + int(i)), node.generator)
            for node in leaf.chain()
            for i in np.flatnonzero(node.trainable)
        ]
        located = [(k, g) for k, g in located if k[1] > 0]  # position 0 has no source position, hence no prediction
        if not located:
            continue
        keys = tuple(k for k, _ in located)
        try:
            v = np.array([values[k] for k in keys], dtype=np.float64)
        except KeyError as e:
            raise ValueError(f"no value for trained token (node, position) {e.args[0]} of leaf {leaf.id}") from None
        if isinstance(reward, Mapping):
            adv, ret = np.zeros(len(keys)), np.zeros(len(keys))
            start = 0
            for end in range(1, len(located) + 1):  # one episode per run of tokens of one call
                if end < len(located) and located[end][1] == located[start][1]:
                    continue
                call = located[start][1]
                if call is None or call not in reward:
                    raise ValueError(f"no reward for the call that generated node {keys[start][0]}")
                seg = slice(start, end)
                rewards = terminal_rewards(np.ones(end - start, dtype=np.bool_), reward[call])
                adv[seg], ret[seg] = gae(rewards, v[seg], gamma=gamma, lam=lam)
                start = end
        else:
            rewards = terminal_rewards(np.ones(len(keys), dtype=np.bool_), reward)
            adv, ret = gae(rewards, v, gamma=gamma, lam=lam)
        out.append(Branch(leaf.id, keys, v, adv, ret))
    return out


def token_targets(branches: Sequence[Branch]) -> dict[Key, tuple[float, float]]:
    """(advantage, return) of every trained token of a tree: the means over the kept paths through it."""
    sums: dict[Key, list[float]] = {}
    for branch in branches:
        for k, a, r in zip(branch.keys, branch.advantages.tolist(), branch.returns.tolist(), strict=True):
            acc = sums.setdefault(k, [0.0, 0.0, 0.0])
            acc[0] += a
            acc[1] += r
            acc[2] += 1.0
    return {k: (a / n, r / n) for k, (a, r, n) in sums.items()}


# ------------------------------------------------------------------------------------------------ model side


def _forward(policy: Any, batch: PackedBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """[P] logprobs and [P, H] last hidden states of every prediction of ``batch`` (at its source position).

    As ``logprobs.prediction_logits``, and the hidden states are the input of the output projection, caught by a
    forward pre-hook: that input is exactly the final hidden state at the kept source positions, for any causal
    LM, without keeping every layer's hidden states as ``output_hidden_states`` would.
    """
    weight = policy.get_input_embeddings().weight
    inputs = batch.model_inputs(getattr(policy.config, "_attn_implementation", None), weight.dtype)
    keep = torch.unique(batch.sources)  # sorted
    caught: list[Tensor] = []

    def catch(module: nn.Module, args: tuple[Any, ...]) -> None:
        caught.append(args[0])

    handle = policy.get_output_embeddings().register_forward_pre_hook(catch)
    try:
        out = policy(**inputs, logits_to_keep=keep, use_cache=False)
    finally:
        handle.remove()
    if len(caught) != 1:
        raise RuntimeError(f"expected one call of the output projection, saw {len(caught)}")
    at = torch.searchsorted(keep, batch.sources)
    logits = out.logits[batch.rows, at].float()
    if temperature != 1.0:
        logits = logits / temperature
    return logprobs_from_logits(logits, batch.targets), caught[0][batch.rows, at]


def _keys(batch: PackedBatch) -> list[TokenKey]:
    """(tree index, node id, position) of every prediction."""
    return list(zip(batch.rollout_index.tolist(), batch.nodes.tolist(), batch.depths.tolist(), strict=True))


def _lookup(keys: list[TokenKey], table: Mapping[TokenKey, float], device: Any) -> Tensor:
    return torch.tensor([table[k] for k in keys], dtype=torch.float32, device=device)


def optimize(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    critic: Critic,
    trees: Sequence[RolloutTree],
    rewards: Sequence[float | Mapping[str, float]],
    config: PPOSettings,
    *,
    rollout_advantages: dict[int, float] | None = None,
    call_advantages: dict[str, float] | None = None,
    progress: update.Progress | None = None,
    world: World | None = None,
) -> dict[str, float]:
    """One PPO step over ``trees`` (one rollout each, with its reward): GAE per branch, then one update (shared with
    the other ranks under torchrun: ``world``, ``distributed.py``).

    A tree's reward is a number (the rollout's) or a mapping from generating call to reward (a tree of turns:
    see ``branch_gae``). ``optimizer`` holds the policy's trainable (LoRA) parameters, ``critic`` the value head
    and its optimizer. When ``rollout_advantages`` is given it receives, per tree index, the mean advantage over
    that tree's distinct trained tokens; ``call_advantages`` the same per generating call. Returns the step
    metrics of ``update.run`` (``loss``, ``pg_loss``, ``tokens``, ``is_weight_max``, ``grad_norm`` — 0 in
    warm-up —, ``tokens_processed`` of the update's forward passes, ``trainable_tokens``, …) with ``value_loss``
    and ``value_clip_frac`` among them (before the update), and ``explained_variance`` (1 − Var(R − V_old)/Var(R)
    over distinct trained tokens; left out when the returns have no variance), ``value_mean``, ``return_mean``,
    ``advantage_mean``, ``advantage_std``, ``critic_warmup`` (1 on a warm-up step) and ``value_grad_norm``.
    """
    if len(trees) != len(rewards):
        raise ValueError(f"{len(trees)} trees but {len(rewards)} rewards")
    if config.value_coef < 0:
        raise ValueError(f"value_coef must be >= 0, got {config.value_coef}")
    batches = update.pack(trees, config)
    old_values = _old_values(policy, critic, batches, config, progress, world)
    advantages, returns = _targets(trees, rewards, old_values, config, rollout_advantages, call_advantages)

    # One update: policy loss + value_coef · value loss (warm-up: the value loss alone, trunk frozen).
    warmup = critic.updates < config.critic_warmup_steps
    critic.optimizer.zero_grad(set_to_none=True)
    targets = (advantages, returns, old_values)
    loss = micro_batch_loss(policy, critic, config, targets, warmup=warmup)
    head = list(critic.head.parameters())
    if world is not None:
        state = {k: v.detach().cpu() for k, v in critic.head.state_dict().items()}
        cfg = UpdateConfig.of(config)
        world.send(Work(batches, cfg, targets=targets, head=state, warmup=warmup))
        world.share_weights(policy)
    metrics = update.run(
        policy, optimizer, batches, loss, train_policy=not warmup, progress=progress, world=world, extra=head
    )
    value_grad_norm = clip_grad_norm_(critic.head.parameters(), max_norm=update.MAX_GRAD_NORM)
    critic.optimizer.step()
    critic.updates += 1

    adv_all = np.array(list(advantages.values()), dtype=np.float64)
    metrics["advantage_mean"] = float(adv_all.mean()) if adv_all.size else 0.0
    metrics["advantage_std"] = float(adv_all.std()) if adv_all.size else 0.0
    metrics["critic_warmup"] = float(warmup)
    metrics["value_grad_norm"] = float(value_grad_norm)
    ev = explained_variance([old_values[k] for k in returns], list(returns.values()))
    if ev is not None:
        metrics["explained_variance"] = ev
    return metrics


def _old_values(
    policy: Any,
    critic: Critic,
    batches: Sequence[PackedBatch],
    config: PPOSettings,
    progress: update.Progress | None,
    world: World | None,
) -> dict[TokenKey, float]:
    """V_old at every trained token, without gradient; copies of a token (per-path rows) hold the same state:
    their mean. Under torchrun the ranks share the micro-batches as the update does and rank 0 adds up their sums."""
    if world is not None:
        state = {k: v.detach().cpu() for k, v in critic.head.state_dict().items()}
        world.send(Work(list(batches), UpdateConfig.of(config), head=state, values=True))
        world.share_weights(policy)
    mine = value_sums(policy, critic, batches, config.temperature, world, progress)
    total: dict[TokenKey, list[float]] = {}
    for share in [mine] if world is None else world.gather(mine):
        for k, (s, n) in share.items():
            acc = total.setdefault(k, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    return {k: s / n for k, (s, n) in total.items()}


def value_sums(
    policy: Any,
    critic: Critic,
    batches: Sequence[PackedBatch],
    temperature: float,
    world: World | None,
    progress: update.Progress | None = None,
) -> dict[TokenKey, tuple[float, float]]:
    """Σ V_old and the number of copies of every trained token of this rank's share of ``batches`` (all of them
    without ``world``), from forward passes without gradient."""
    device = policy.get_input_embeddings().weight.device
    mine = list(range(len(batches))) if world is None else world.indices(len(batches))
    sums: dict[TokenKey, tuple[float, float]] = {}
    with torch.no_grad():
        for done, i in enumerate(mine):
            b = batches[i]
            _, hidden = _forward(policy, b.to(device), temperature)
            for k, v in zip(_keys(b), critic.head(hidden).tolist(), strict=True):
                acc = sums.setdefault(k, (0.0, 0.0))
                sums[k] = (acc[0] + v, acc[1] + 1.0)
            if progress is not None:
                progress("values", done + 1, len(mine))
        for _ in range(world.padding(len(batches)) if world is not None and batches else 0):
            _forward(policy, min(batches, key=lambda b: b.num_tokens).to(device), temperature)  # update.run's padding
    return sums


def _targets(
    trees: Sequence[RolloutTree],
    rewards: Sequence[float | Mapping[str, float]],
    old_values: Mapping[TokenKey, float],
    config: PPOSettings,
    rollout_advantages: dict[int, float] | None,
    call_advantages: dict[str, float] | None,
) -> tuple[dict[TokenKey, float], dict[TokenKey, float]]:
    """GAE per branch, tree by tree: every trained token's advantage and return (means over the paths through it),
    and the per-tree and per-call mean advantages ``optimize`` reports."""
    per_tree: list[dict[Key, float]] = [{} for _ in trees]
    for (index, node, pos), v in old_values.items():
        per_tree[index][(node, pos)] = v
    advantages: dict[TokenKey, float] = {}
    returns: dict[TokenKey, float] = {}
    per_call: dict[str, list[float]] = {}
    for index, (tree, reward) in enumerate(zip(trees, rewards, strict=True)):
        credit = reward if isinstance(reward, Mapping) else float(reward)
        targets = token_targets(branch_gae(tree, credit, per_tree[index], gamma=config.gamma, lam=config.lam))
        for (node, pos), (a, r) in targets.items():
            advantages[(index, node, pos)] = a
            returns[(index, node, pos)] = r
            generator = tree.nodes[node].generator
            if generator is not None:
                per_call.setdefault(generator, []).append(a)
        if rollout_advantages is not None and targets:
            rollout_advantages[index] = float(np.mean([a for a, _ in targets.values()]))
    if call_advantages is not None:
        call_advantages.update({call: float(np.mean(values)) for call, values in per_call.items()})
    return advantages, returns


def micro_batch_loss(
    policy: Any,
    critic: Critic,
    config: PPOSettings,
    targets: tuple[Mapping[TokenKey, float], Mapping[TokenKey, float], Mapping[TokenKey, float]],
    *,
    warmup: bool,
) -> update.MicroBatchLoss:
    """PPO's loss of one micro-batch for ``update.run``: the policy term plus ``value_coef`` times the clipped value
    loss against the returns (``targets``: advantages, returns, V_old per token), both token sums."""

    def loss(b: PackedBatch) -> tuple[Tensor, dict[str, float]]:
        adv, ret, old = (_lookup(_keys(b), table, b.targets.device) for table in targets)
        with torch.set_grad_enabled(not warmup):
            logp, hidden = _forward(policy, b, config.temperature)
        vloss, vm = value_loss(
            critic.head(hidden),
            ret,
            b.trainable,
            old_values=old,
            clip=config.value_clip,
            weights=b.weights,
            aggregation="token_sum",
        )
        ploss, pm = update.policy_term(logp, b, adv, config)
        total = config.value_coef * vloss if warmup else ploss + config.value_coef * vloss
        return total, {**pm, **vm}

    return loss


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float | None:
    """1 − Var(R − V)/Var(R): 1 for a perfect critic, 0 for a constant one; None when Var(R) = 0."""
    r = np.asarray(returns, dtype=np.float64)
    if r.size == 0:
        return None
    var = float(r.var())
    if var <= 1e-12 * max(1.0, float(np.square(r).mean())):
        return None
    return 1.0 - float((r - np.asarray(values, dtype=np.float64)).var()) / var
