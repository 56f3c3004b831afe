"""Advantages from rollout rewards: GRPO group normalization broadcast over a rollout's branches, and GAE per branch.

A rollout of a black-box harness is a prefix tree with several kept branches but one reward. GRPO normalizes
that reward against the other rollouts of its *group* and gives the one resulting advantage to every branch of
the rollout; PPO estimates advantages along each branch separately with a value head and never propagates them
across sibling branches (ClawGym II, "tree-structured GRPO and PPO"). The group is the task–harness pair the
gateway stores as ``Rollout.group_key``: two harnesses on the same task never share a baseline, because their
interaction patterns and reward distributions differ (ClawGym II, "mixed-harness training").

Group advantage of rollout i in a group G of n rollouts with rewards r:

    GRPO (Shao et al. 2024, DeepSeekMath §4.1.2):    A_i = (r_i − mean(r)) / (std(r) + eps)
    Dr. GRPO (Liu et al. 2025, §3.1):                A_i =  r_i − mean(r)          (scale_by_std=False)
    leave-one-out baseline (RLOO; Kool et al. 2019, Ahmadian et al. 2024):
        b_i = (Σ_j r_j − r_i) / (n − 1)   ⇒   r_i − b_i = n/(n − 1) · (r_i − mean(r))

``std`` is the population standard deviation of the group (ddof=0), so a group's standardized advantages have
unit variance; implementations that use the unbiased estimator differ by the factor sqrt((n − 1)/n).

Groups without signal are *skipped* by default: a group whose rewards are all equal (within a relative
tolerance, so float noise such as 0.3 vs 0.1 + 0.2 counts as equal) has every advantage zero, and a group of one
rollout has no baseline. Training on them only adds tokens that dilute the token-mean loss of the others and the
KL/entropy terms (the reason DAPO's dynamic sampling filters them), so the caller leaves them out of the batch.
``zero_variance="zero"`` keeps them with advantage 0 instead.

Pure: numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "SINGLETON",
    "ZERO_VARIANCE",
    "AdvantageResult",
    "BranchAdvantage",
    "GroupStats",
    "batch_advantages",
    "broadcast",
    "gae",
    "group_advantages",
    "terminal_rewards",
    "turn_advantages",
]

Baseline = Literal["mean", "leave_one_out"]
ZeroVariance = Literal["skip", "zero"]
FloatArray = npt.NDArray[np.float64]
P = TypeVar("P")

# Why a group carries no signal.
ZERO_VARIANCE = "zero_variance"
SINGLETON = "singleton"

# Above this magnitude, deviations r_i − mean could overflow float64: work in units of max|r| instead.
_SAFE_MAGNITUDE = 1e150


@dataclass(frozen=True)
class GroupStats:
    """Reward statistics of one group: size, mean, population std, and why it was skipped (None if trained)."""

    n: int
    mean: float
    std: float
    skipped: str | None = None


@dataclass(frozen=True)
class AdvantageResult:
    """Per-rollout advantages of the trained rollouts, the skipped rollouts with the reason, and group stats."""

    advantages: dict[str, float]
    skipped: dict[str, str]  # rollout id -> ZERO_VARIANCE | SINGLETON
    groups: dict[str, GroupStats]


class BranchAdvantage(NamedTuple, Generic[P]):
    """One branch (path) of a rollout with the rollout's advantage."""

    rollout_id: str
    path: P
    advantage: float


def group_advantages(
    rewards: Mapping[str, float],
    groups: Mapping[str, str],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    baseline: Baseline = "mean",
    zero_variance: ZeroVariance = "skip",
    rtol: float = 1e-13,
    atol: float = 1e-12,
) -> AdvantageResult:
    """GRPO advantages of rollouts normalized within their groups (see the module docstring for the formulas).

    ``rewards`` maps rollout id to reward; ``groups`` maps rollout id to its group key (every rewarded rollout
    needs one; extra entries are ignored). A group counts as zero-variance when
    ``max(r) − min(r) <= rtol · max|r| + atol``: float64 carries ~16 significant digits, and rtol = 1e-13 leaves
    about 450 units in the last place for the noise of computing a reward (0.1 + 0.2 vs 0.3) while 1e12 and
    1e12 + 1 still differ; atol = 1e-12 treats noise around zero the same way (rewards that genuinely live below
    ~1e-12 need ``atol=0``). Under ``zero_variance="skip"`` its rollouts, and those of single-rollout groups,
    are reported in ``skipped`` and get no advantage; under ``"zero"`` they get 0.0. NaN or infinite rewards
    raise ``ValueError``.
    """
    _check_options(baseline, zero_variance, eps, rtol, atol)
    advantages: dict[str, float] = {}
    skipped: dict[str, str] = {}
    stats: dict[str, GroupStats] = {}
    for key, ids in _members(rewards, groups).items():
        r = np.array([rewards[i] for i in ids], dtype=np.float64)
        group, adv = _normalize_group(r, scale_by_std=scale_by_std, eps=eps, baseline=baseline, rtol=rtol, atol=atol)
        stats[key] = group
        if group.skipped is not None and zero_variance == "skip":
            for i in ids:
                skipped[i] = group.skipped
            continue
        for i, a in zip(ids, adv.tolist(), strict=True):
            advantages[i] = a
    return AdvantageResult(advantages=advantages, skipped=skipped, groups=stats)


def _check_options(baseline: str, zero_variance: str, eps: float, rtol: float, atol: float) -> None:
    """Reject unknown baselines and zero-variance policies, and negative tolerances."""
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', not {baseline!r}")
    if zero_variance not in ("skip", "zero"):
        raise ValueError(f"zero_variance must be 'skip' or 'zero', not {zero_variance!r}")
    if not (eps >= 0 and rtol >= 0 and atol >= 0):
        raise ValueError("eps, rtol and atol must be >= 0")


def _members(rewards: Mapping[str, float], groups: Mapping[str, str]) -> dict[str, list[str]]:
    """Rollout ids by group key, in reward order; a non-finite reward or a rollout without group raises."""
    members: dict[str, list[str]] = {}
    for rid, reward in rewards.items():
        if not math.isfinite(reward):
            raise ValueError(f"rollout {rid!r}: reward {reward!r} is not finite")
        if rid not in groups:
            raise ValueError(f"rollout {rid!r} has a reward but no group")
        members.setdefault(groups[rid], []).append(rid)
    return members


def _normalize_group(
    r: FloatArray, *, scale_by_std: bool, eps: float, baseline: Baseline, rtol: float, atol: float
) -> tuple[GroupStats, FloatArray]:
    """One group's statistics and its rollouts' advantages (all 0 when the group carries no signal)."""
    n = len(r)
    scale = _scale(r)
    x = r / scale
    # fsum: the mean is the correctly rounded mean, so deviations of huge rewards keep their exact spacing.
    mean_x = math.fsum(x) / n
    dev = x - mean_x
    std_x = _std(dev)
    reason = None
    if n == 1:
        reason = SINGLETON
    elif float(x.max() - x.min()) <= rtol * float(np.abs(x).max()) + atol / scale:
        reason = ZERO_VARIANCE
    stats = GroupStats(n=n, mean=mean_x * scale, std=std_x * scale, skipped=reason)
    if reason is not None:
        return stats, np.zeros(n)
    if baseline == "leave_one_out":
        dev = dev * (n / (n - 1))  # r_i − b_i = n/(n−1)·(r_i − mean), in units of `scale`
    # (r_i − b_i)/(std + eps) = dev·scale/(std_x·scale + eps) = dev/(std_x + eps/scale): no overflow.
    adv = dev / (std_x + eps / scale) if scale_by_std else dev * scale
    return stats, adv


def batch_advantages(
    rewards: Mapping[str, float], keys: Mapping[str, str], *, scale_by_std: bool = True, eps: float = 1e-6
) -> AdvantageResult:
    """A batch baseline for data without groups (turns of everyday traffic: one sample per prompt).

    Rewards are normalized across the batch, separately per key (the harness: its reward scale and interaction
    pattern differ), as REINFORCE++'s global normalization (Hu et al. 2025, arXiv 2501.03262) and MetaClaw's
    batch groups do: ``A_i = (r_i − mean_k(r)) / (std_k(r) + eps)`` over the items of key k in the batch. That
    is ``group_advantages`` with the key as the group, including its rules: a key with a single item (no
    baseline) or without reward variance carries no signal and is skipped, never trained with advantage 0 —
    which is why the trainer waits for ``min_turns`` ready turns before it steps.
    """
    return group_advantages(rewards, keys, scale_by_std=scale_by_std, eps=eps)


def turn_advantages(
    rewards: Mapping[str, float],
    keys: Mapping[str, str],
    groups: Mapping[str, Mapping[str, float]],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """Advantages of everyday turns: GRPO within a turn's counterfactual group where it has one, else the batch
    baseline.

    ``groups`` maps a served turn's call id to the comparable rewards of its group (its own under its call id, and
    each scored sibling's): those members are normalized against each other only — answers to the same prompt, so the
    prompt's difficulty cancels out. The other turns of ``rewards`` get ``batch_advantages`` by ``keys``. A group is
    skipped as a whole (reported under its served turn) when its rewards are all equal.
    """
    plain = {i: r for i, r in rewards.items() if i not in groups}
    batch = batch_advantages(plain, keys, scale_by_std=scale_by_std, eps=eps)
    members = {m: r for members in groups.values() for m, r in members.items()}
    keyed = {m: f"group:{served}" for served, members in groups.items() for m in members}
    grouped = group_advantages(members, keyed, scale_by_std=scale_by_std, eps=eps)
    skipped = dict(batch.skipped)
    skipped.update({served: grouped.skipped[served] for served in groups if served in grouped.skipped})
    return AdvantageResult(
        advantages={**batch.advantages, **grouped.advantages},
        skipped=skipped,
        groups={**batch.groups, **grouped.groups},
    )


def _scale(r: FloatArray) -> float:
    """The unit to compute a group's moments in: 1, or max|r| when deviations could overflow."""
    peak = float(np.abs(r).max())
    return peak if peak > _SAFE_MAGNITUDE else 1.0


def _std(dev: FloatArray) -> float:
    """Population std of deviations from the mean, squared only after scaling by the largest one."""
    peak = float(np.abs(dev).max())
    if peak == 0.0:
        return 0.0
    return peak * math.sqrt(float(np.mean(np.square(dev / peak))))


def broadcast(advantages: Mapping[str, float], paths_by_rollout: Mapping[str, Iterable[P]]) -> list[BranchAdvantage[P]]:
    """Give every branch (path) of a rollout the rollout's advantage (GRPO over a prefix tree).

    Rollouts without an advantage (skipped groups, missing rewards) contribute no branches; the order follows
    ``paths_by_rollout``.
    """
    out: list[BranchAdvantage[P]] = []
    for rid, paths in paths_by_rollout.items():
        if rid not in advantages:
            continue
        adv = advantages[rid]
        out.extend(BranchAdvantage(rid, path, adv) for path in paths)
    return out


def terminal_rewards(steps: Sequence[bool] | npt.NDArray[np.bool_], reward: float) -> FloatArray:
    """Per-position rewards of one branch: the rollout reward on its last trainable position, 0 elsewhere."""
    mask = np.asarray(steps, dtype=np.bool_)
    if mask.ndim != 1:
        raise ValueError("one branch at a time: steps must be 1-D")
    if not math.isfinite(reward):
        raise ValueError(f"reward {reward!r} is not finite")
    out = np.zeros(len(mask))
    idx = np.flatnonzero(mask)
    if len(idx):
        out[idx[-1]] = reward
    return out


def gae(
    rewards_per_step: Sequence[float] | npt.NDArray[np.floating[Any]],
    values: Sequence[float] | npt.NDArray[np.floating[Any]],
    gamma: float = 1.0,
    lam: float = 1.0,
    steps: Sequence[bool] | npt.NDArray[np.bool_] | None = None,
) -> tuple[FloatArray, FloatArray]:
    """Generalized advantage estimation (Schulman et al. 2016, eqs. 11–16) along one branch of a rollout.

    The steps are the branch's trainable positions (``steps``; all positions when None), in order; context
    positions between them (tool results, user turns) are the environment's transition, not actions, so the
    next state of a turn's last token is the first token of the next turn. With t, t+1 consecutive steps:

        δ_t = r_t + γ·V_{t+1} − V_t          (V after the last step is 0: the episode ends)
        A_t = δ_t + γλ·A_{t+1}               R_t = A_t + V_t   (the λ-return, the value target)

    Returns (advantages, returns) over all positions, 0 on non-steps. One path only: siblings never exchange
    advantage, which a 1-D input makes structural. Rewards on non-steps raise ``ValueError``.
    """
    r = np.asarray(rewards_per_step, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.ndim != 1 or v.shape != r.shape:
        raise ValueError(f"one branch at a time: rewards {r.shape} and values {v.shape} must be equal 1-D shapes")
    mask = np.ones(len(r), dtype=np.bool_) if steps is None else np.asarray(steps, dtype=np.bool_)
    if mask.shape != r.shape:
        raise ValueError(f"steps {mask.shape} must match rewards {r.shape}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError("gamma and lam must be in [0, 1]")
    idx = np.flatnonzero(mask)
    if np.any(r[~mask] != 0):
        raise ValueError("rewards on non-step (context) positions")
    if not (np.all(np.isfinite(r[idx])) and np.all(np.isfinite(v[idx]))):
        raise ValueError("rewards and values must be finite on steps")
    adv = np.zeros(len(r))
    ret = np.zeros(len(r))
    next_value = 0.0
    running = 0.0
    for t in idx[::-1].tolist():
        delta = r[t] + gamma * next_value - v[t]
        running = delta + gamma * lam * running
        adv[t] = running
        ret[t] = running + v[t]
        next_value = v[t]
    return adv, ret
