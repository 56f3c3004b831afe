"""One GRPO optimization step over the rollouts that are ready, and its bookkeeping.

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
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

from gateway.store.models import PolicyVersion, Reward, Rollout, TrainedRollout, TrainStep
from trainer import lora
from trainer.advantages import group_advantages
from trainer.batch import pack_trees, sequence_logprobs
from trainer.data import RolloutData, load_rollout
from trainer.filters import TreeConfig
from trainer.loss import policy_loss

log = logging.getLogger("clawgate.trainer")


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
    epoch: int = 0
    dtype: str = "float32"
    seed: int = 0
    tree: TreeConfig = field(default_factory=TreeConfig)


@dataclass(slots=True)
class StepResult:
    step_id: int
    version: int
    rollouts: int
    trained_rollouts: int
    skipped: dict[str, str]
    metrics: dict[str, float]
    seconds: float


def ready_rollouts(db: sa.Engine, epoch: int, limit: int) -> list[str]:
    consumed = sa.select(TrainedRollout.rollout_id).where(TrainedRollout.epoch == epoch)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    query = (
        sa.select(Rollout.id)
        .where(Rollout.status == "completed", Rollout.id.in_(rewarded), Rollout.id.not_in(consumed))
        .order_by(Rollout.finished_at, Rollout.id)
        .limit(limit)
    )
    with Session(db) as session:
        return list(session.scalars(query))


class Trainer:
    """Holds the policy and its optimizer across steps (``clawgate train`` runs one per process)."""

    def __init__(self, config: TrainConfig, db: sa.Engine) -> None:
        self.config = config
        self.db = db
        torch.manual_seed(config.seed)
        base = lora.load_base(config.model, dtype=config.dtype)
        latest = lora.latest_version(config.adapter_dir)
        if latest is None:
            self.policy = lora.new_policy(base, config.lora)
            self.version = 0
            self._publish(
                lora.Manifest(version=0, base_model=config.model, lora=asdict(config.lora)),
                step=None,
                consumed={},
                metrics={},
            )
        else:
            self.policy = lora.load_policy(base, lora.version_path(config.adapter_dir, latest))
            self.version = latest
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
        data = [d for d in (load_rollout(self.db, i, cfg.tree) for i in ids) if d is not None]
        skipped: dict[str, str] = {}
        usable: list[RolloutData] = []
        for d in data:
            if d.tree.dropped:
                skipped[d.rollout.id] = f"tree dropped: {d.tree.report.dropped_reason}"
            elif d.reward is None:
                skipped[d.rollout.id] = "no reward"
            else:
                usable.append(d)
        groups = {d.rollout.id: d.rollout.group_key or d.rollout.task_id or d.rollout.id for d in usable}
        result = group_advantages(
            {d.rollout.id: float(d.reward) for d in usable if d.reward is not None},
            groups,
            scale_by_std=cfg.scale_by_std,
            baseline=cfg.baseline,  # type: ignore[arg-type]
        )
        skipped.update(result.skipped)
        trained = [d for d in usable if d.rollout.id in result.advantages]
        metrics = self._optimize(trained, result.advantages) if trained else {}
        metrics.update(
            {
                "rollouts": float(len(data)),
                "rollouts_trained": float(len(trained)),
                "rollouts_skipped": float(len(skipped)),
                "reward_mean": _mean([d.reward for d in usable if d.reward is not None]),
            }
        )
        version = self.version + 1
        consumed = {rid: result.advantages.get(rid) for rid in [d.rollout.id for d in data]}
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
        for b in batches:
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

    def _publish(
        self,
        manifest: lora.Manifest,
        *,
        step: tuple[dt.datetime, dict[str, float]] | None,
        consumed: dict[str, float | None],
        metrics: dict[str, float],
    ) -> int:
        path = lora.save_version(self.policy, self.config.adapter_dir, manifest)
        now = dt.datetime.now(dt.UTC)
        with Session(self.db) as session, session.begin():
            step_id = 0
            if step is not None:
                row = TrainStep(
                    version=manifest.version,
                    base_version=manifest.parent_version,
                    algorithm="grpo",
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


__all__ = ["StepResult", "TrainConfig", "Trainer", "describe", "ready_rollouts"]
