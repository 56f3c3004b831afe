"""The evaluation gate of guarded promotion: a held-out task suite decides whether a new version may serve traffic.

With a gate configured (``clawgate train --eval-tasks FILE``) the trainer publishes each new version
``evaluating`` instead of ``candidate``. The gateways load it beside the incumbent but route no conversation to it;
only rollouts pinned to it (``policy_version`` on ``POST /v1/rollouts``) reach it. The gate then runs the suite
through the gateway twice, with the task runner (``runner/``, the same sandboxes, harnesses and verifiers as
``clawgate rollout --eval``):

1. every task × harness × ``n`` as evaluation rollouts pinned to the new version,
2. the same pinned to the incumbent, measured now rather than taken from an older run, so that both arms see the
   same tasks, the same gateway and the same load;

and moves the version on to ``candidate`` (its canary starts at the next gateway poll) when its mean reward is not
below the incumbent's by more than the promotion margin, or ``rejected`` otherwise. Both decisions are recorded in
``promotion_decisions`` with n, means and margin, and logged in one line.

A rollout's score is its verifier's reward; a harness timeout scores 0 (the model did not finish); verifier
crashes and infrastructure failures say nothing about the model and are left out. When an arm has no score at all
the gate raises: the trainer's loop reports it and retries later, the version stays ``evaluating`` (an operator can
still promote or reject it by hand). Evaluation rollouts are never trained on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
import sqlalchemy as sa

from gateway.store import policy_versions, promotion
from runner.client import DEFAULT_GATEWAY
from runner.harnesses import Harness, make_harness
from runner.report import RolloutResult
from runner.run import RunConfig, Runner
from runner.sandbox import SandboxFactory, SandboxMode
from runner.tasks import Task, load_tasks

log = logging.getLogger("clawgate.trainer")


class GateError(RuntimeError):
    """The gate could not measure the version (the gateway never served it, no rollout was scored)."""


@dataclass(frozen=True, slots=True)
class GateConfig:
    tasks: list[Task]
    harnesses: list[Harness]
    gateway_url: str
    admin_key: str | None
    n: int = 1  # rollouts per task × harness and arm
    concurrency: int = 2
    margin: float = 0.05  # the candidate may score this much below the incumbent and still pass
    max_turns: int = 8
    sandbox: SandboxMode = "auto"
    serve_timeout: float = 120.0  # how long the gateway may take to load the version before the gate gives up


@dataclass(frozen=True, slots=True)
class ArmScore:
    version: int
    scores: tuple[float, ...]
    unscored: int  # rollouts left out (verifier or infrastructure failures)

    @property
    def n(self) -> int:
        return len(self.scores)

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores)

    @classmethod
    def of(cls, version: int, results: list[RolloutResult]) -> ArmScore:
        scores = []
        for r in results:
            if r.kind == "rewarded" and r.reward is not None:
                scores.append(float(r.reward))
            elif r.kind == "harness_timeout":
                scores.append(0.0)
        return cls(version, tuple(scores), len(results) - len(scores))

    def figures(self) -> dict[str, Any]:
        return {"version": self.version, "n": self.n, "mean": self.mean, "unscored": self.unscored}


@dataclass(frozen=True, slots=True)
class GateResult:
    candidate: ArmScore
    incumbent: ArmScore
    margin: float

    @property
    def passed(self) -> bool:
        return self.candidate.mean >= self.incumbent.mean - self.margin

    @property
    def reason(self) -> str:
        c, i = self.candidate, self.incumbent
        verdict = "passed" if self.passed else "failed"
        figures = f"mean reward {c.mean:.3f} vs {i.mean:.3f} (n={c.n}/{i.n}, margin {self.margin:g})"
        return f"evaluation gate {verdict}: {figures}"

    @property
    def evidence(self) -> dict[str, Any]:
        return {
            "gate": "evaluation",
            "candidate": self.candidate.figures(),
            "incumbent": self.incumbent.figures(),
            "difference": self.candidate.mean - self.incumbent.mean,
            "margin": self.margin,
        }


class EvalGate:
    def __init__(self, config: GateConfig) -> None:
        if not config.tasks or not config.harnesses:
            raise ValueError("an evaluation gate needs at least one task and one harness")
        self.config = config

    def wait_until_served(self, version: int, tenant: str | None = None) -> None:
        """Until the gateway reports ``version`` loaded for evaluation (``/health``: policy.promotion.evaluating, or
        for a tenant's own policy policy.promotion.lineages.TENANT.evaluating)."""
        deadline = time.monotonic() + self.config.serve_timeout
        url = self.config.gateway_url.rstrip("/").removesuffix("/v1") + "/health"
        seen = "no answer"
        while time.monotonic() < deadline:
            try:
                body = httpx.get(url, timeout=10).json()
                promo = (body.get("policy") or {}).get("promotion") or {}
                if tenant is not None:
                    promo = (promo.get("lineages") or {}).get(tenant) or {}
                if promo.get("evaluating") == version:
                    return
                seen = f"evaluating={promo.get('evaluating')}"
            except (httpx.HTTPError, ValueError) as exc:
                seen = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise GateError(
            f"the gateway at {url} did not serve policy@v{version} within {self.config.serve_timeout:g} s ({seen})"
        )

    def run_arm(self, version: int, tenant: str | None = None) -> ArmScore:
        """The suite as evaluation rollouts pinned to ``version`` (blocking), as ``tenant``'s rollouts when it is a
        version of (or compared for) that tenant's own policy: only the tenant's routing serves those versions."""
        c = self.config
        run = RunConfig(
            gateway_url=c.gateway_url,
            admin_key=c.admin_key,
            n=c.n,
            concurrency=c.concurrency,
            eval=True,
            max_turns=c.max_turns,
            policy_version=version,
            tenant=tenant,
        )
        sandboxes = SandboxFactory(c.sandbox)
        try:
            report = asyncio.run(Runner(run, c.tasks, c.harnesses, sandboxes).run())
        finally:
            sandboxes.close()
        score = ArmScore.of(version, report.results)
        if score.n == 0:
            reasons = sorted({r.reason for r in report.results})[:3]
            raise GateError(f"no evaluation rollout of policy@v{version} was scored: {'; '.join(reasons)}")
        return score

    def evaluate(self, version: int, incumbent: int, tenant: str | None = None) -> GateResult:
        self.wait_until_served(version, tenant)
        t0 = time.monotonic()
        result = GateResult(self.run_arm(version, tenant), self.run_arm(incumbent, tenant), self.config.margin)
        log.info("policy@v%d: %s (%.0f s)", version, result.reason, time.monotonic() - t0)
        return result


def build(
    tasks: str, harnesses: str, *, n: int, gateway_url: str | None, admin_key: str | None, margin: float
) -> EvalGate:
    """The gate from its settings; ``ValueError`` says what is unusable (a task file, a harness not installed)."""
    gateway_url = gateway_url or DEFAULT_GATEWAY
    loaded = load_tasks(tasks)
    made = [make_harness(name.strip()) for name in dict.fromkeys(harnesses.split(",")) if name.strip()]
    missing = [d.describe() for d in (h.detect() for h in made) if not d.available]
    if missing:
        raise ValueError(f"evaluation gate: harness {'; '.join(missing)}")
    return EvalGate(GateConfig(loaded, made, gateway_url, admin_key, n=n, margin=margin))


def decide(db: sa.Engine, gate: EvalGate | None, version: int, incumbent: int | None, tenant: str | None = None) -> str:
    """Run the gate on a version being evaluated (of ``tenant``'s own policy, when given) and move it on; returns its
    stage afterwards.

    Without a gate (a trainer restarted without one) the version goes on to its canary, and that is logged."""
    if gate is None or incumbent is None:
        why = "no evaluation gate is configured" if gate is None else "there is no incumbent to compare with"
        promotion.move(db, version, expect=("evaluating",), to="candidate", reason=why, decided_by="trainer")
        log.warning("policy@v%d goes on to its canary unevaluated: %s", version, why)
        return policy_versions.stage_of(db, version) or "candidate"
    result = gate.evaluate(version, incumbent, tenant)
    promotion.move(
        db,
        version,
        expect=("evaluating",),
        to="candidate" if result.passed else "rejected",
        reason=result.reason,
        evidence=result.evidence,
        decided_by="trainer",
        incumbent=incumbent,
    )
    return policy_versions.stage_of(db, version) or "candidate"


__all__ = ["ArmScore", "EvalGate", "GateConfig", "GateError", "GateResult", "build", "decide"]
