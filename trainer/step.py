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
  (``trained_turns``). A turn the gateway drew counterfactual siblings for, once they and it were scored on the
  same terms, is normalized within that group instead (``advantages.turn_advantages``) and its siblings train as
  branches beside it, sharing its prompt.

``advantage="batch"`` puts rollouts on a batch baseline too (per harness); ``"critic"`` (``algorithm="ppo"``) uses
PPO's value head for both (``ppo.optimize``: GAE per branch for rollouts, per turn for turns) and saves the head
with each version (``value_head.safetensors``).

A step packs the trees (``batch.pack_trees``: shared prefixes computed and counted once), accumulates the gradient
of the PPO-clip loss with token-level truncated importance sampling against the engine's logprobs
(``loss.policy_loss``), normalized by the number of distinct trainable tokens, and takes one optimizer step — the
update loop and the step's metrics (``loss``, ``tokens``, …) are ``update.py``'s, shared with PPO. It then saves
``policy@v(N+1)`` and, in one transaction (``publish.record_version``), records the train step, the new policy
version and everything it consumed (``trained_rollouts`` / ``trained_turns``, primary keys (id, epoch): nothing is
trained twice in an epoch). A crash before that commit leaves nothing recorded: the data stays ready and the next
run starts again from the last published version.

**Lineages** (``gateway/store/lineages.py``): besides the shared policy, each tenant with a policy of its own has
a lineage, trained only on its tenant's data. One ``Trainer`` holds them all on one base model: the active lineage's
LoRA weights sit in the model, the others' are parked (a copy of their weights, their optimizer and value head);
``activate`` swaps them. A new lineage starts from the shared incumbent's weights. Version numbers are global; a
version's staleness counts only its lineage's newer versions.

What is ready and what is stale comes from the store (``gateway/store/readiness.py``, ``turns.py``), the trees from
``gateway/store/training_data.py``; the configuration is ``config.py``, a step's working data ``plan.py``.

Data that carries no signal (a group or a batch key without reward variance or with a single member; a tree
dropped for abnormal branching; served by a version beyond the staleness bound) is consumed too, with no
advantage, and counted in the step's metrics — never silently left behind or retried forever.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import sqlalchemy as sa
import torch

from gateway.store import policy_versions, promotion, turns
from gateway.store.policy_versions import SHARED
from gateway.store.readiness import ready_rollouts, stale_rollouts, stale_turns
from gateway.store.training_data import RolloutData, load_rollout, load_turns, turn_trees
from prefix_tree import RolloutTree
from trainer import distributed, lora, ppo, publish, sharding, update
from trainer.advantages import AdvantageResult, batch_advantages, group_advantages, turn_advantages
from trainer.batch import PackedBatch, longest_path
from trainer.config import TrainConfig, resolve_device
from trainer.credit import Credit, CreditTable
from trainer.logprobs import sequence_logprobs
from trainer.plan import StepPlan, StepResult, group_of, served_version

log = logging.getLogger("clawgate.trainer")


def too_long(tokens: int, budget: int) -> str:
    return f"too long: a path of {tokens:,} tokens exceeds --max-tokens-per-bin {budget:,}"


@dataclass(slots=True)
class _Parked:
    """A lineage that is not active: its weights, optimizer and value head, kept until it is activated again."""

    weights: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    critic: ppo.Critic | None
    parent: int


class Trainer:
    """Holds the policy and its optimizer across steps (``clawgate train`` runs one per process), per lineage."""

    def __init__(self, config: TrainConfig, db: sa.Engine, world: distributed.World | None = None) -> None:
        self.config = config
        self.db = db
        # Under torchrun (``distributed.py``): this is rank 0, and the other ranks share each update.
        self.world = world
        # Called as progress(phase, batches done, batches) while a step runs (`clawgate train` draws a bar).
        self.progress: Callable[[str, int, int], None] | None = None
        torch.manual_seed(config.seed)
        device, sharded = resolve_device(config.device), world is not None and world.sharded
        # A base to be sharded stays in host memory: only its shards go to the device (``sharding.shard``).
        base = lora.load_base(config.model, dtype=config.dtype, device="cpu" if sharded else device)
        latest = publish.recover(db, config.adapter_dir)
        # The version whose weights the policy holds: the newest published one, unless guarded promotion rejected
        # it (then the newest not rejected: training goes on from weights that earned their traffic).
        self.parent, path = 0, None
        if latest is None:
            self.policy = lora.new_policy(base, config.lora, gradient_checkpointing=config.gradient_checkpointing)
            self.version = 0
        else:
            self.parent = policy_versions.newest_not_rejected(db) or 0
            path = lora.version_path(config.adapter_dir, self.parent)
            self.policy = lora.load_policy(base, path, gradient_checkpointing=config.gradient_checkpointing)
            self.version = latest
        if sharded:
            sharding.shard(self.policy, device=device, mixed_precision=config.mixed_precision)
        self.critic = self._critic(path)
        if latest is None:
            self._publish(
                lora.Manifest(version=0, base_model=config.model, lora=asdict(config.lora)),
                step=None,
                consumed={},
                metrics={},
            )
        self.policy.train()
        self.optimizer = self._new_optimizer()
        self.lineage = SHARED  # the lineage whose weights the policy holds
        self._parked: dict[str, _Parked] = {}
        self._versions: list[int] = []  # the active lineage's versions, newest first (staleness)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.0)

    def parent_of(self, lineage: str) -> int | None:
        """The version whose weights ``lineage`` holds (None: a lineage not opened yet)."""
        if lineage == self.lineage:
            return self.parent
        parked = self._parked.get(lineage)
        return parked.parent if parked is not None else None

    def activate(self, lineage: str) -> None:
        """Make ``lineage`` the one the policy holds: park the active one's weights, optimizer and value head, and
        bring in ``lineage``'s (opened from its newest version not rejected, or forked from the shared incumbent)."""
        if lineage == self.lineage:
            return
        weights = {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        self._parked[self.lineage] = _Parked(weights, self.optimizer, self.critic, self.parent)
        parked = self._parked.pop(lineage, None)
        if parked is not None:
            with torch.no_grad():
                for name, param in self.policy.named_parameters():
                    if name in parked.weights:
                        param.copy_(parked.weights[name])
            self.optimizer, self.critic, self.parent = parked.optimizer, parked.critic, parked.parent
        else:
            start = policy_versions.newest_not_rejected(self.db, lineage)
            if start is None:  # a new lineage: from the weights the shared policy serves
                incumbent = promotion.read_state(self.db, SHARED).incumbent
                start = incumbent.version if incumbent is not None else policy_versions.newest_not_rejected(self.db)
            self._reload(start or 0)
            self.parent = start or 0
            log.info("lineage %s opened from the weights of policy@v%d", lineage, self.parent)
        self.lineage = lineage

    def _behind(self, served: int) -> int:
        """How many of the active lineage's versions are newer than ``served``."""
        return sum(1 for v in self._versions if v > served)

    def _oldest_ok(self, bound: int) -> int:
        """The oldest version whose data is within ``bound`` versions of the active lineage's newest."""
        return self._versions[bound] if len(self._versions) > bound else 0

    def step(self) -> StepResult | None:
        """One training step, or None when nothing is ready: claim the ready rollouts and turns, build their trees,
        set aside what cannot train (``_screen``), update (GRPO/batch advantages, or PPO with the critic), and publish
        the next version with what it consumed, so that nothing is trained twice."""
        cfg = self.config
        t0 = time.perf_counter()
        started = dt.datetime.now(dt.UTC)
        ids = ready_rollouts(self.db, cfg.epoch, cfg.max_rollouts, self.lineage)
        turn_ids = turns.ready_turns(
            self.db,
            cfg.epoch,
            cfg.max_turns,
            await_judge=cfg.await_judge,
            secrets=cfg.tree.secrets,
            lineage=self.lineage,
        )
        if not ids and not turn_ids:
            return None
        data = self._hold_lonely([d for d in (load_rollout(self.db, i, cfg.tree) for i in ids) if d is not None])
        plan = StepPlan(data, load_turns(self.db, turn_ids))
        if not plan.rollouts and not plan.turns:
            return None
        self._versions = policy_versions.lineage_versions(self.db, self.lineage)
        try:
            self._screen(plan)
            metrics = self._critic_step(plan) if cfg.advantage == "critic" else self._policy_gradient_step(plan)
            metrics.update(plan.figures())
            consumed, consumed_turns = self._consumed(plan)
            metrics["rollouts_skipped"] = float(sum(1 for k in plan.skipped if k in consumed))
            metrics["turns_skipped"] = float(sum(1 for k in plan.skipped if k in consumed_turns))
            metrics["rollouts_stale"] = float(sum(1 for r in plan.skipped.values() if r.startswith("stale")))
            metrics["too_long"] = float(sum(1 for r in plan.skipped.values() if r.startswith("too long")))
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
                    parent_version=self.parent,
                    lineage=self.lineage,
                ),
                step=(started, metrics),
                consumed=consumed,
                consumed_turns=consumed_turns,
                metrics=metrics,
            )
        except Exception:
            # The update is in the policy's weights, but no version holds it (the publish failed: the database went
            # away, or an operator deleted some of this data meanwhile). Back to the last published weights: the
            # data still there is trained once, at the next step, and deleted data never reaches a version. The
            # version's directory, written but not recorded, is set aside so the next step can publish that number.
            self._reload(self.parent)
            with contextlib.suppress(Exception):  # the database may be what failed: the next failure tries again
                publish.recover(self.db, self.config.adapter_dir)
            raise
        self.version = self.parent = version
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
            lineage=self.lineage,
        )

    def _screen(self, plan: StepPlan) -> None:
        """Sort out what cannot train: dropped trees, missing rewards, data beyond the staleness bound."""
        bound, budget = self.config.max_staleness, self.config.max_tokens_per_bin
        for d in plan.rollouts:
            served = served_version(d)
            stale = self._behind(served)
            if d.tree.dropped:
                plan.skipped[d.rollout.id] = f"tree dropped: {d.tree.report.dropped_reason}"
            elif (longest := longest_path(d.tree)) > budget:
                plan.skipped[d.rollout.id] = too_long(longest, budget)
            elif d.reward is None:
                plan.skipped[d.rollout.id] = "no reward"
            elif bound is not None and stale > bound:
                plan.skipped[d.rollout.id] = f"stale: served by policy@v{served}, {stale} versions behind"
            else:
                plan.usable.append(d)
                plan.staleness.append(stale)
        for t in plan.turns:
            served = t.policy_version or 0
            stale = self._behind(served)
            if t.length > budget:
                plan.skipped[t.call_id] = too_long(t.length, budget)
            elif t.reward is None:
                plan.skipped[t.call_id] = "no reward"
            elif bound is not None and stale > bound:
                plan.skipped[t.call_id] = f"stale: served by policy@v{served}, {stale} versions behind"
            else:
                plan.usable_turns.append(t)
                plan.staleness.append(stale)

    def _policy_gradient_step(self, plan: StepPlan) -> dict[str, float]:
        """Advantages from a baseline (GRPO group or batch), then one update with per-token credit."""
        cfg = self.config
        rewards = {d.rollout.id: float(d.reward) for d in plan.usable if d.reward is not None}
        result: AdvantageResult
        if cfg.advantage == "group":
            groups = {d.rollout.id: group_of(d) for d in plan.usable}
            result = group_advantages(
                rewards,
                groups,
                scale_by_std=cfg.scale_by_std,
                baseline=cfg.baseline,  # type: ignore[arg-type]
            )
        else:
            keys = {d.rollout.id: f"rollouts:{d.rollout.harness or 'unknown'}" for d in plan.usable}
            result = batch_advantages(rewards, keys, scale_by_std=cfg.scale_by_std)
        # A turn with a counterfactual group is normalized within it (answers to its own prompt), the rest in the batch.
        turn_result = turn_advantages(
            {t.call_id: t.reward.value for t in plan.usable_turns if t.reward is not None},
            {t.call_id: t.baseline_key for t in plan.usable_turns},
            {t.call_id: t.group.rewards for t in plan.usable_turns if t.group is not None and t.group.has_baseline},
            scale_by_std=cfg.scale_by_std,
        )
        plan.skipped.update(result.skipped)
        plan.skipped.update(turn_result.skipped)
        plan.advantages, plan.turn_advantages = result.advantages, turn_result.advantages
        plan.trained = [d for d in plan.usable if d.rollout.id in plan.advantages]
        plan.trained_turns = [t for t in plan.usable_turns if t.call_id in plan.turn_advantages]
        trees: list[RolloutTree] = [d.tree for d in plan.trained]
        credits: list[Credit] = [plan.advantages[d.rollout.id] for d in plan.trained]
        for _, tree in turn_trees(self.db, plan.trained_turns, cfg.tree.secrets, siblings=True):
            trees.append(tree)
            credits.append(plan.turn_advantages)
        log.info(
            "step from policy@v%d: %d rollouts (%d with signal), %d turns (%d with signal)",
            self.parent,
            len(plan.rollouts),
            len(plan.trained),
            len(plan.turns),
            len(plan.trained_turns),
        )
        return self._optimize(trees, credits) if trees else {}

    def _critic_step(self, plan: StepPlan) -> dict[str, float]:
        """PPO: GAE per branch (rollouts) and per turn (turns) with the value head; every usable item trains."""
        plan.trained, plan.trained_turns = plan.usable, plan.usable_turns
        trees: list[RolloutTree] = [d.tree for d in plan.usable]
        rewards: list[float | dict[str, float]] = [cast(float, d.reward) for d in plan.usable]
        turn_rewards = {t.call_id: t.reward.value for t in plan.usable_turns if t.reward is not None}
        for _, tree in turn_trees(self.db, plan.usable_turns, self.config.tree.secrets):
            trees.append(tree)
            rewards.append(turn_rewards)
        log.info(
            "step from policy@v%d (ppo): %d rollouts, %d turns", self.parent, len(plan.usable), len(plan.usable_turns)
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
            world=self.world,
        )
        plan.advantages = {plan.usable[i].rollout.id: a for i, a in per_tree.items() if i < len(plan.usable)}
        plan.turn_advantages = {t.call_id: per_call.get(t.call_id, 0.0) for t in plan.usable_turns}
        return metrics

    def _consumed(
        self, plan: StepPlan
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
            oldest_ok = self._oldest_ok(cfg.max_staleness)
            for rid, served in stale_rollouts(self.db, cfg.epoch, oldest_ok, lineage=self.lineage).items():
                if rid not in consumed:
                    consumed[rid] = None
                    plan.skipped[rid] = f"stale: served by policy@v{served}, {self._behind(served)} versions behind"
            for cid, (rid, served) in stale_turns(self.db, cfg.epoch, oldest_ok, lineage=self.lineage).items():
                if cid not in consumed_turns:
                    consumed_turns[cid] = (rid, None, None)
                    plan.skipped[cid] = f"stale: served by policy@v{served}, {self._behind(served)} versions behind"
        return consumed, consumed_turns

    def _hold_lonely(self, data: list[RolloutData]) -> list[RolloutData]:
        """Leave out (for a later step) a group's only ready member while it may still get company."""
        wait = self.config.group_wait
        if wait <= 0:
            return data
        sizes: dict[str, int] = {}
        for d in data:
            sizes[group_of(d)] = sizes.get(group_of(d), 0) + 1
        now = dt.datetime.now(dt.UTC)
        kept = []
        for d in data:
            finished = d.rollout.finished_at or d.rollout.updated_at
            if sizes[group_of(d)] == 1 and (now - finished).total_seconds() < wait:
                continue
            kept.append(d)
        return kept

    def _optimize(self, trees: list[RolloutTree], credits: list[Credit]) -> dict[str, float]:
        """One policy-gradient update over ``trees``; each trained token's advantage comes from ``credits``."""
        cfg = self.config
        table = CreditTable(trees, credits)

        def loss(batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logp = sequence_logprobs(self.policy, batch, temperature=cfg.temperature)
            return update.policy_term(logp, batch, table.for_batch(batch), cfg)

        batches = update.pack(trees, cfg)
        if self.world is not None:
            self.world.send(distributed.Work(batches, distributed.UpdateConfig.of(cfg), credits=table))
            self.world.share_weights(self.policy)
        return update.run(self.policy, self.optimizer, batches, loss, progress=self.progress, world=self.world)

    def rollback(self, to: int) -> int:
        """Continue from version ``to``: its weights (and value head) become the policy's, the optimizer starts
        afresh, and they are published as the next version (versions stay immutable and monotonic). Publishing
        also completes the operator's rollback request and releases its pin. Returns the new version."""
        path = lora.version_path(self.config.adapter_dir, to)
        if not path.is_dir():
            raise FileNotFoundError(f"cannot roll back to policy@v{to}: {path} is missing")
        lora.load_weights(self.policy, path)
        if self.critic is not None:
            self.critic = self._critic(path)
        self.optimizer = self._new_optimizer()
        version = self.version + 1
        self._publish(
            lora.Manifest(
                version=version,
                base_model=self.config.model,
                step=version,
                lora=asdict(self.config.lora),
                parent_version=to,
                rolled_back_from=to,
                lineage=self.lineage,
            ),
            step=None,
            consumed={},
            metrics={},
        )
        log.info("rolled back: policy@v%d republishes the weights of policy@v%d; training goes on from it", version, to)
        self.version = self.parent = version
        return version

    def restore(self, to: int) -> None:
        """Go on from version ``to``'s weights (and value head) without publishing: guarded promotion rejected the
        version the policy holds, so the next step trains from the incumbent instead. The optimizer starts afresh
        (its moments belong to the rejected trajectory)."""
        self._reload(to)
        log.info("policy@v%d was rejected: training goes on from the weights of policy@v%d", self.parent, to)
        self.parent = to

    def _reload(self, to: int) -> None:
        """The policy (and value head) back to version ``to``'s weights, with a fresh optimizer."""
        path = lora.version_path(self.config.adapter_dir, to)
        lora.load_weights(self.policy, path)
        if self.critic is not None or self.config.algorithm == "ppo":
            self.critic = self._critic(path)
        self.optimizer = self._new_optimizer()

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
        return publish.record_version(
            self.db,
            manifest,
            path,
            algorithm=self.config.algorithm,
            epoch=self.config.epoch,
            step=step,
            consumed=consumed,
            consumed_turns=consumed_turns or {},
            metrics=metrics,
            gated=self.config.eval_gate,
        )


__all__ = ["Trainer"]
