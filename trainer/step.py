"""One optimization step over what is ready — task rollouts and turns of everyday traffic — and its bookkeeping.

Two kinds of data, trained together in one step:

- **rollouts** of a task run (they have a group): ready when finished ``completed`` with a rollout-level reward and
  not yet consumed in this epoch. Their advantage is GRPO's, within the task–harness group, broadcast to every
  branch of the rollout's prefix tree (``advantages.group_advantages``);
- **turns** (one call each) of rollouts without a group — the implicit conversations and harness sessions of
  everyday use: ready when rewarded per call (judge, feedback, rules, functions) with their next state known or
  their rollout closed (``gateway/store/turns.py``), even while the session goes on. With one sample per prompt
  there is no group: their advantage uses a batch baseline per harness (``advantages.batch_advantages``), and only
  the turn's own completion tokens carry it (``credit.py``); a turn is consumed once per epoch
  (``trained_turns``).

``advantage="batch"`` puts rollouts on a batch baseline too (per harness); ``"critic"`` (``algorithm="ppo"``) uses
PPO's value head for both (``ppo.optimize``: GAE per branch for rollouts, per turn for turns) and saves the head
with each version (``value_head.safetensors``).

A step packs the trees (``batch.pack_trees``: shared prefixes computed and counted once), accumulates the gradient
of the PPO-clip loss with token-level truncated importance sampling against the engine's logprobs
(``loss.policy_loss``), normalized by the number of distinct trainable tokens, takes one optimizer step, saves
``policy@v(N+1)`` and, in one transaction, records the train step, the new policy version and everything it
consumed (``trained_rollouts`` / ``trained_turns``, primary keys (id, epoch): nothing is trained twice in an epoch).
A crash before that commit leaves nothing recorded: the data stays ready and the next run starts again from the
last published version.

Data that carries no signal (a group or a batch key without reward variance or with a single member; a tree
dropped for abnormal branching; served by a version beyond the staleness bound) is consumed too, with no
advantage, and counted in the step's metrics — never silently left behind or retried forever.
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

from gateway.store import turns
from gateway.store.models import Call, PolicyVersion, Reward, Rollout, TrainedRollout, TrainedTurn, TrainStep
from trainer import lora, ppo, publish
from trainer.advantages import AdvantageResult, batch_advantages, group_advantages
from trainer.batch import pack_trees, sequence_logprobs
from trainer.credit import Credit, CreditTable
from trainer.data import RolloutData, TurnData, load_rollout, load_turns, turn_trees
from trainer.filters import TreeConfig
from trainer.loss import policy_loss
from trainer.tree import RolloutTree

log = logging.getLogger("clawgate.trainer")
ALGORITHMS = ("grpo", "ppo")
ADVANTAGES = ("group", "batch", "critic")


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
    # "group" (GRPO for rollouts with a group, a batch baseline for turns), "batch" (a batch baseline for both),
    # "critic" (PPO's value head for both; the same as algorithm="ppo").
    advantage: str = "group"
    # Turns wait for the reward worker's verdict (a judge runs) before they are ready.
    await_judge: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if self.algorithm == "ppo" and self.advantage not in ("group", "critic"):
            raise ValueError(
                f"algorithm ppo estimates advantages with its critic; advantage {self.advantage!r} "
                "cannot be used with it"
            )
        if self.advantage == "critic":
            self.algorithm = "ppo"
        elif self.algorithm == "ppo":
            self.advantage = "critic"


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
    skipped: dict[str, str]  # rollout or call id -> why it was consumed without training
    metrics: dict[str, float]
    seconds: float
    turns: int = 0
    trained_turns: int = 0


def ready_condition(epoch: int) -> tuple[sa.ColumnElement[bool], ...]:
    """A rollout of a task run (it has a group) ready to train; rollouts without a group train turn by turn."""
    consumed = sa.select(TrainedRollout.rollout_id).where(TrainedRollout.epoch == epoch)
    rewarded = sa.select(Reward.rollout_id).where(Reward.call_id.is_(None))
    return (
        Rollout.status == "completed",
        Rollout.eval.is_(False),
        Rollout.group_key.is_not(None),
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


def stale_turns(db: sa.Engine, epoch: int, oldest_ok: int, limit: int = 10_000) -> dict[str, tuple[str, int]]:
    """Turns not consumed yet that a version older than ``oldest_ok`` served: call id -> (rollout id, version).

    They could never be trained (staleness only grows), ready or not, so they are consumed as stale: that also
    ends the wait of turns whose judge verdict will never come (the worker skips stale turns too).
    """
    version = sa.func.coalesce(Call.policy_version, 0)
    query = (
        sa.select(Call.id, Call.rollout_id, version)
        .join(Rollout, Rollout.id == Call.rollout_id)
        .where(*turns.is_turn(), turns.not_consumed(epoch), version < oldest_ok)
        .limit(limit)
    )
    with Session(db) as session:
        return {row[0]: (row[1], int(row[2])) for row in session.execute(query)}


@dataclass(slots=True)
class Readiness:
    rollouts: int  # ready rollouts of task runs
    groups: int  # groups with at least two ready rollouts (a GRPO baseline needs company)


def readiness(db: sa.Engine, epoch: int) -> Readiness:
    group = Rollout.group_key
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
        turn_ids = turns.ready_turns(self.db, cfg.epoch, cfg.max_rollouts, await_judge=cfg.await_judge)
        if len(ids) + len(turn_ids) < cfg.min_rollouts:
            return None
        data = self._hold_lonely([d for d in (load_rollout(self.db, i, cfg.tree) for i in ids) if d is not None])
        plan = _Plan(data, load_turns(self.db, turn_ids))
        if len(plan.rollouts) + len(plan.turns) < cfg.min_rollouts:
            return None
        self._screen(plan)
        metrics = self._critic_step(plan) if cfg.advantage == "critic" else self._policy_gradient_step(plan)
        metrics.update(plan.figures())
        consumed, consumed_turns = self._consumed(plan)
        metrics["rollouts_skipped"] = float(sum(1 for k in plan.skipped if k in consumed))
        metrics["turns_skipped"] = float(sum(1 for k in plan.skipped if k in consumed_turns))
        metrics["rollouts_stale"] = float(sum(1 for r in plan.skipped.values() if r.startswith("stale")))
        version = self.version + 1
        step_id = self._publish(
            lora.Manifest(
                version=version,
                base_model=cfg.model,
                step=version,
                lora=asdict(cfg.lora),
                rollouts=sorted(consumed),
                turns=sorted(consumed_turns),
                metrics=metrics,
                parent_version=self.version,
            ),
            step=(started, metrics),
            consumed=consumed,
            consumed_turns=consumed_turns,
            metrics=metrics,
        )
        self.version = version
        return StepResult(
            step_id,
            version,
            len(plan.rollouts),
            len(plan.trained),
            plan.skipped,
            metrics,
            time.perf_counter() - t0,
            turns=len(plan.turns),
            trained_turns=len(plan.trained_turns),
        )

    def _screen(self, plan: _Plan) -> None:
        """Sort out what cannot train: dropped trees, missing rewards, data beyond the staleness bound."""
        bound = self.config.max_staleness
        for d in plan.rollouts:
            served = _served_version(d)
            stale = self.version - served
            if d.tree.dropped:
                plan.skipped[d.rollout.id] = f"tree dropped: {d.tree.report.dropped_reason}"
            elif d.reward is None:
                plan.skipped[d.rollout.id] = "no reward"
            elif bound is not None and stale > bound:
                plan.skipped[d.rollout.id] = f"stale: served by policy@v{served}, {stale} versions behind"
            else:
                plan.usable.append(d)
                plan.staleness.append(stale)
        for t in plan.turns:
            served = t.policy_version or 0
            stale = self.version - served
            if t.reward is None:
                plan.skipped[t.call_id] = "no reward"
            elif bound is not None and stale > bound:
                plan.skipped[t.call_id] = f"stale: served by policy@v{served}, {stale} versions behind"
            else:
                plan.usable_turns.append(t)
                plan.staleness.append(stale)

    def _policy_gradient_step(self, plan: _Plan) -> dict[str, float]:
        """Advantages from a baseline (GRPO group or batch), then one update with per-token credit."""
        cfg = self.config
        rewards = {d.rollout.id: float(d.reward) for d in plan.usable if d.reward is not None}
        result: AdvantageResult
        if cfg.advantage == "group":
            groups = {d.rollout.id: _group(d) for d in plan.usable}
            result = group_advantages(
                rewards,
                groups,
                scale_by_std=cfg.scale_by_std,
                baseline=cfg.baseline,  # type: ignore[arg-type]
            )
        else:
            keys = {d.rollout.id: f"rollouts:{d.rollout.harness or 'unknown'}" for d in plan.usable}
            result = batch_advantages(rewards, keys, scale_by_std=cfg.scale_by_std)
        turn_result = batch_advantages(
            {t.call_id: t.reward.value for t in plan.usable_turns if t.reward is not None},
            {t.call_id: t.baseline_key for t in plan.usable_turns},
            scale_by_std=cfg.scale_by_std,
        )
        plan.skipped.update(result.skipped)
        plan.skipped.update(turn_result.skipped)
        plan.advantages, plan.turn_advantages = result.advantages, turn_result.advantages
        plan.trained = [d for d in plan.usable if d.rollout.id in plan.advantages]
        plan.trained_turns = [t for t in plan.usable_turns if t.call_id in plan.turn_advantages]
        trees: list[RolloutTree] = [d.tree for d in plan.trained]
        credits: list[Credit] = [plan.advantages[d.rollout.id] for d in plan.trained]
        for _, tree in turn_trees(self.db, plan.trained_turns):
            trees.append(tree)
            credits.append(plan.turn_advantages)
        log.info(
            "step from policy@v%d: %d rollouts (%d with signal), %d turns (%d with signal)",
            self.version,
            len(plan.rollouts),
            len(plan.trained),
            len(plan.turns),
            len(plan.trained_turns),
        )
        return self._optimize(trees, credits) if trees else {}

    def _critic_step(self, plan: _Plan) -> dict[str, float]:
        """PPO: GAE per branch (rollouts) and per turn (turns) with the value head; every usable item trains."""
        plan.trained, plan.trained_turns = plan.usable, plan.usable_turns
        trees: list[RolloutTree] = [d.tree for d in plan.usable]
        rewards: list[float | dict[str, float]] = [cast(float, d.reward) for d in plan.usable]
        turn_rewards = {t.call_id: t.reward.value for t in plan.usable_turns if t.reward is not None}
        for _, tree in turn_trees(self.db, plan.usable_turns):
            trees.append(tree)
            rewards.append(turn_rewards)
        log.info(
            "step from policy@v%d (ppo): %d rollouts, %d turns", self.version, len(plan.usable), len(plan.usable_turns)
        )
        if not trees:
            return {}
        assert self.critic is not None
        per_tree: dict[int, float] = {}
        per_call: dict[str, float] = {}
        metrics = ppo.optimize(
            self.policy,
            self.optimizer,
            self.critic,
            trees,
            rewards,
            self.config,
            rollout_advantages=per_tree,
            call_advantages=per_call,
            progress=self.progress,
        )
        plan.advantages = {plan.usable[i].rollout.id: a for i, a in per_tree.items() if i < len(plan.usable)}
        plan.turn_advantages = {t.call_id: per_call.get(t.call_id, 0.0) for t in plan.usable_turns}
        return metrics

    def _consumed(
        self, plan: _Plan
    ) -> tuple[dict[str, float | None], dict[str, tuple[str, float | None, float | None]]]:
        """Everything the step consumes, with its advantage (None: consumed untrained), stale backlog included."""
        cfg = self.config
        consumed = {d.rollout.id: plan.advantages.get(d.rollout.id) for d in plan.rollouts}
        consumed_turns = {
            t.call_id: (t.rollout_id, None if t.reward is None else t.reward.value, plan.turn_advantages.get(t.call_id))
            for t in plan.turns
        }
        if cfg.max_staleness is not None:
            # The backlog beyond the staleness bound is consumed (and reported) without loading its trees.
            oldest_ok = self.version - cfg.max_staleness
            for rid, served in stale_rollouts(self.db, cfg.epoch, oldest_ok).items():
                if rid not in consumed:
                    consumed[rid] = None
                    plan.skipped[rid] = f"stale: served by policy@v{served}, {self.version - served} versions behind"
            for cid, (rid, served) in stale_turns(self.db, cfg.epoch, oldest_ok).items():
                if cid not in consumed_turns:
                    consumed_turns[cid] = (rid, None, None)
                    plan.skipped[cid] = f"stale: served by policy@v{served}, {self.version - served} versions behind"
        return consumed, consumed_turns

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

    def _optimize(self, trees: list[RolloutTree], credits: list[Credit]) -> dict[str, float]:
        """One policy-gradient update over ``trees``; each trained token's advantage comes from ``credits``."""
        cfg = self.config
        device = next(self.policy.parameters()).device
        table = CreditTable(trees, credits)
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
                table.for_batch(b),
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

    def _publish(
        self,
        manifest: lora.Manifest,
        *,
        step: tuple[dt.datetime, dict[str, float]] | None,
        consumed: dict[str, float | None],
        metrics: dict[str, float],
        consumed_turns: dict[str, tuple[str, float | None, float | None]] | None = None,
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
                    n_rollouts=len(consumed) + len(consumed_turns or {}),
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
                for call_id, (rollout_id, reward, advantage) in (consumed_turns or {}).items():
                    session.add(
                        TrainedTurn(
                            call_id=call_id,
                            epoch=self.config.epoch,
                            rollout_id=rollout_id,
                            step_id=step_id,
                            version=manifest.version,
                            reward=reward,
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


@dataclass(slots=True)
class _Plan:
    """One step's data: what was loaded, what can train, the advantages, and why the rest is skipped."""

    rollouts: list[RolloutData]
    turns: list[TurnData]
    usable: list[RolloutData] = field(default_factory=list)
    usable_turns: list[TurnData] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # versions behind, per usable item
    skipped: dict[str, str] = field(default_factory=dict)  # rollout or call id -> why it is not trained
    advantages: dict[str, float] = field(default_factory=dict)  # rollout id -> advantage
    turn_advantages: dict[str, float] = field(default_factory=dict)  # call id -> advantage
    trained: list[RolloutData] = field(default_factory=list)
    trained_turns: list[TurnData] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        out = {
            "rollouts": float(len(self.rollouts)),
            "rollouts_trained": float(len(self.trained)),
            "turns": float(len(self.turns)),
            "turns_trained": float(len(self.trained_turns)),
            "staleness_max": float(max(self.staleness, default=0)),
        }
        # Means of nothing are left out, not NaN: PostgreSQL's JSON has no NaN.
        rewards = [d.reward for d in self.usable if d.reward is not None]
        if rewards:
            out["reward_mean"] = _mean(rewards)
        turn_rewards = [t.reward.value for t in self.usable_turns if t.reward is not None]
        if turn_rewards:
            out["turn_reward_mean"] = _mean(turn_rewards)
        if self.staleness:
            out["staleness_mean"] = _mean([float(x) for x in self.staleness])
        return out


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
    if result.turns:
        parts.append(f"turns {result.trained_turns}/{result.turns}")
    for key in (
        "reward_mean",
        "turn_reward_mean",
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


__all__ = [
    "ADVANTAGES",
    "Readiness",
    "StepResult",
    "TrainConfig",
    "Trainer",
    "describe",
    "readiness",
    "ready_rollouts",
    "stale_turns",
]
