"""Policy and value losses against hand-computed values and gradients: sign, clip-higher, truncated IS,
token weights of a shared prefix, aggregations, k3 KL, masking of context and padding, 1-D and 2-D layouts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from prefix_tree import CallView, build_tree
from trainer.loss import Aggregation, aggregate, policy_loss, token_entropy, value_loss

D = torch.float64


def t(values: list[float] | list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=D, requires_grad=grad)


def ones_mask(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def test_positive_advantage_raises_the_token_logprob() -> None:
    new = t([math.log(0.5), math.log(0.25)], grad=True)
    same = new.detach().clone()
    loss, metrics = policy_loss(new, same, same, t([2.0, -1.0]), ones_mask(2))
    loss.backward()
    # ratio 1, w 1: loss = −(2 − 1)/2; ∂loss/∂logp_new = −A/2.
    assert loss.item() == pytest.approx(-0.5)
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-1.0, 0.5])
    # A gradient step (logp −= lr·grad) raises the positive-advantage token, lowers the other.
    assert metrics["loss"] == pytest.approx(-0.5) and metrics["tokens"] == 2.0


def test_clipping_stops_the_gradient_only_on_the_side_that_matters() -> None:
    # ε_low = 0.2, ε_high = 0.28: the range is [0.8, 1.28]. w = 1 (old == rollout), token_sum.
    cases = [
        # (A, ratio, expected loss term, expected gradient)
        (1.0, 1.5, -1.28, 0.0),  # A > 0 above 1 + ε_high: clipped, no gradient
        (1.0, 1.25, -1.25, -1.25),  # inside clip-higher (outside a symmetric 0.2 range): still learns
        (1.0, 0.5, -0.5, -0.5),  # A > 0 below 1 − ε_low: the min keeps the unclipped term
        (-1.0, 0.5, 0.8, 0.0),  # A < 0 below 1 − ε_low: clipped, no gradient
        (-1.0, 0.78, 0.8, 0.0),
        (-1.0, 1.5, 1.5, 1.5),  # A < 0 above 1 + ε_high: unclipped, gradient pushes it down
        (-1.0, 1.1, 1.1, 1.1),
    ]
    adv = t([c[0] for c in cases])
    new = t([math.log(c[1]) for c in cases], grad=True)
    zeros = torch.zeros(len(cases), dtype=D)
    loss, metrics = policy_loss(new, zeros, zeros, adv, ones_mask(len(cases)), aggregation="token_sum")
    loss.backward()
    assert loss.item() == pytest.approx(sum(c[2] for c in cases))
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([c[3] for c in cases])
    assert metrics["clip_frac_high"] == pytest.approx(1 / 7)
    assert metrics["clip_frac_low"] == pytest.approx(2 / 7)
    # k3 of KL(old ‖ new) = mean(ratio − 1 − log ratio).
    assert metrics["approx_kl"] == pytest.approx(np.mean([r - 1 - math.log(r) for _, r, _, _ in cases]))


def test_symmetric_clip_when_asked() -> None:
    new = t([math.log(1.25)], grad=True)
    zeros = torch.zeros(1, dtype=D)
    loss, _ = policy_loss(new, zeros, zeros, t([1.0]), ones_mask(1), clip_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert new.grad is not None and new.grad.item() == 0.0


def test_truncated_is_weight_caps_at_c_and_is_detached() -> None:
    new = t([0.0, 0.0, 0.0], grad=True)
    old = t([0.0, 0.0, 0.0], grad=True)
    # exp(old − rollout) = 3 (capped at C = 2), 0.5, 1.
    rollout = t([-math.log(3.0), math.log(2.0), 0.0], grad=True)
    loss, metrics = policy_loss(new, old, rollout, t([1.0, 1.0, 1.0]), ones_mask(3), aggregation="token_sum")
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0))
    assert new.grad is not None and new.grad.tolist() == pytest.approx([-2.0, -0.5, -1.0])
    assert old.grad is None and rollout.grad is None  # the weight is a constant
    assert metrics["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert metrics["is_weight_max"] == pytest.approx(3.0)
    assert metrics["is_truncated_frac"] == pytest.approx(1 / 3)
    loss, _ = policy_loss(new, old, rollout, t([1.0, 1.0, 1.0]), ones_mask(3), aggregation="token_sum", is_cap=5.0)
    assert loss.item() == pytest.approx(-(3.0 + 0.5 + 1.0))
    loss, _ = policy_loss(new, old, rollout, t([1.0, 1.0, 1.0]), ones_mask(3), aggregation="token_sum", is_cap=None)
    assert loss.item() == pytest.approx(-3.0)


def test_is_weight_multiplies_the_clipped_objective() -> None:
    # ratio 1.5 with A > 0 is clipped to 1.28, then weighted by w = 2: −2·1.28.
    new = t([math.log(1.5)], grad=True)
    loss, _ = policy_loss(new, t([0.0]), t([-math.log(2.0)]), t([1.0]), ones_mask(1))
    assert loss.item() == pytest.approx(-2.56)


def shared_prefix_inputs() -> dict[str, torch.Tensor]:
    """Two paths [s, a] and [s, b] of one rollout; s is trainable and shared. Values per packed token s, a, b."""
    return {
        "new": t([math.log(1.1), math.log(0.9), math.log(1.6)]),
        "old": t([0.0, 0.0, 0.0]),
        "rollout": t([0.1, -0.05, -1.0]),  # w = exp(−0.1), exp(0.05), min(e, 2) = 2
        "ref": t([0.3, -0.2, 0.1]),
        "adv": t([1.0, 1.0, 1.0]),  # GRPO: one advantage for every branch of the rollout
        "entropy": t([0.7, 0.2, 1.3]),
    }


@pytest.mark.parametrize("aggregation", ["token_mean", "token_sum"])
def test_shared_token_with_weight_half_on_two_paths_counts_once(aggregation: Aggregation) -> None:
    x = shared_prefix_inputs()

    packed = x["new"].clone().requires_grad_(True)
    loss_p, m_p = policy_loss(
        packed,
        x["old"],
        x["rollout"],
        x["adv"],
        ones_mask(3),
        logp_ref=x["ref"],
        entropy=x["entropy"],
        aggregation=aggregation,
        kl_coef=0.1,
    )
    loss_p.backward()

    rows = torch.tensor([[0, 1], [0, 2]])  # path 1 = s, a; path 2 = s, b
    shared = x["new"].clone().requires_grad_(True)
    weights = t([[0.5, 1.0], [0.5, 1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss_t, m_t = policy_loss(
        shared[rows],
        x["old"][rows],
        x["rollout"][rows],
        x["adv"][rows],
        mask,
        weights=weights,
        logp_ref=x["ref"][rows],
        entropy=x["entropy"][rows],
        aggregation=aggregation,
        kl_coef=0.1,
    )
    loss_t.backward()

    assert loss_t.item() == pytest.approx(loss_p.item(), rel=1e-12)
    assert shared.grad is not None and packed.grad is not None
    assert shared.grad.tolist() == pytest.approx(packed.grad.tolist(), rel=1e-12)
    for key in ("clip_frac_high", "is_weight_mean", "approx_kl", "kl_ref", "entropy", "tokens"):
        assert m_t[key] == pytest.approx(m_p[key], rel=1e-12), key
    assert m_t["tokens"] == 3.0

    # Hand value of the policy part: ratios 1.1, 0.9, 1.6 → 1.28 (clipped), weights exp(−0.1), exp(0.05), 2.
    pg = [-math.exp(-0.1) * 1.1, -math.exp(0.05) * 0.9, -2.0 * 1.28]
    kl = [math.exp(d) - d - 1 for d in (0.3 - math.log(1.1), -0.2 - math.log(0.9), 0.1 - math.log(1.6))]
    total = sum(p + 0.1 * k for p, k in zip(pg, kl, strict=True))
    assert loss_p.item() == pytest.approx(total / 3 if aggregation == "token_mean" else total, rel=1e-12)

    # Without the weights the shared token counts twice and the loss changes.
    loss_u, _ = policy_loss(
        x["new"][rows],
        x["old"][rows],
        x["rollout"][rows],
        x["adv"][rows],
        mask,
        logp_ref=x["ref"][rows],
        aggregation=aggregation,
        kl_coef=0.1,
    )
    assert loss_u.item() != pytest.approx(loss_p.item(), rel=1e-6)


def test_seq_mean_token_mean_token_sum_by_hand() -> None:
    # Row 0: one token, A = 3 (then padding); row 1: three tokens, A = 1. ratio = w = 1, so ℓ_t = −A_t.
    new = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], grad=True)
    nan = math.nan
    old = t([[0.0, nan, nan], [0.0, 0.0, 0.0]])
    adv = t([[3.0, nan, nan], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    expected: dict[Aggregation, tuple[float, list[list[float]]]] = {
        "token_mean": (-(3 + 3) / 4, [[-3 / 4, 0, 0], [-1 / 4] * 3]),
        "seq_mean": (-(3 + 1) / 2, [[-3 / 2, 0, 0], [-1 / 6] * 3]),
        "token_sum": (-6.0, [[-3.0, 0, 0], [-1.0] * 3]),
    }
    for aggregation, (value, grad) in expected.items():
        new.grad = None
        loss, _ = policy_loss(new, old, old, adv, mask, aggregation=aggregation)
        loss.backward()
        assert loss.item() == pytest.approx(value), aggregation
        assert new.grad is not None
        assert new.grad.tolist() == [pytest.approx(row) for row in grad], aggregation

    # The same batch packed 1-D with segment ids gives the same seq_mean.
    flat = t([0.0, 0.0, 0.0, 0.0], grad=True)
    loss, _ = policy_loss(
        flat,
        t([0.0] * 4),
        t([0.0] * 4),
        t([3.0, 1.0, 1.0, 1.0]),
        ones_mask(4),
        aggregation="seq_mean",
        segment_ids=torch.tensor([0, 1, 1, 1]),
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert flat.grad is not None and flat.grad.tolist() == pytest.approx([-3 / 2, -1 / 6, -1 / 6, -1 / 6])
    with pytest.raises(ValueError, match="segment_ids"):
        policy_loss(flat, t([0.0] * 4), t([0.0] * 4), t([1.0] * 4), ones_mask(4), aggregation="seq_mean")


def test_per_row_advantages_broadcast_over_the_sequence() -> None:
    new = torch.zeros(2, 3, dtype=D, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss_row, _ = policy_loss(new, new.detach(), new.detach(), t([2.0, -1.0]), mask)
    full = t([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    loss_full, _ = policy_loss(new, new.detach(), new.detach(), full, mask)
    assert loss_row.item() == pytest.approx(loss_full.item()) == pytest.approx(-(2 + 2 - 3) / 5)


def test_kl_term_vanishes_when_reference_equals_policy() -> None:
    new = t([-0.5, -1.5, -0.2], grad=True)
    old = t([-0.6, -1.4, -0.2])
    adv = t([1.0, -0.5, 2.0])
    base, _ = policy_loss(new, old, old, adv, ones_mask(3))
    (grad_base,) = torch.autograd.grad(base, new)
    loss, metrics = policy_loss(new, old, old, adv, ones_mask(3), kl_coef=0.5, logp_ref=new.detach().clone())
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == pytest.approx(base.item(), abs=1e-15)
    assert grad.tolist() == pytest.approx(grad_base.tolist(), abs=1e-15)
    assert metrics["kl_ref"] == 0.0


def test_kl_term_by_hand() -> None:
    # A = 0, so only β·k3 remains: d = ref − new = ln 2, k3 = 2 − ln 2 − 1; ∂/∂new = β·(1 − e^d) = −β.
    new = t([0.0], grad=True)
    loss, metrics = policy_loss(new, t([0.0]), t([0.0]), t([0.0]), ones_mask(1), kl_coef=0.1, logp_ref=t([math.log(2)]))
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert new.grad is not None and new.grad.item() == pytest.approx(-0.1)  # pulls the policy toward the reference
    assert metrics["kl_ref"] == pytest.approx(1 - math.log(2))
    assert metrics["pg_loss"] == 0.0
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(new, t([0.0]), t([0.0]), t([0.0]), ones_mask(1), kl_coef=0.1)


def test_mask_excludes_tree_context_exactly() -> None:
    # A real path: context positions carry NaN rollout logprobs; they must not touch the loss or the gradient.
    calls = [
        CallView("c1", [1, 2, 3], [4, 5], [-0.5, -1.0], started_at=0.0, status="ok"),
        CallView("c2", [1, 2, 3, 4, 5, 6, 7], [8], [-0.25], started_at=1.0, status="ok"),
    ]
    (path,) = build_tree(calls).paths()
    assert path.trainable.tolist() == [False, False, False, True, True, False, False, True]
    mask = torch.from_numpy(path.trainable)
    rollout = torch.from_numpy(path.logprobs)
    assert bool(rollout[~mask].isnan().all())
    # The model's logprobs on context can be anything, even -inf; advantages there are garbage too.
    new = torch.full((8,), -math.inf, dtype=D)
    new[mask] = rollout[mask]
    new.requires_grad_(True)
    old = rollout.clone()  # NaN on context as well
    adv = torch.full((8,), math.nan, dtype=D)
    adv[mask] = 1.5
    loss, metrics = policy_loss(new, old, rollout, adv, mask, kl_coef=0.1, logp_ref=rollout, entropy=adv)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5)  # ratio 1, w 1, KL 0 on the 3 trained tokens
    assert new.grad is not None
    assert new.grad[~mask].tolist() == [0.0] * 5
    assert new.grad[mask].tolist() == pytest.approx([-0.5] * 3)
    assert metrics["tokens"] == 3.0 and metrics["entropy"] == 1.5 and metrics["is_weight_max"] == 1.0


def test_2d_padding_matches_1d_packing() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7]
    mask = torch.zeros(3, 7, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    new = (torch.randn(3, 7, generator=gen, dtype=D) * 0.3 - 1.0).requires_grad_(True)
    old = new.detach() + torch.randn(3, 7, generator=gen, dtype=D) * 0.3
    rollout = old + torch.randn(3, 7, generator=gen, dtype=D) * 0.5
    adv = torch.randn(3, 7, generator=gen, dtype=D)
    weights = torch.rand(3, 7, generator=gen, dtype=D) + 0.1
    ref = old - 0.2
    aggregations: tuple[Aggregation, ...] = ("token_mean", "token_sum", "seq_mean")
    for aggregation in aggregations:
        new.grad = None
        loss2, m2 = policy_loss(
            new, old, rollout, adv, mask, weights=weights, logp_ref=ref, aggregation=aggregation, kl_coef=0.05
        )
        loss2.backward()
        assert new.grad is not None
        grad2 = new.grad.clone()
        flat = new.detach()[mask].clone().requires_grad_(True)
        seg = torch.arange(3).unsqueeze(1).expand(3, 7)[mask]
        loss1, m1 = policy_loss(
            flat,
            old[mask],
            rollout[mask],
            adv[mask],
            ones_mask(int(mask.sum())),
            weights=weights[mask],
            logp_ref=ref[mask],
            aggregation=aggregation,
            segment_ids=seg,
            kl_coef=0.05,
        )
        loss1.backward()
        assert loss1.item() == pytest.approx(loss2.item(), rel=1e-12), aggregation
        assert flat.grad is not None
        assert flat.grad.tolist() == pytest.approx(grad2[mask].tolist(), rel=1e-12), aggregation
        assert grad2[~mask].abs().sum().item() == 0.0
        assert m1 == pytest.approx(m2, rel=1e-12)


def test_empty_mask_gives_zero_loss_and_zero_gradient() -> None:
    new = t([0.3, 0.1], grad=True)
    nan = t([math.nan, math.nan])
    aggregations: tuple[Aggregation, ...] = ("token_mean", "token_sum", "seq_mean")
    for aggregation in aggregations:
        seg = torch.tensor([0, 1])
        loss, metrics = policy_loss(
            new, nan, nan, nan, torch.zeros(2, dtype=torch.bool), aggregation=aggregation, segment_ids=seg
        )
        (grad,) = torch.autograd.grad(loss, new)
        assert loss.item() == 0.0 and grad.tolist() == [0.0, 0.0]
        assert metrics["tokens"] == 0.0


def test_rejects_non_finite_trained_inputs_and_bad_shapes() -> None:
    new = t([0.0, 0.0], grad=True)
    ok = t([0.0, 0.0])
    with pytest.raises(ValueError, match="logp_rollout"):
        policy_loss(new, ok, t([0.0, math.nan]), ok, ones_mask(2))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(new, ok, ok, t([math.inf, 0.0]), ones_mask(2))
    with pytest.raises(ValueError, match="weights"):
        policy_loss(new, ok, ok, ok, ones_mask(2), weights=t([1.0, -1.0]))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(new, ok, ok, ok, ones_mask(3))
    with pytest.raises(ValueError, match="1-D packed"):
        policy_loss(torch.zeros(1, 1, 2), ok, ok, ok, ones_mask(2))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(ok, ok, "mean")  # type: ignore[arg-type]


def test_token_entropy() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf], [50.0, 0.0, 0.0, 0.0]])
    logits.requires_grad_(True)
    h = token_entropy(logits)
    assert h.tolist() == pytest.approx([math.log(4), math.log(2), 0.0], abs=1e-6)
    h.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    # p = (0.5, 0.25, 0.25): H = 1.5·ln 2.
    p = torch.tensor([0.5, 0.25, 0.25])
    assert token_entropy(p.log()).item() == pytest.approx(1.5 * math.log(2))
    assert token_entropy(torch.zeros(2, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_value_loss_by_hand() -> None:
    # Token 0: V = 1.5, V_old = 1.0, R = 2.0: unclipped (−0.5)² = 0.25, clipped V = 1.2 → 0.64 wins, no gradient.
    # Token 1: V = 2.1, V_old = 2.0, R = 3.0: inside the clip range, both 0.81; gradient V − R = −0.9.
    # Token 2: padding.
    values = t([1.5, 2.1, 7.0], grad=True)
    returns = t([2.0, 3.0, math.nan])
    old = t([1.0, 2.0, math.nan])
    mask = torch.tensor([True, True, False])
    loss, metrics = value_loss(values, returns, mask, old_values=old, clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((0.5 * 0.64 + 0.5 * 0.81) / 2)
    assert values.grad is not None and values.grad.tolist() == pytest.approx([0.0, -0.45, 0.0])
    assert metrics["value_clip_frac"] == pytest.approx(0.5)
    assert metrics["value_mean"] == pytest.approx(1.8) and metrics["return_mean"] == pytest.approx(2.5)
    loss, _ = value_loss(values, returns, mask)
    assert loss.item() == pytest.approx((0.5 * 0.25 + 0.5 * 0.81) / 2)
