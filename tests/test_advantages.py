"""Advantage math against hand-computed values: GRPO / Dr. GRPO / leave-one-out, groups without signal,
near-equal and huge rewards, mixed harnesses, broadcasting over a rollout's branches, and GAE along one branch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.store.rollout_lifecycle import default_group
from prefix_tree import CallView, TreeConfig, build_tree
from trainer.advantages import (
    SINGLETON,
    ZERO_VARIANCE,
    BranchAdvantage,
    GroupStats,
    broadcast,
    gae,
    group_advantages,
    terminal_rewards,
)


def one_group(rewards: list[float], **kwargs: object) -> list[float]:
    ids = [f"r{i}" for i in range(len(rewards))]
    res = group_advantages(dict(zip(ids, rewards, strict=True)), dict.fromkeys(ids, "g"), **kwargs)  # type: ignore[arg-type]
    assert not res.skipped
    return [res.advantages[i] for i in ids]


# --------------------------------------------------------------------------------------------- baselines


def test_mean_baseline_with_std_by_hand() -> None:
    # r = [1, 2, 6]: mean 3, deviations [-2, -1, 3], population variance 14/3.
    std = math.sqrt(14 / 3)
    assert one_group([1, 2, 6], eps=0.0) == pytest.approx([-2 / std, -1 / std, 3 / std], rel=1e-12)
    # eps sits in the denominator next to the std (GRPO's (r − mean)/(std + eps)).
    assert one_group([1, 2, 6], eps=0.5) == pytest.approx([-2 / (std + 0.5), -1 / (std + 0.5), 3 / (std + 0.5)])
    # Two rewards 0 and 1 with the default eps: ±0.5/(0.5 + 1e-6).
    assert one_group([0.0, 1.0]) == pytest.approx([-0.5 / 0.500001, 0.5 / 0.500001], rel=1e-12)


def test_std_scaling_off_is_dr_grpo() -> None:
    assert one_group([1, 2, 6], scale_by_std=False) == pytest.approx([-2.0, -1.0, 3.0], rel=1e-12)
    # With std scaling two groups of different reward scale get the same advantages; without it (Dr. GRPO)
    # the advantage keeps the reward scale.
    rewards = {"a0": 0.0, "a1": 1.0, "b0": 0.0, "b1": 10.0}
    groups = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    scaled = group_advantages(rewards, groups, eps=0.0).advantages
    assert scaled == pytest.approx({"a0": -1.0, "a1": 1.0, "b0": -1.0, "b1": 1.0})
    raw = group_advantages(rewards, groups, scale_by_std=False).advantages
    assert raw == pytest.approx({"a0": -0.5, "a1": 0.5, "b0": -5.0, "b1": 5.0})


def test_leave_one_out_by_hand() -> None:
    # b_1 = (2 + 6)/2 = 4, b_2 = (1 + 6)/2 = 3.5, b_3 = (1 + 2)/2 = 1.5.
    assert one_group([1, 2, 6], baseline="leave_one_out", scale_by_std=False) == pytest.approx(
        [1 - 4, 2 - 3.5, 6 - 1.5], rel=1e-12
    )
    std = math.sqrt(14 / 3)
    assert one_group([1, 2, 6], baseline="leave_one_out", eps=0.0) == pytest.approx(
        [-3 / std, -1.5 / std, 4.5 / std], rel=1e-12
    )
    # Two rollouts: each one's baseline is the other's reward.
    assert one_group([0.25, 1.0], baseline="leave_one_out", scale_by_std=False) == pytest.approx([-0.75, 0.75])


def test_group_stats() -> None:
    res = group_advantages({"a": 1.0, "b": 2.0, "c": 6.0, "d": 4.0}, {"a": "g", "b": "g", "c": "g", "d": "h"})
    g = res.groups["g"]
    assert (g.n, g.mean, g.skipped) == (3, 3.0, None) and g.std == pytest.approx(math.sqrt(14 / 3))
    assert res.groups["h"] == GroupStats(n=1, mean=4.0, std=0.0, skipped=SINGLETON)


# ------------------------------------------------------------------------------------ groups without signal


def test_zero_variance_group_is_skipped_or_zeroed() -> None:
    rewards = {"a": 0.7, "b": 0.7, "c": 0.7, "x": 0.0, "y": 1.0}
    groups = {"a": "g", "b": "g", "c": "g", "x": "h", "y": "h"}
    res = group_advantages(rewards, groups)
    assert res.skipped == {"a": ZERO_VARIANCE, "b": ZERO_VARIANCE, "c": ZERO_VARIANCE}
    assert set(res.advantages) == {"x", "y"}
    g = res.groups["g"]
    assert (g.n, g.skipped) == (3, ZERO_VARIANCE) and g.mean == pytest.approx(0.7) and g.std < 1e-15
    zeroed = group_advantages(rewards, groups, zero_variance="zero")
    assert zeroed.skipped == {}
    assert zeroed.advantages["a"] == zeroed.advantages["b"] == zeroed.advantages["c"] == 0.0
    assert zeroed.advantages["y"] == pytest.approx(res.advantages["y"])


def test_single_member_groups_are_skipped_or_zeroed() -> None:
    rewards = {"lonely": 1.0, "p": 0.0, "q": 1.0}
    groups = {"lonely": "g1", "p": "g2", "q": "g2"}
    assert group_advantages(rewards, groups).skipped == {"lonely": SINGLETON}
    assert group_advantages(rewards, groups, baseline="leave_one_out").skipped == {"lonely": SINGLETON}
    assert group_advantages(rewards, groups, zero_variance="zero").advantages["lonely"] == 0.0


@pytest.mark.parametrize(
    "rewards",
    [
        [0.5, 0.5 + 1e-13, 0.5 - 1e-13],
        [1.0, 1.0 + 1e-13],
        [0.3, 0.1 + 0.2, 0.6 - 0.3],  # float noise of a computed reward
        [0.0, 0.1 + 0.2 - 0.3],  # noise around zero: the absolute tolerance
        [1e12, 1e12 + 1e-3],  # equal at the precision of the magnitude: the relative tolerance
        [1e3, 1e3 + 1e-11, 1e3 - 1e-11],
        [-7.0, -7.0 * (1 + 1e-14)],
    ],
)
def test_near_equal_rewards_count_as_zero_variance(rewards: list[float]) -> None:
    ids = [str(i) for i in range(len(rewards))]
    res = group_advantages(dict(zip(ids, rewards, strict=True)), dict.fromkeys(ids, "g"))
    assert res.advantages == {}
    assert res.skipped == dict.fromkeys(ids, ZERO_VARIANCE)


def test_small_but_real_differences_are_kept() -> None:
    # 1e-6 apart is signal: deviations ±5e-7, std 5e-7, eps 1e-6 ⇒ ±5e-7/1.5e-6 = ±1/3.
    assert one_group([0.5, 0.5 + 1e-6]) == pytest.approx([-1 / 3, 1 / 3], rel=1e-6)
    # Relative to the magnitude, 1 in 1e12 is still far above float noise (~1e-4 there).
    assert one_group([1e12, 1e12 + 1], eps=0.0) == [-1.0, 1.0]
    # Below the absolute tolerance only when asked for.
    assert one_group([0.0, 1e-13], atol=0.0, eps=0.0) == [-1.0, 1.0]


# ----------------------------------------------------------------------------------------- huge rewards


@pytest.mark.filterwarnings("error")  # an overflow RuntimeWarning fails the test
def test_huge_rewards_keep_ordering_and_exact_spacing() -> None:
    r = [1e12, 1e12 + 1, 1e12 + 2, 1e12 + 3]
    # mean 1e12 + 1.5, deviations [-1.5, -0.5, 0.5, 1.5], population std sqrt(1.25).
    adv = one_group(r, eps=0.0)
    assert adv == pytest.approx([d / math.sqrt(1.25) for d in (-1.5, -0.5, 0.5, 1.5)], rel=1e-12)
    assert adv == sorted(adv) and len(set(adv)) == 4
    assert one_group(r, scale_by_std=False) == [-1.5, -0.5, 0.5, 1.5]
    assert one_group([1e12, 0.0, -1e12], scale_by_std=False) == [1e12, 0.0, -1e12]
    res = group_advantages({"a": 1e12, "b": 1e12 + 1}, {"a": "g", "b": "g"})
    assert res.groups["g"].mean == 1e12 + 0.5 and res.groups["g"].std == 0.5


def test_mean_of_mixed_magnitudes_is_exact() -> None:
    # Σ = 4 exactly; a running float sum loses the 1.0 against 1e16 and gives mean 0.75.
    adv = one_group([1e16, 1.0, -1e16, 3.0], scale_by_std=False)
    assert adv[1:2] + adv[3:] == [0.0, 2.0]


@pytest.mark.filterwarnings("error")
def test_rewards_near_float_max_do_not_overflow() -> None:
    # Deviations ∝ [1, 1, -2] (population std √2 in those units): advantages [1/√2, 1/√2, -√2].
    top = 1.5e308
    adv = one_group([top, top, top - 3e307], eps=0.0)
    assert adv == pytest.approx([1 / math.sqrt(2), 1 / math.sqrt(2), -math.sqrt(2)], rel=1e-9)
    adv = one_group([1e300, -1e300, 0.0], eps=0.0)
    assert adv == pytest.approx([math.sqrt(1.5), -math.sqrt(1.5), 0.0], rel=1e-12)
    assert all(math.isfinite(a) for a in one_group([1e300, -1e300, 0.0], baseline="leave_one_out"))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="not finite"):
        group_advantages({"a": 1.0, "b": bad}, {"a": "g", "b": "g"})


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="no group"):
        group_advantages({"a": 1.0}, {})
    with pytest.raises(ValueError, match="baseline"):
        group_advantages({"a": 1.0}, {"a": "g"}, baseline="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zero_variance"):
        group_advantages({"a": 1.0}, {"a": "g"}, zero_variance="drop")  # type: ignore[arg-type]
    assert group_advantages({}, {}).advantages == {}


# ------------------------------------------------------------------------------------------ mixed harness


def test_two_harnesses_on_one_task_never_share_a_baseline() -> None:
    rollouts = {
        "cc1": ("task-7", "claude-code", 1.0),
        "cc2": ("task-7", "claude-code", 0.0),
        "oc1": ("task-7", "openclaw", 10.0),
        "oc2": ("task-7", "openclaw", 8.0),
    }
    rewards = {rid: r for rid, (_, _, r) in rollouts.items()}
    groups = {rid: default_group(task, harness) for rid, (task, harness, _) in rollouts.items()}
    assert groups["cc1"] != groups["oc1"]
    res = group_advantages(rewards, groups, eps=0.0)  # type: ignore[arg-type]
    # Per harness: ±1. Pooled (mean 4.75) every Claude Code rollout would look bad and every OpenClaw one good.
    assert res.advantages == pytest.approx({"cc1": 1.0, "cc2": -1.0, "oc1": 1.0, "oc2": -1.0})
    assert {k: (s.n, s.mean) for k, s in res.groups.items()} == {
        default_group("task-7", "claude-code"): (2, 0.5),
        default_group("task-7", "openclaw"): (2, 9.0),
    }


# ---------------------------------------------------------------------------------------------- broadcast


def test_broadcast_gives_every_branch_the_rollout_advantage() -> None:
    out = broadcast({"a": 1.5, "b": -0.5}, {"a": ["a/p0", "a/p1", "a/p2"], "b": ["b/p0"], "skipped": ["s/p0"]})
    assert out == [
        BranchAdvantage("a", "a/p0", 1.5),
        BranchAdvantage("a", "a/p1", 1.5),
        BranchAdvantage("a", "a/p2", 1.5),
        BranchAdvantage("b", "b/p0", -0.5),
    ]


def test_broadcast_over_a_real_tree() -> None:
    # Two retries of one prompt, both kept: one rollout, two branches sharing the prompt.
    calls = [
        CallView("c1", [1, 2, 3], [4, 5], [-0.1, -0.2], started_at=0.0, status="ok"),
        CallView("c2", [1, 2, 3], [6, 7], [-0.3, -0.4], started_at=1.0, status="ok"),
    ]
    paths = build_tree(calls, TreeConfig(drop_dead_leaves=False)).paths()
    assert len(paths) == 2
    res = group_advantages({"r": 1.0, "s": 0.0}, {"r": "g", "s": "g"}, eps=0.0)
    out = broadcast(res.advantages, {"r": paths, "s": []})
    assert [(b.rollout_id, b.advantage) for b in out] == [("r", 1.0), ("r", 1.0)]
    assert {tuple(b.path.tokens.tolist()) for b in out} == {(1, 2, 3, 4, 5), (1, 2, 3, 6, 7)}


# ---------------------------------------------------------------------------------------------------- GAE


def test_terminal_rewards_sit_on_the_last_trainable_position() -> None:
    steps = np.array([False, True, True, False, True, False])
    assert terminal_rewards(steps, 2.0).tolist() == [0, 0, 0, 0, 2.0, 0]
    assert terminal_rewards(np.zeros(3, dtype=bool), 1.0).tolist() == [0, 0, 0]


def test_gae_by_hand_skips_context_positions() -> None:
    # Positions: context, a0, a1, context (tool result), a2. γ = 0.9, λ = 0.8, reward 1 at a2.
    steps = np.array([False, True, True, False, True])
    values = np.array([9.0, 0.5, 0.6, 9.0, 0.8])  # values on context positions must not matter
    adv, ret = gae(terminal_rewards(steps, 1.0), values, gamma=0.9, lam=0.8, steps=steps)
    # a2: δ = 1 − 0.8 = 0.2;             A = 0.2
    # a1: δ = 0.9·0.8 − 0.6 = 0.12;      A = 0.12 + 0.72·0.2 = 0.264
    # a0: δ = 0.9·0.6 − 0.5 = 0.04;      A = 0.04 + 0.72·0.264 = 0.23008
    assert adv == pytest.approx([0.0, 0.23008, 0.264, 0.0, 0.2], abs=1e-12)
    assert ret == pytest.approx([0.0, 0.73008, 0.864, 0.0, 1.0], abs=1e-12)


def test_gae_limits() -> None:
    steps = np.array([True, True, True])
    values = np.array([0.2, 0.4, 0.7])
    r = terminal_rewards(steps, 1.0)
    # γ = λ = 1: A_t = R − V_t (Monte Carlo); returns are the reward everywhere.
    adv, ret = gae(r, values)
    assert adv == pytest.approx([0.8, 0.6, 0.3]) and ret == pytest.approx([1.0, 1.0, 1.0])
    # λ = 0: one-step TD errors δ_t = r_t + γV_{t+1} − V_t.
    adv, _ = gae(r, values, gamma=0.5, lam=0.0)
    assert adv == pytest.approx([0.5 * 0.4 - 0.2, 0.5 * 0.7 - 0.4, 1.0 - 0.7])


def test_gae_sibling_branches_are_independent() -> None:
    # Two branches share their first two positions; each branch's advantages come from its own reward and
    # values only, so the shared positions get different advantages on each branch.
    values_a = np.array([0.5, 0.5, 0.5])
    values_b = np.array([0.5, 0.5, 0.1, 0.2])
    adv_a, _ = gae(terminal_rewards(np.ones(3, dtype=bool), 1.0), values_a)
    adv_b, _ = gae(terminal_rewards(np.ones(4, dtype=bool), 0.0), values_b)
    assert adv_a.tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert adv_b.tolist() == pytest.approx([-0.5, -0.5, -0.1, -0.2])


def test_gae_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="context"):
        gae([1.0, 0.0], [0.0, 0.0], steps=[False, True])
    with pytest.raises(ValueError, match="one branch"):
        gae(np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        gae([0.0, 1.0], [math.nan, 0.0])
