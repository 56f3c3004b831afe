"""One GRPO or PPO optimization step over the rollouts that are ready, and its bookkeeping.

Ready = finished with status ``completed``, rewarded, and not yet consumed in this epoch. A step:

1. builds each rollout's prefix tree (``data.load_rollout``) and its group's advantage
   (``advantages.group_advantages``: GRPO within a task–harness group, broadcast to every branch);
2. packs the trees (``batch.pack_trees``: shared prefixes computed and counted once) and accumulates the gradient of
   the PPO-clip loss with token-level truncated importance sampling against the engine's logprobs
   (``loss.policy_loss``), normalized by the number of distinct trainable tokens;
3. takes one optimizer step, saves ``policy@v(N+1)`` and, in one transaction, records the train step, the new
   policy version and every rollout it consumed (``trained_rollouts``: primary key (rollout, epoch), so a rollout
   can never be trained twice in an epoch). A crash before that commit leaves nothing recorded: the rollouts stay
   ready and the next run starts again from the last published version.

Rollouts that carry no signal (their group has zero reward variance, or a single member; their tree was dropped
for abnormal branching) are consumed too, with no advantage, and counted in the step's metrics — never silently
left behind or retried forever.

With ``algorithm="ppo"`` step 1 and 2 are ``ppo.optimize``: advantages come from GAE along each branch with a value
head on the policy (no group baseline, so every usable rollout trains), and the head is saved with each version
(``value_head.safetensors``). Consumption and bookkeeping are the same.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

from gateway.store.models import Call, PolicyVersion, Reward, Rollout, TrainedRollout, TrainStep
from trainer import lora, ppo, publish
from trainer.advantages import group_advantages
from trainer.batch import pack_trees, sequence_logprobs
from trainer.data import RolloutData, load_rollout
from trainer.filters import TreeConfig
from trainer.loss import policy_loss

log = logging.getLogger("clawgate.trainer")
ALGORITHMS = ("grpo", "ppo")


@dataclass(slots=True)
class TrainConfig:
    model: str
    database_url: str
    adapter_dir: Path = Path("adapters")
    lr: float = 1e-5
    lora: lora.LoraSettings = field(default_factory=lora.LoraSettings)
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    scale_by_std: bool = True
    baseline: str = "mean"
    # Sampling temperature the logprobs were recorded at (engines report processed logprobs).
    temperature: float = 1.0
    max_rollouts: int = 256
    min_rollouts: int = 1
    max_tokens_per_bin: int = 16384
    strategy: str = "tree"
    # Rollouts whose calls were served by a version more than this many versions older than the one being trained
    # are consumed without training (None: no bound). Truncated IS corrects small gaps, not arbitrary ones.
    max_staleness: int | None = None
    # A group with a single ready member waits this many seconds (from its finish) for more members before it is
    # consumed without signal; 0 consumes it at once (a one-shot run).
    group_wait: float = 0.0
    epoch: int = 0
    dtype: str = "float32"
    seed: int = 0
    tree: TreeConfig = field(default_factory=TreeConfig)
    # "grpo" (group-normalized advantages) or "ppo" (a value head and GAE per branch: trainer/ppo.py).
    algorithm: str = "grpo"
    gamma: float = 1.0
    lam: float = 0.95
    # Weight of the value loss next to the policy loss (the LoRA trunk is shared); value_clip bounds V − V_old.
    value_coef: float = 0.1
    value_clip: float | None = 0.2
    # An Adam step of the head moves a value by up to about critic_lr · ‖h‖₁ (h: the last hidden state).
    critic_lr: float = 1e-5
    # Steps that train only the value head (the policy stays as it is) before PPO updates the policy.
    critic_warmup_steps: int = 0
    gradient_checkpointing: bool = False
    device: str = "auto"  # "auto": cuda when available, else cpu

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")


def resolve_device(name: str) -> str:
    """``"auto"``: the GPU when there is one, else the CPU; any other name as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


@dataclass(slots=True)
class StepResult:
    step_id: int
    version: int
    rollouts: int
    trained_rollouts: int
    skipped: dict[str, str]
    metrics: dict[str, float]
    seconds: float


def ready_condition(epoch: int) -> tuple[sa.ColumnElement[bool], ...]:
    consumed = sa.select(TrainedRollout.rollout_id).where(TrainedRollout.epoch == epoch)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    return (
        Rollout.status == "completed",
        Rollout.eval.is_(False),
        Rollout.id.in_(rewarded),
        Rollout.id.not_in(consumed),
    )


def ready_rollouts(db: sa.Engine, epoch: int, limit: int) -> list[str]:
    """Finished, rewarded, not evaluation, not consumed in ``epoch``: the freshest first.

    Freshest first, because clients may produce rollouts faster than the trainer consumes them: oldest-first would
    then train on ever staler data (further off-policy every step), while freshest-first trains on what the
    current policy produced and lets the backlog age out through the staleness bound (``stale_rollouts``).
    """
    query = (
        sa.select(Rollout.id)
        .where(*ready_condition(epoch))
        .order_by(Rollout.finished_at.desc(), Rollout.id.desc())
        .limit(limit)
    )
    with Session(db) as session:
        return list(session.scalars(query))


def stale_rollouts(db: sa.Engine, epoch: int, oldest_ok: int, limit: int = 10_000) -> dict[str, int]:
    """Ready rollouts with a call served by a version older than ``oldest_ok``: rollout id -> that version."""
    served = (
        sa.select(Call.rollout_id, sa.func.min(sa.func.coalesce(Call.policy_version, 0)).label("version"))
        .where(Call.status == "ok")
        .group_by(Call.rollout_id)
        .subquery()
    )
    query = (
        sa.select(Rollout.id, served.c.version)
        .join(served, served.c.rollout_id == Rollout.id)
        .where(*ready_condition(epoch), served.c.version < oldest_ok)
        .limit(limit)
    )
    with Session(db) as session:
        return {row[0]: int(row[1]) for row in session.execute(query)}


@dataclass(slots=True)
class Readiness:
    rollouts: int  # ready rollouts
    groups: int  # groups with at least two ready rollouts (a GRPO baseline needs company)


def readiness(db: sa.Engine, epoch: int) -> Readiness:
    group = sa.func.coalesce(Rollout.group_key, Rollout.task_id, Rollout.id)
    sizes = sa.select(group.label("g"), sa.func.count().label("n")).where(*ready_condition(epoch)).group_by(group)
    with Session(db) as session:
        rows = session.execute(sizes).all()
    return Readiness(rollouts=sum(int(r.n) for r in rows), groups=sum(1 for r in rows if int(r.n) >= 2))


class Trainer:
    """Holds the policy and its optimizer across steps (``clawgate train`` runs one per process)."""

    def __init__(self, config: TrainConfig, db: sa.Engine) -> None:
        self.config = config
        self.db = db
        # Called as progress(phase, batches done, batches) while a step runs (`clawgate train` draws a bar).
        self.progress: Callable[[str, int, int], None] | None = None
        torch.manual_seed(config.seed)
        base = lora.load_base(config.model, dtype=config.dtype, device=resolve_device(config.device))
        latest = publish.recover(db, config.adapter_dir)
        if latest is None:
            self.policy = lora.new_policy(base, config.lora, gradient_checkpointing=config.gradient_checkpointing)
            self.version = 0
            self.critic = self._critic(None)
            self._publish(
                lora.Manifest(version=0, base_model=config.model, lora=asdict(config.lora)),
                step=None,
                consumed={},
                metrics={},
            )
        else:
            path = lora.version_path(config.adapter_dir, latest)
            self.policy = lora.load_policy(base, path, gradient_checkpointing=config.gradient_checkpointing)
            self.version = latest
            self.critic = self._critic(path)
        self.policy.train()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)

    def step(self) -> StepResult | None:
        cfg = self.config
        t0 = time.perf_counter()
        started = dt.datetime.now(dt.UTC)
        ids = ready_rollouts(self.db, cfg.epoch, cfg.max_rollouts)
        if len(ids) < cfg.min_rollouts:
            return None
        data = self._hold_lonely([d for d in (load_rollout(self.db, i, cfg.tree) for i in ids) if d is not None])
        if len(data) < cfg.min_rollouts:
            return None
        skipped: dict[str, str] = {}
        usable: list[RolloutData] = []
        staleness: list[int] = []
        for d in data:
            served = _served_version(d)
            stale = self.version - served
            if d.tree.dropped:
                skipped[d.rollout.id] = f"tree dropped: {d.tree.report.dropped_reason}"
            elif d.reward is None:
                skipped[d.rollout.id] = "no reward"
            elif cfg.max_staleness is not None and stale > cfg.max_staleness:
                skipped[d.rollout.id] = f"stale: served by policy@v{served}, {stale} versions behind"
            else:
                usable.append(d)
                staleness.append(stale)
        if cfg.algorithm == "ppo":
            # GAE per branch needs no group baseline: every usable rollout trains.
            trained = usable
            log.info("step from policy@v%d (ppo): %d rollouts, %d usable", self.version, len(data), len(trained))
            metrics, advantages = self._optimize_ppo(trained) if trained else ({}, {})
        else:
            groups = {d.rollout.id: _group(d) for d in usable}
            result = group_advantages(
                {d.rollout.id: float(d.reward) for d in usable if d.reward is not None},
                groups,
                scale_by_std=cfg.scale_by_std,
                baseline=cfg.baseline,  # type: ignore[arg-type]
            )
            skipped.update(result.skipped)
            advantages = result.advantages
            trained = [d for d in usable if d.rollout.id in advantages]
            log.info("step from policy@v%d: %d rollouts, %d with signal", self.version, len(data), len(trained))
            metrics = self._optimize(trained, advantages) if trained else {}
        metrics.update(
            {
                "rollouts": float(len(data)),
                "rollouts_trained": float(len(trained)),
                "rollouts_skipped": float(len(skipped)),
                "rollouts_stale": float(sum(1 for r in skipped.values() if r.startswith("stale"))),
                "staleness_max": float(max(staleness, default=0)),
            }
        )
        # Means of nothing are left out, not NaN: PostgreSQL's JSON has no NaN.
        rewards = [d.reward for d in usable if d.reward is not None]
        if rewards:
            metrics["reward_mean"] = _mean(rewards)
        if staleness:
            metrics["staleness_mean"] = _mean([float(x) for x in staleness])
        version = self.version + 1
        consumed = {rid: advantages.get(rid) for rid in [d.rollout.id for d in data]}
        if cfg.max_staleness is not None:
            # The backlog beyond the staleness bound is consumed (and reported) without loading its trees.
            for rid, served in stale_rollouts(self.db, cfg.epoch, self.version - cfg.max_staleness).items():
                if rid not in consumed:
                    consumed[rid] = None
                    skipped[rid] = f"stale: served by policy@v{served}, {self.version - served} versions behind"
            metrics["rollouts_stale"] = float(sum(1 for r in skipped.values() if r.startswith("stale")))
        step_id = self._publish(
            lora.Manifest(
                version=version,
                base_model=cfg.model,
                step=version,
                lora=asdict(cfg.lora),
                rollouts=sorted(consumed),
                metrics=metrics,
                parent_version=self.version,
            ),
            step=(started, metrics),
            consumed=consumed,
            metrics=metrics,
        )
        self.version = version
        seconds = time.perf_counter() - t0
        return StepResult(step_id, version, len(data), len(trained), skipped, metrics, seconds)

    def _hold_lonely(self, data: list[RolloutData]) -> list[RolloutData]:
        """Leave out (for a later step) a group's only ready member while it may still get company."""
        wait = self.config.group_wait
        if wait <= 0:
            return data
        sizes: dict[str, int] = {}
        for d in data:
            sizes[_group(d)] = sizes.get(_group(d), 0) + 1
        now = dt.datetime.now(dt.UTC)
        kept = []
        for d in data:
            finished = d.rollout.finished_at or d.rollout.updated_at
            if sizes[_group(d)] == 1 and (now - finished).total_seconds() < wait:
                continue
            kept.append(d)
        return kept

    def _optimize(self, trained: list[RolloutData], advantages: dict[str, float]) -> dict[str, float]:
        cfg = self.config
        trees = [d.tree for d in trained]
        device = next(self.policy.parameters()).device
        adv = torch.tensor([advantages[d.rollout.id] for d in trained], dtype=torch.float32, device=device)
        batches = pack_trees(trees, cfg.strategy, cfg.max_tokens_per_bin)  # type: ignore[arg-type]
        total = float(sum(float(b.weights[b.trainable].sum()) for b in batches)) or 1.0
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        processed = 0
        for i, b in enumerate(batches):
            b = b.to(device)
            logp = sequence_logprobs(self.policy, b, temperature=cfg.temperature)
            loss, m = policy_loss(
                logp,
                logp.detach(),  # one update per batch: the "old" policy is the current one
                b.rollout_logprobs,
                adv[b.rollout_index],
                b.trainable,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                is_cap=cfg.is_cap,
                aggregation="token_sum",
                weights=b.weights,
            )
            (loss / total).backward()
            if self.progress is not None:
                self.progress("train", i + 1, len(batches))
            processed += b.num_tokens
            share = float(b.weights[b.trainable].sum()) / total
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.policy.parameters() if p.requires_grad], max_norm=1.0
        )
        self.optimizer.step()
        sums.update({"grad_norm": float(grad_norm), "tokens_processed": float(processed), "trainable_tokens": total})
        return sums

    def _critic(self, resumed: Path | None) -> ppo.Critic | None:
        """PPO's value head: the one saved in the version resumed from, else a fresh one (None for GRPO)."""
        cfg = self.config
        if cfg.algorithm != "ppo":
            return None
        if resumed is not None and ppo.Critic.saved_in(resumed):
            device = self.policy.get_input_embeddings().weight.device
            return ppo.Critic.load(resumed, lr=cfg.critic_lr, device=device)
        return ppo.Critic.for_policy(self.policy, lr=cfg.critic_lr)

    def _optimize_ppo(self, trained: list[RolloutData]) -> tuple[dict[str, float], dict[str, float]]:
        """One PPO update; the metrics and each rollout's mean token advantage (recorded as its advantage)."""
        assert self.critic is not None
        per_tree: dict[int, float] = {}
        metrics = ppo.optimize(
            self.policy,
            self.optimizer,
            self.critic,
            [d.tree for d in trained],
            [cast(float, d.reward) for d in trained],  # usable rollouts are rewarded
            self.config,
            rollout_advantages=per_tree,
            progress=self.progress,
        )
        return metrics, {trained[i].rollout.id: a for i, a in per_tree.items()}

    def _publish(
        self,
        manifest: lora.Manifest,
        *,
        step: tuple[dt.datetime, dict[str, float]] | None,
        consumed: dict[str, float | None],
        metrics: dict[str, float],
    ) -> int:
        # A non-finite metric (a diverged loss) is dropped, not stored: JSON has no NaN, PostgreSQL refuses it.
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        manifest.metrics = metrics
        extra = None if self.critic is None else self.critic.save
        path = lora.save_version(self.policy, self.config.adapter_dir, manifest, extra=extra)
        now = dt.datetime.now(dt.UTC)
        with Session(self.db) as session, session.begin():
            step_id = 0
            if step is not None:
                row = TrainStep(
                    version=manifest.version,
                    base_version=manifest.parent_version,
                    algorithm=self.config.algorithm,
                    status="ok",
                    n_rollouts=len(consumed),
                    n_paths=0,
                    tokens_processed=int(metrics.get("tokens_processed", 0)),
                    trainable_tokens=int(metrics.get("trainable_tokens", 0)),
                    metrics=metrics,
                    started_at=step[0],
                    ended_at=now,
                )
                session.add(row)
                session.flush()
                step_id = row.id
                for rollout_id, advantage in consumed.items():
                    session.add(
                        TrainedRollout(
                            rollout_id=rollout_id,
                            epoch=self.config.epoch,
                            step_id=step_id,
                            version=manifest.version,
                            advantage=advantage,
                            created_at=now,
                        )
                    )
            session.add(
                PolicyVersion(
                    version=manifest.version,
                    adapter_name=lora.version_name(manifest.version),
                    path=str(path),
                    base_model=manifest.base_model,
                    status="published",
                    is_current=False,
                    step=step_id or None,
                    metrics=metrics or None,
                    created_at=now,
                )
            )
        return step_id


def _group(d: RolloutData) -> str:
    return d.rollout.group_key or d.rollout.task_id or d.rollout.id


def _served_version(d: RolloutData) -> int:
    """The oldest version that served a call of the rollout (calls served by the base model count as v0)."""
    return min((v or 0 for v in d.served_versions), default=0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def describe(result: StepResult) -> str:
    m = result.metrics
    parts = [
        f"step {result.step_id} -> policy@v{result.version}",
        f"rollouts {result.trained_rollouts}/{result.rollouts}",
    ]
    for key in (
        "reward_mean",
        "loss",
        "value_loss",
        "explained_variance",
        "clip_frac_high",
        "is_weight_mean",
        "approx_kl",
        "grad_norm",
        "tokens_processed",
    ):
        if key in m:
            parts.append(f"{key} {m[key]:.4g}")
    parts.append(f"{result.seconds:.2f}s")
    return "  ".join(parts)


__all__ = ["Readiness", "StepResult", "TrainConfig", "Trainer", "describe", "readiness", "ready_rollouts"]
