"""The canary's test: is the candidate worse than the incumbent?

Each arm's evidence is a list of values: the rewards of its turns (higher is better) and, separately, one 0/1 per
call for "failed" (lower is better). The quantity tested is the difference of means
d = mean(candidate) − mean(incumbent).

A canary is looked at again and again while it runs, so a fixed-n confidence interval would be wrong: with enough
looks it crosses any bound by chance. We use an *asymptotic confidence sequence* instead (Waudby-Smith, Arbour,
Sinha, Kennedy & Ramdas, "Time-uniform central limit theory and asymptotic confidence sequences", 2021, eq. 2):
with probability about 1 − α the bound holds at every look at once. For a mean of t observations with variance σ²,

    half-width(t) = σ · sqrt( 2 (t ρ² + 1) / (t² ρ²) · log( sqrt(t ρ² + 1) / α ) ),
    ρ² = ( −2 log α + log(−2 log α + 1) ) / t*          (tightest near t = t*, the minimum sample)

For two arms, σ²/t becomes the variance of the difference, V = s_c²/n_c + s_i²/n_i, and t the smaller arm's count
(the canary's small arm is what limits the evidence):  half-width = sqrt(V · t) · sqrt(2 (tρ²+1)/(t²ρ²) · log(...)).

Decision (margin m ≥ 0, on the reward's own scale), checked in this order:
- fewer than ``min_n`` samples in either arm: wait;
- reject when the candidate is worse with confidence: upper bound of d < 0 (rewards) or lower bound of the
  failure-rate difference > 0 (errors);
- promote when it is not worse by more than m: lower bound of d > −m (and the error check did not reject);
- otherwise wait, until the time limit gives the default outcome.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Outcome = Literal["promote", "reject", "wait"]


@dataclass(frozen=True, slots=True)
class ArmStats:
    """Count, mean and unbiased sample variance of one arm's values."""

    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    @classmethod
    def of(cls, values: Iterable[float]) -> ArmStats:
        xs = [float(v) for v in values if math.isfinite(v)]
        n = len(xs)
        if n == 0:
            return cls()
        mean = math.fsum(xs) / n
        var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
        return cls(n, mean, var)


@dataclass(frozen=True, slots=True)
class Bound:
    """d = candidate − incumbent and its confidence sequence at this look."""

    diff: float
    half_width: float

    @property
    def lower(self) -> float:
        return self.diff - self.half_width

    @property
    def upper(self) -> float:
        return self.diff + self.half_width


def rho_squared(alpha: float, t_star: float) -> float:
    return (-2.0 * math.log(alpha) + math.log(-2.0 * math.log(alpha) + 1.0)) / max(t_star, 1.0)


def half_width(var_diff: float, t: int, alpha: float, t_star: float) -> float:
    """The confidence sequence's half-width for a difference with variance ``var_diff`` after ``t`` samples."""
    if t <= 0:
        return math.inf
    r2 = rho_squared(alpha, t_star)
    sigma2 = var_diff * t  # the per-sample variance that gives var_diff at t samples
    radius2 = 2.0 * (t * r2 + 1.0) / (t * t * r2) * math.log(math.sqrt(t * r2 + 1.0) / alpha)
    return math.sqrt(sigma2 * radius2)


def compare(candidate: ArmStats, incumbent: ArmStats, *, alpha: float, t_star: float) -> Bound:
    if candidate.n == 0 or incumbent.n == 0:
        return Bound(candidate.mean - incumbent.mean, math.inf)
    var_diff = candidate.var / candidate.n + incumbent.var / incumbent.n
    t = min(candidate.n, incumbent.n)
    return Bound(candidate.mean - incumbent.mean, half_width(var_diff, t, alpha, t_star))


@dataclass(frozen=True, slots=True)
class Rule:
    margin: float = 0.05  # how much worse (in reward units) the candidate may be and still be promoted
    min_n: int = 50  # samples per arm before any decision on evidence
    alpha: float = 0.05
    max_seconds: float = 3600.0
    timeout_outcome: Literal["promote", "reject"] = "reject"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reason: str  # "evidence: …", "errors: …", "time limit: …", "waiting: …"
    evidence: dict[str, Any]


def _fmt(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def _arm(rewards: ArmStats, errors: ArmStats) -> dict[str, Any]:
    return {
        "n": rewards.n,
        "mean": _fmt(rewards.mean),
        "var": _fmt(rewards.var),
        "calls": errors.n,
        "error_rate": _fmt(errors.mean),
    }


def decide(
    rewards: tuple[ArmStats, ArmStats],
    errors: tuple[ArmStats, ArmStats],
    rule: Rule,
    elapsed: float,
) -> Verdict:
    """The verdict on a canary after ``elapsed`` seconds; arms are (candidate, incumbent)."""
    (rc, ri), (ec, ei) = rewards, errors
    reward = compare(rc, ri, alpha=rule.alpha, t_star=rule.min_n)
    error = compare(ec, ei, alpha=rule.alpha, t_star=rule.min_n)
    evidence: dict[str, Any] = {
        "candidate": _arm(rc, ec),
        "incumbent": _arm(ri, ei),
        "diff": _fmt(reward.diff),
        "lower": _fmt(reward.lower),
        "upper": _fmt(reward.upper),
        "error_diff": _fmt(error.diff),
        "error_lower": _fmt(error.lower),
        "margin": rule.margin,
        "alpha": rule.alpha,
        "min_n": rule.min_n,
        "elapsed_s": round(elapsed, 1),
        "rule": asdict(rule),
    }
    enough_calls = min(ec.n, ei.n) >= rule.min_n
    if enough_calls and error.lower > 0:
        return Verdict(
            "reject",
            f"errors: the candidate fails more often (+{error.diff:.3f}, lower bound {error.lower:.3f} > 0)",
            evidence,
        )
    if min(rc.n, ri.n) >= rule.min_n:
        if reward.upper < 0:
            return Verdict(
                "reject",
                f"evidence: the candidate is worse (d={reward.diff:+.3f}, upper bound {reward.upper:+.3f} < 0)",
                evidence,
            )
        if reward.lower > -rule.margin:
            return Verdict(
                "promote",
                f"evidence: not worse by more than {rule.margin:g} (d={reward.diff:+.3f}, "
                f"lower bound {reward.lower:+.3f})",
                evidence,
            )
    if elapsed >= rule.max_seconds:
        return Verdict(
            rule.timeout_outcome,
            f"time limit: undecided after {elapsed:.0f}s (n={rc.n}/{ri.n}); default outcome",
            evidence,
        )
    return Verdict("wait", f"waiting: n={rc.n}/{ri.n} of {rule.min_n}, d={reward.diff:+.3f}", evidence)


__all__ = ["ArmStats", "Bound", "Rule", "Verdict", "compare", "decide", "half_width"]
