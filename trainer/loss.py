"""Policy and value losses of the LoRA update: PPO-clip with clip-higher, truncated IS rollout correction, k3 KL.

Three log-probabilities meet at every trained token t: ``logp_rollout`` (what the engine reported when it
sampled the token), ``logp_old`` (the trainer's recomputation under the policy before this update) and
``logp_new`` (the trainer's current forward pass, the only one with a gradient). Per token:

    ratio_t = exp(logp_new − logp_old)
    PPO-clip (Schulman et al. 2017, eq. 7), asymmetric range (DAPO clip-higher, Yu et al. 2025, eq. 10):
        J_t = min(ratio_t·A_t, clip(ratio_t, 1 − ε_low, 1 + ε_high)·A_t)
    truncated importance sampling (TIS; Yao et al. 2025 "off-policy RL training"; IMPALA, Espeholt et al. 2018):
        w_t = min(exp(logp_old − logp_rollout), C)     constant: no gradient flows through it
    k3 KL to the reference policy (Schulman 2020 "Approximating KL divergence"; GRPO, Shao et al. 2024, eq. 4):
        k3_t = exp(logp_ref − logp_new) − (logp_ref − logp_new) − 1 ≥ 0
    ℓ_t = −w_t·J_t + β·k3_t

``w`` corrects the mismatch between engine and trainer (kernels, dtypes, stale versions) the gateway cannot
avoid; the KL term is not weighted by it, as in GRPO. The reference model is the base model with the adapter
disabled; the loss only sees its logprobs.

Aggregation of ℓ over tokens, with u_t the token weights (``weights``; 1 by default) restricted to the mask:

    token_mean: Σ_t u_t·ℓ_t / Σ_t u_t          (DAPO's token-level loss)
    token_sum:  Σ_t u_t·ℓ_t                    (Dr. GRPO: divide by a constant outside, not by lengths)
    seq_mean:   mean over sequences s of Σ_{t∈s} u_t·ℓ_t / Σ_{t∈s} u_t   (GRPO's 1/G Σ_i 1/|o_i| Σ_t)

A prefix tree packed as one path per row gives a token shared by k paths the weight 1/k in each row, so under
token_mean and token_sum it counts exactly once, as it does in a tree-packed sequence with weight 1. Under
seq_mean each path stays one sample and weights act within it. Masked positions (padding, harness-inserted
context, whose rollout logprob is NaN) take no part in the loss, the metrics or the gradient.

Shapes: 1-D over packed tokens, or 2-D [batch, seq]; every input has the shape of ``logp_new`` (2-D
advantages may also be [batch], one per row). Pure torch: no model, no optimizer.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = ["Aggregation", "aggregate", "policy_loss", "token_entropy", "value_loss"]

Aggregation = Literal["token_mean", "seq_mean", "token_sum"]


def policy_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_cap: float | None = 2.0,
    aggregation: Aggregation = "token_mean",
    weights: Tensor | None = None,
    kl_coef: float = 0.0,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The PPO-clip / TIS / k3 loss of the module docstring, aggregated, and its metrics.

    ``is_cap`` is C (None: no rollout correction, w = 1). ``entropy`` (per token, see ``token_entropy``) is
    only reported. ``segment_ids`` name each packed token's sequence for ``seq_mean`` on 1-D input (2-D input
    uses rows). Non-finite ``logp_old``, ``logp_rollout``, ``advantages`` or ``weights`` on a trained position
    raise ``ValueError``.

    Metrics (token-weighted means over trained positions): ``loss``, ``pg_loss``, ``clip_frac_low``
    (A < 0 and ratio < 1 − ε_low: gradient stopped), ``clip_frac_high`` (A > 0 and ratio > 1 + ε_high),
    ``is_weight_mean`` (after truncation), ``is_weight_max`` (before), ``is_truncated_frac``, ``approx_kl``
    (k3 estimate of KL(old ‖ new)), ``kl_ref`` when ``logp_ref`` is given, ``entropy`` when given, ``tokens``
    (the sum of token weights).
    """
    _check_policy_options(clip_low, clip_high, is_cap, kl_coef, logp_ref)
    m, u = _mask_and_weights(logp_new, mask, weights)
    terms = _policy_terms(
        logp_new, logp_old, logp_rollout, advantages, logp_ref, m, u.dtype, clip_low, clip_high, is_cap
    )
    per_token = terms.pg
    if terms.kl is not None and kl_coef > 0:
        per_token = terms.pg + kl_coef * terms.kl
    loss = aggregate(per_token, u, aggregation, segment_ids)

    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "pg_loss": float(aggregate(terms.pg, u, aggregation, segment_ids)),
            **_policy_metrics(terms, m, u, clip_low, clip_high, is_cap, entropy),
        }
    return loss, metrics


class _PolicyTerms(NamedTuple):
    """Per-token quantities of the policy loss, zero at masked positions."""

    adv: Tensor
    log_ratio: Tensor  # logp_new − logp_old
    ratio: Tensor
    w_raw: Tensor  # exp(logp_old − logp_rollout), before truncation
    w: Tensor  # the truncated IS weight
    pg: Tensor  # −w·J
    kl: Tensor | None  # k3 to the reference policy, when logp_ref is given


def _check_policy_options(
    clip_low: float, clip_high: float, is_cap: float | None, kl_coef: float, logp_ref: Tensor | None
) -> None:
    """Reject clip ranges, IS caps and KL coefficients outside their domains."""
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if is_cap is not None and not is_cap > 0:
        raise ValueError(f"is_cap must be > 0 or None, got {is_cap}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref")


def _policy_terms(
    logp_new: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    logp_ref: Tensor | None,
    m: Tensor,
    dtype: torch.dtype,
    clip_low: float,
    clip_high: float,
    is_cap: float | None,
) -> _PolicyTerms:
    """The clipped surrogate, truncated IS weights and k3 KL of every token (gradient only through logp_new)."""
    old = _trained(logp_old, m, dtype, "logp_old")
    roll = _trained(logp_rollout, m, dtype, "logp_rollout")
    adv = _trained(_expand(advantages, logp_new), m, dtype, "advantages")
    # Zeros instead of whatever sits at masked positions, so NaN/inf there cannot leak into the backward pass.
    new = torch.where(m, logp_new.to(dtype), torch.zeros((), dtype=dtype, device=logp_new.device))

    log_ratio = new - old
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    w_raw = torch.exp(old - roll)
    w = torch.ones_like(w_raw) if is_cap is None else torch.clamp(w_raw, max=is_cap)
    kl: Tensor | None = None
    if logp_ref is not None:
        d = _trained(logp_ref, m, dtype, "logp_ref") - new
        kl = torch.exp(d) - d - 1.0
    return _PolicyTerms(adv, log_ratio, ratio, w_raw, w, -w * surrogate, kl)


def _policy_metrics(
    t: _PolicyTerms,
    m: Tensor,
    u: Tensor,
    clip_low: float,
    clip_high: float,
    is_cap: float | None,
    entropy: Tensor | None,
) -> dict[str, float]:
    """``policy_loss``'s metrics after ``loss`` and ``pg_loss``, in their documented order."""
    metrics = {
        "clip_frac_low": _wmean((t.adv < 0) & (t.ratio < 1.0 - clip_low), u),
        "clip_frac_high": _wmean((t.adv > 0) & (t.ratio > 1.0 + clip_high), u),
        "is_weight_mean": _wmean(t.w, u),
        "is_weight_max": float(t.w_raw[m].max()) if bool(m.any()) else 0.0,
        "is_truncated_frac": _wmean(t.w_raw > is_cap, u) if is_cap is not None else 0.0,
        "approx_kl": _wmean(t.ratio - 1.0 - t.log_ratio, u),
        "tokens": float(u.sum()),
    }
    if t.kl is not None:
        metrics["kl_ref"] = _wmean(t.kl, u)
    if entropy is not None:
        metrics["entropy"] = _wmean(_trained(entropy, m, u.dtype, "entropy"), u)
    return metrics


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    old_values: Tensor | None = None,
    clip: float | None = 0.2,
    *,
    weights: Tensor | None = None,
    aggregation: Aggregation = "token_mean",
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss with value clipping (Schulman et al. 2017 / OpenAI baselines ppo2), aggregated like above.

        V_clip = V_old + clip(V − V_old, −c, c)
        ℓ_t = ½·max((V − R)², (V_clip − R)²)          (½·(V − R)² without ``old_values`` or with c = None)

    Metrics: ``value_loss``, ``value_clip_frac`` (tokens where the clipped error is the larger one),
    ``value_mean``, ``return_mean``.
    """
    m, u = _mask_and_weights(values, mask, weights)
    dtype = u.dtype
    ret = _trained(returns, m, dtype, "returns")
    v = torch.where(m, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    err = torch.square(v - ret)
    clipped = torch.zeros_like(m)
    if old_values is not None and clip is not None:
        old = _trained(old_values, m, dtype, "old_values")
        err_clip = torch.square(old + torch.clamp(v - old, -clip, clip) - ret)
        clipped = err_clip > err
        err = torch.maximum(err, err_clip)
    loss = aggregate(0.5 * err, u, aggregation, segment_ids)
    with torch.no_grad():
        metrics = {
            "value_loss": float(loss),
            "value_clip_frac": _wmean(clipped, u),
            "value_mean": _wmean(v, u),
            "return_mean": _wmean(ret, u),
        }
    return loss, metrics


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v of each position's next-token distribution (over the last dim), in float32.

    Logits of −inf (masked vocabulary) contribute 0 rather than NaN. Memory is that of the logits once more:
    chunk long sequences.
    """
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(logp.exp() * torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))).sum(-1)


def aggregate(
    per_token: Tensor, weights: Tensor, aggregation: Aggregation = "token_mean", segment_ids: Tensor | None = None
) -> Tensor:
    """Reduce per-token values with token weights (0 outside the mask) as ``token_mean``, ``token_sum`` or
    ``seq_mean`` (rows of 2-D input, or ``segment_ids`` of 1-D input; sequences with no weight are left out).

    An empty selection gives 0, still connected to the graph.
    """
    weighted = per_token * weights
    if aggregation == "token_sum":
        return weighted.sum()
    if aggregation == "token_mean":
        total = weights.sum()
        return weighted.sum() / torch.where(total > 0, total, torch.ones_like(total))
    if aggregation != "seq_mean":
        raise ValueError(f"aggregation must be 'token_mean', 'seq_mean' or 'token_sum', not {aggregation!r}")
    if per_token.dim() == 2:
        num, den = weighted.sum(-1), weights.sum(-1)
    else:
        if segment_ids is None:
            raise ValueError("seq_mean over 1-D packed tokens needs segment_ids")
        if segment_ids.shape != per_token.shape:
            raise ValueError(f"segment_ids {tuple(segment_ids.shape)} must match {tuple(per_token.shape)}")
        seg = segment_ids.to(device=per_token.device, dtype=torch.long)
        size = int(seg.max()) + 1 if seg.numel() else 0
        num = torch.zeros(size, dtype=weighted.dtype, device=weighted.device).index_add(0, seg, weighted)
        den = torch.zeros(size, dtype=weights.dtype, device=weights.device).index_add(0, seg, weights)
    present = den > 0
    per_seq = num / torch.where(present, den, torch.ones_like(den))
    count = present.sum()
    return per_seq.sum() / torch.where(count > 0, count, torch.ones_like(count)).to(per_seq.dtype)


def _mask_and_weights(ref: Tensor, mask: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """Boolean mask and token weights (0 outside it) in the loss dtype: at least float32."""
    if ref.dim() not in (1, 2):
        raise ValueError(f"expected 1-D packed tokens or 2-D [batch, seq], got shape {tuple(ref.shape)}")
    if mask.shape != ref.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match {tuple(ref.shape)}")
    m = (mask if mask.dtype == torch.bool else mask != 0).to(ref.device)
    dtype = torch.promote_types(ref.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=ref.device)
    if weights is None:
        return m, m.to(dtype)
    if weights.shape != ref.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must match {tuple(ref.shape)}")
    u = weights.detach().to(device=ref.device, dtype=dtype)
    if not bool((torch.isfinite(u[m]) & (u[m] >= 0)).all()):
        raise ValueError("weights must be finite and >= 0 on trained positions")
    return m, torch.where(m, u, zero)


def _trained(x: Tensor, m: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """A detached input with zeros outside the mask, checked finite inside it."""
    if x.shape != m.shape:
        raise ValueError(f"{name} {tuple(x.shape)} must match {tuple(m.shape)}")
    x = x.detach().to(device=m.device, dtype=dtype)
    if not bool(torch.isfinite(x[m]).all()):
        raise ValueError(f"{name} is not finite on a trained position")
    return torch.where(m, x, torch.zeros((), dtype=dtype, device=m.device))


def _expand(advantages: Tensor, ref: Tensor) -> Tensor:
    """Per-row advantages [batch] of 2-D input, repeated along the sequence."""
    if ref.dim() == 2 and advantages.dim() == 1 and advantages.shape[0] == ref.shape[0]:
        return advantages.unsqueeze(-1).expand_as(ref)
    return advantages


def _wmean(x: Tensor, u: Tensor) -> float:
    total = float(u.sum())
    return float((x.to(u.dtype) * u).sum()) / total if total > 0 else 0.0
