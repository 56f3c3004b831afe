"""The trainer's command, registered into the `clawgate` parser (``clawgate/cli.py``).

    clawgate train        the trainer daemon: GRPO/PPO steps as rollouts become ready; publishes policy@vN
    clawgate train --once a few steps over what is ready now, then exit
    clawgate adapter export VERSION --out DIR | --merge DIR   a version as a PEFT adapter or a merged model

``train_flags`` and ``train_config`` are also what `clawgate up` starts its trainer child with.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.logs import setup_logging
from gateway.settings import Settings, from_flags

if TYPE_CHECKING:
    import sqlalchemy as sa

    from trainer import distributed
    from trainer.config import TrainConfig
    from trainer.eval_gate import EvalGate
    from trainer.step import Trainer

# Exit code of `clawgate train` when another trainer holds the adapter directory (a supervisor must not restart it).
TRAINER_BUSY = 3

# The trainer's flags that are settings, by their Settings field names.
TRAIN_FLAGS = (
    "adapter_dir",
    "train_algorithm",
    "train_lr",
    "train_min_rollouts",
    "train_min_groups",
    "train_interval",
    "train_max_rollouts",
    "train_max_turns",
    "train_max_tokens_per_bin",
    "train_max_staleness",
    "train_group_wait",
    "train_temperature",
    "train_device",
    "train_threads",
    "train_dtype",
    "train_gradient_checkpointing",
    "train_lora_rank",
    "train_lora_alpha",
    "train_seed",
    "train_advantage",
    "train_min_turns",
    "train_await_judge",
    "train_metrics_port",
    "train_log_to",
    "train_log_dir",
    "eval_gate_tasks",
    "eval_gate_harness",
    "eval_gate_n",
    "secrets",
)
# What `clawgate train` builds its settings from.
TRAIN_SETTINGS = (
    "model",
    "database_url",
    "log_level",
    "data_dir",
    "gateway_url",
    "promotion_margin",
    "train_shard",
    "train_mixed_precision",
    *TRAIN_FLAGS,
)


def train_flags(p: argparse.ArgumentParser) -> None:
    """Trainer flags, shared by `train` and `up`; each defaults to its CLAWGATE_TRAIN_* setting."""
    g = p.add_argument_group("training")
    g.add_argument("--adapter-dir", help="where policy@vN versions go (CLAWGATE_ADAPTER_DIR)")
    g.add_argument("--algorithm", dest="train_algorithm", choices=["grpo", "ppo"], help="(CLAWGATE_TRAIN_ALGORITHM)")
    g.add_argument("--lr", dest="train_lr", type=float, help="learning rate (CLAWGATE_TRAIN_LR, default 1e-5)")
    _schedule_flags(g)
    _runtime_flags(g)
    g.add_argument(
        "--advantage",
        dest="train_advantage",
        choices=["group", "batch", "critic"],
        help="group: GRPO for task runs, a batch baseline for everyday turns (default); batch: a batch baseline "
        "for both; critic: PPO's value head (CLAWGATE_TRAIN_ADVANTAGE)",
    )
    g.add_argument(
        "--min-turns",
        dest="train_min_turns",
        type=int,
        help="ready turns of everyday traffic a step waits for (a turn with a scored counterfactual group counts its "
        "answers)",
    )
    g.add_argument(
        "--await-judge",
        dest="train_await_judge",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turns wait for the judge's verdict (default: when a judge model or reward function is set)",
    )
    g.add_argument(
        "--metrics-port",
        dest="train_metrics_port",
        type=int,
        help="serve the trainer's Prometheus metrics on this port (CLAWGATE_TRAIN_METRICS_PORT)",
    )
    g.add_argument(
        "--log-to",
        dest="train_log_to",
        help="also log every step to tensorboard and/or wandb, comma-separated (CLAWGATE_TRAIN_LOG_TO)",
    )
    g.add_argument(
        "--log-dir", dest="train_log_dir", help="where those logs go (CLAWGATE_TRAIN_LOG_DIR, default .clawgate/runs)"
    )
    _eval_gate_flags(p)


def _schedule_flags(g: argparse._ArgumentGroup) -> None:
    """When a step runs and what goes into it."""
    g.add_argument(
        "--min-rollouts", dest="train_min_rollouts", type=int, help="ready rollouts a step waits for (default 8)"
    )
    g.add_argument(
        "--min-groups", dest="train_min_groups", type=int, help="groups of 2+ ready rollouts a step waits for"
    )
    g.add_argument("--interval", dest="train_interval", type=float, help="seconds between looks when idle")
    g.add_argument("--max-rollouts", dest="train_max_rollouts", type=int, help="rollouts of task runs per step at most")
    g.add_argument(
        "--max-turns",
        dest="train_max_turns",
        type=int,
        help="turns of everyday traffic per step at most (counted as for --min-turns)",
    )
    g.add_argument(
        "--max-tokens-per-bin",
        "--max-tokens-per-rank",
        dest="train_max_tokens_per_bin",
        type=int,
        help="tokens per packed micro-batch, one forward pass of one rank: what bounds a rank's activation memory; "
        "a longer sequence is skipped and counted (CLAWGATE_TRAIN_MAX_TOKENS_PER_BIN, default 16384)",
    )
    g.add_argument(
        "--max-staleness", dest="train_max_staleness", type=int, help="skip rollouts served this many versions back"
    )
    g.add_argument(
        "--group-wait", dest="train_group_wait", type=float, help="seconds a lone rollout waits for its group"
    )
    g.add_argument("--temperature", dest="train_temperature", type=float, help="temperature rollouts were sampled at")


def _runtime_flags(g: argparse._ArgumentGroup) -> None:
    """Where and how the trainer computes: device, threads, precision, LoRA shape, seed."""
    g.add_argument("--device", dest="train_device", help="auto, cpu, cuda, cuda:1 ... (CLAWGATE_TRAIN_DEVICE)")
    g.add_argument(
        "--threads", dest="train_threads", type=int, help="torch CPU threads (CLAWGATE_TRAIN_THREADS, default: all)"
    )
    g.add_argument("--dtype", dest="train_dtype", choices=["float32", "bfloat16"], help="(CLAWGATE_TRAIN_DTYPE)")
    g.add_argument(
        "--gradient-checkpointing",
        "--activation-checkpointing",
        dest="train_gradient_checkpointing",
        action="store_true",
        default=None,
        help="recompute activations in the backward pass (less memory)",
    )
    g.add_argument("--lora-rank", dest="train_lora_rank", type=int, help="(CLAWGATE_TRAIN_LORA_RANK)")
    g.add_argument("--lora-alpha", dest="train_lora_alpha", type=int, help="(CLAWGATE_TRAIN_LORA_ALPHA)")
    g.add_argument("--seed", dest="train_seed", type=int, help="(CLAWGATE_TRAIN_SEED)")


def _eval_gate_flags(p: argparse.ArgumentParser) -> None:
    """The held-out evaluation a new version passes before its canary."""
    e = p.add_argument_group("evaluation gate (guarded promotion)")
    e.add_argument(
        "--eval-tasks",
        dest="eval_gate_tasks",
        help="held-out tasks (JSONL) each new version must not regress on before its canary (CLAWGATE_EVAL_GATE_TASKS)",
    )
    e.add_argument("--eval-harness", dest="eval_gate_harness", help="harnesses for them (default builtin)")
    e.add_argument("--eval-n", dest="eval_gate_n", type=int, help="rollouts per task × harness and version (default 1)")


def train_config(settings: Settings, *, once: bool = False) -> TrainConfig:
    from prefix_tree import TreeConfig
    from trainer import lora
    from trainer.config import TrainConfig, Trigger

    config = TrainConfig(
        model=settings.model,
        database_url=settings.database_url,
        adapter_dir=Path(settings.adapter_dir),
        lr=settings.train_lr,
        lora=lora.LoraSettings(rank=settings.train_lora_rank, alpha=settings.train_lora_alpha),
        temperature=settings.train_temperature,
        max_rollouts=settings.train_max_rollouts,
        max_turns=settings.train_max_turns,
        max_tokens_per_bin=settings.train_max_tokens_per_bin,
        max_staleness=settings.train_max_staleness,
        # A one-shot run consumes a lone group member at once; the daemon lets it wait for its group.
        group_wait=0.0 if once else settings.train_group_wait,
        trigger=Trigger(
            min_rollouts=settings.train_min_rollouts,
            min_groups=settings.train_min_groups,
            min_turns=settings.train_min_turns,
            interval=settings.train_interval,
        ),
        dtype=settings.train_dtype,
        seed=settings.train_seed,
        algorithm=settings.train_algorithm,
        device=settings.train_device,
        gradient_checkpointing=settings.train_gradient_checkpointing,
        advantage=settings.train_advantage,  # TrainConfig settles algorithm and advantage together
        await_judge=settings.awaits_judge,
        tree=TreeConfig(secrets=settings.secrets),
    )
    return config


def cmd_train(args: argparse.Namespace) -> int:
    from trainer import distributed
    from trainer.config import resolve_device

    settings = from_flags(args, TRAIN_SETTINGS)
    setup_logging(settings.log_level)
    if settings.train_threads is not None:
        import torch

        torch.set_num_threads(settings.train_threads)
        print(f"training with {settings.train_threads} CPU thread(s)", file=sys.stderr, flush=True)
    config = train_config(settings, once=args.once)
    config.trigger.max_steps = args.max_steps
    if settings.train_mixed_precision != "no" and not settings.train_shard:
        print("error: --mixed-precision applies to a sharded base: add --shard", file=sys.stderr)
        return 2
    config.shard, config.mixed_precision = settings.train_shard, settings.train_mixed_precision
    world = distributed.from_env(resolve_device(config.device), shard=config.shard)
    if world is None:
        return _train_main(args, settings, config, None)
    code = _serve_rank(world, config) if not world.main else _train_rank_0(args, settings, config, world)
    distributed.exit_rank(code)


def _train_rank_0(args: argparse.Namespace, settings: Settings, config: TrainConfig, world: distributed.World) -> int:
    """Rank 0 under torchrun: the trainer, then the other ranks told to stop and the group closed."""
    from trainer import distributed

    lost = False
    try:
        return _train_main(args, settings, config, world)
    except distributed.WorldLost as exc:
        lost = True
        print(f"error: {exc}; nothing was published from the step it interrupted", file=sys.stderr, flush=True)
        return 1
    finally:
        if not lost:
            with contextlib.suppress(distributed.WorldLost):
                world.send(None)  # the other ranks stop
        distributed.close(world)


def _train_main(
    args: argparse.Namespace, settings: Settings, config: TrainConfig, world: distributed.World | None
) -> int:
    """The trainer proper (rank 0 under torchrun): the adapter directory's lock, the database, the steps."""
    from gateway.store import db
    from trainer.progress import StepProgress
    from trainer.publish import TrainerBusy, TrainerLock
    from trainer.step import Trainer

    gate: EvalGate | None = None
    if settings.eval_gate_tasks is not None and not args.once:
        try:
            gate = _eval_gate(settings)
        except ValueError as exc:  # TaskFileError is one
            print(f"error: {exc}", file=sys.stderr)
            return 2
        config.eval_gate = True
        print(
            f"evaluation gate: {len(gate.config.tasks)} tasks × {settings.eval_gate_harness} × {settings.eval_gate_n} "
            f"on each new version and the incumbent through {gate.config.gateway_url} (under guarded promotion)",
            file=sys.stderr,
            flush=True,
        )
    database = db.connect(settings.database_url)
    lock = TrainerLock(config.adapter_dir)
    try:
        lock.acquire()
    except TrainerBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        database.dispose()
        return TRAINER_BUSY
    try:
        trainer = Trainer(config, database, world)
        trainer.progress = StepProgress()
        where = "" if world is None else f" (rank 0 of {world.size})"
        print(f"policy@v{trainer.version} loaded from {config.adapter_dir}{where}", file=sys.stderr, flush=True)
        if args.once:
            return _train_once(trainer, args)
        return _train_daemon(trainer, settings, database, gate)
    finally:
        lock.release()
        database.dispose()


def _serve_rank(world: distributed.World, config: Any) -> int:
    """A rank other than 0 under torchrun: the base model and a LoRA of the same shape, whose weights come from
    rank 0 at every update; no database, no adapter directory (``distributed.py``)."""
    from trainer import distributed, lora, sharding
    from trainer.config import resolve_device

    print(f"rank {world.rank}/{world.size}: computing gradients for rank 0", file=sys.stderr, flush=True)
    device = resolve_device(config.device)
    base = lora.load_base(config.model, dtype=config.dtype, device="cpu" if world.sharded else device)
    policy = lora.new_policy(base, config.lora, gradient_checkpointing=config.gradient_checkpointing)
    if world.sharded:  # only this rank's shards go to the device
        sharding.shard(policy, device=device, mixed_precision=config.mixed_precision)
    try:
        served = distributed.serve(world, policy)
    except distributed.WorldLost as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        distributed.close(world)
    print(f"rank {world.rank}/{world.size}: {served} updates", file=sys.stderr, flush=True)
    return 0


def _eval_gate(settings: Settings) -> EvalGate:
    """The evaluation gate of ``settings.eval_gate_tasks``; raises ValueError when the tasks cannot be read."""
    from trainer import eval_gate

    return eval_gate.build(
        str(settings.eval_gate_tasks),
        settings.eval_gate_harness,
        n=settings.eval_gate_n,
        gateway_url=settings.gateway_url,
        admin_key=settings.admin_key.get_secret_value() if settings.admin_key is not None else None,
        margin=settings.promotion_margin,
    )


def _train_once(trainer: Trainer, args: argparse.Namespace) -> int:
    """`train --once`: up to ``--steps`` steps over what is ready now; exit 1 when none ran (unless allowed)."""
    from trainer import loop
    from trainer.plan import describe

    # --once trains on whatever is ready, unless a minimum is given: then, as for the daemon, only when it is met.
    minimums = (args.train_min_rollouts, args.train_min_groups, args.train_min_turns)
    once_minimums = any(m is not None for m in minimums)
    done = 0
    for i in range(args.steps):
        go, why = loop.should_step(trainer, waited=False) if once_minimums else (True, "")
        result = trainer.step() if go else None
        if result is None:
            print(f"[{i + 1}/{args.steps}] nothing to train on ({why or 'nothing ready'})", file=sys.stderr)
            break
        done += 1
        print(f"[{i + 1}/{args.steps}] {describe(result)}", flush=True)
    return 0 if done or args.allow_empty else 1


def _train_daemon(trainer: Trainer, settings: Settings, database: sa.Engine, gate: EvalGate | None) -> int:
    """The daemon: steps whenever the trigger is met, until SIGTERM."""
    import threading

    from trainer import loop
    from trainer.plan import describe

    config = trainer.config
    stop = threading.Event()
    # The daemon: SIGTERM (docker stop, `clawgate up` shutting down) ends it between steps; a kill during a
    # step is safe as well (nothing is recorded until the step commits).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cfg = config.trigger
    print(
        f"training when {cfg.min_rollouts} rollouts in {cfg.min_groups} groups, or {cfg.min_turns} turns "
        f"of everyday traffic{' (judged)' if config.await_judge else ''}, are ready "
        f"(looking every {cfg.interval:g}s)",
        file=sys.stderr,
        flush=True,
    )
    metrics = _telemetry(settings, database)

    def on_step(result: Any) -> None:
        print(describe(result), flush=True)
        metrics.step(result)

    try:
        loop.run(
            trainer,
            stop=stop,
            on_step=on_step,
            on_wait=lambda msg: print(msg, file=sys.stderr, flush=True),
            on_failure=metrics.failure,
            gate=gate,
        )
    finally:
        metrics.close()
    return 0


def _telemetry(settings: Settings, database: sa.Engine) -> Any:
    from gateway.store.readiness import readiness
    from gateway.store.turns import backlog
    from trainer import telemetry

    def ready() -> tuple[int, int]:
        return (
            readiness(database, 0).rollouts,
            backlog(database, 0, await_judge=settings.awaits_judge).ready,
        )

    log_dir = settings.train_log_dir or settings.data_dir / "runs"
    built = telemetry.build(
        metrics_port=settings.train_metrics_port,
        log_to=telemetry.parse_log_to(settings.train_log_to),
        log_dir=Path(log_dir),
        config={"model": settings.model, "algorithm": settings.train_algorithm, "lr": settings.train_lr},
        backlog=ready,
    )
    if settings.train_metrics_port is not None:
        print(f"trainer metrics on :{settings.train_metrics_port}/metrics", file=sys.stderr, flush=True)
    return built


def cmd_adapter(args: argparse.Namespace) -> int:
    from trainer import export

    settings = from_flags(args, ("adapter_dir", "log_level"))
    if (args.out is None) == (args.merge is None):
        print("error: `clawgate adapter export` needs one of --out DIR (the adapter) or --merge DIR", file=sys.stderr)
        return 2
    try:
        if args.merge is not None:
            path = export.merge(settings.adapter_dir, args.version, Path(args.merge), base_model=args.model)
            print(f"policy@v{args.version} merged into its base model: {path}")
        else:
            path = export.copy_adapter(settings.adapter_dir, args.version, Path(args.out))
            print(f"policy@v{args.version} (PEFT LoRA adapter): {path}")
    except (FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train` and `adapter` to the `clawgate` parser."""
    adapter = sub.add_parser("adapter", help="policy versions outside clawgate: export an adapter or a merged model")
    adapter.add_argument("action", choices=["export"])
    adapter.add_argument("version", type=int, help="the policy version (policy@vN)")
    adapter.add_argument("--out", help="copy the PEFT adapter into this new directory")
    adapter.add_argument("--merge", help="write a merged Hugging Face model (LoRA folded in) into this new directory")
    adapter.add_argument("--model", help="the base model (default: the one in the version's manifest)")
    adapter.add_argument("--adapter-dir", help="where policy@vN versions are (CLAWGATE_ADAPTER_DIR)")
    adapter.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    adapter.set_defaults(func=cmd_adapter)

    train = sub.add_parser("train", help="the trainer daemon (GRPO/PPO steps as rollouts become ready)")
    train.add_argument("--once", action="store_true", help="run --steps steps over what is ready now and exit")
    train.add_argument("--steps", type=int, default=1, help="with --once: steps to run")
    train.add_argument("--max-steps", type=int, help="daemon: exit after this many steps")
    train.add_argument("--model", help="base model (CLAWGATE_MODEL)")
    train.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    train.add_argument("--allow-empty", action="store_true", help="with --once: exit 0 when nothing was ready")
    train.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    train.add_argument(
        "--secrets",
        choices=["exclude", "mask", "drop", "off"],
        help="an answer holding a credential: not trained (exclude, default), trained without the credential's "
        "tokens (mask), or trained (off); drop: no call whose tokens held one trains (CLAWGATE_SECRETS)",
    )
    train_flags(train)
    _distributed_flags(train)
    train.set_defaults(func=cmd_train)


def _distributed_flags(p: argparse.ArgumentParser) -> None:
    """Under torchrun (``trainer/distributed.py``): how the ranks hold the base model."""
    d = p.add_argument_group("under torchrun")
    d.add_argument(
        "--shard",
        dest="train_shard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard the frozen base over the ranks (FSDP2): each holds 1/WORLD_SIZE of its weights "
        "(CLAWGATE_TRAIN_SHARD)",
    )
    d.add_argument(
        "--mixed-precision",
        dest="train_mixed_precision",
        choices=["no", "bf16"],
        help="with --shard: compute in bfloat16 (GPUs); no: in the dtype the base was loaded in "
        "(CLAWGATE_TRAIN_MIXED_PRECISION, default no)",
    )


__all__ = ["TRAINER_BUSY", "TRAIN_FLAGS", "cmd_adapter", "cmd_train", "register", "train_config", "train_flags"]
