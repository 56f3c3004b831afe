"""The `clawgate` command.

    clawgate serve        run the gateway (engine: local in-process model, or a vLLM server)
    clawgate up           embedded mode: migrate the database, build the tiny model if needed, serve
    clawgate db upgrade   bring the database schema to the newest migration (also: downgrade, current)
    clawgate tree ID      print a rollout's reconstructed prefix tree
    clawgate export       rollouts with calls, rewards and trees as JSONL
    clawgate train        the trainer daemon: GRPO/PPO steps as rollouts become ready; publishes policy@vN
    clawgate judge        the reward worker: scores turns of everyday traffic with an LLM judge / reward functions
    clawgate turns        turns of everyday traffic with their next state, rewards and judge reasons
    clawgate rollout      run a task set through agent harnesses in sandboxes, verify, post rewards
    clawgate tiny-model   build the small local test model

Every flag has a ``CLAWGATE_*`` environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gateway.settings import DEFAULT_DATA_DIR, Settings

log = logging.getLogger("clawgate")


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["local", "vllm"], help="serving engine (CLAWGATE_ENGINE)")
    p.add_argument("--model", help="model folder or hub id; tokenizer and chat template come from it (CLAWGATE_MODEL)")
    p.add_argument("--served-model-name", help="name clients send as `model` (CLAWGATE_SERVED_MODEL_NAME)")
    p.add_argument("--vllm-url", help="vLLM server URL for --engine vllm (CLAWGATE_VLLM_URL)")
    p.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    p.add_argument("--host", help="bind address (CLAWGATE_HOST)")
    p.add_argument("--port", type=int, help="port (CLAWGATE_PORT)")
    p.add_argument("--max-tokens", type=int, help="server-side generation cap (CLAWGATE_MAX_TOKENS)")
    p.add_argument("--log-level", help="debug, info, warning (CLAWGATE_LOG_LEVEL)")
    p.add_argument(
        "--tool-error-reward",
        type=float,
        help="reward of a turn whose tool results report a failure; 0 turns the rule off (CLAWGATE_TOOL_ERROR_REWARD)",
    )


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for name in (
        "engine",
        "model",
        "served_model_name",
        "vllm_url",
        "database_url",
        "host",
        "port",
        "max_tokens",
        "log_level",
        "adapter_dir",
        "tool_error_reward",
        *TRAIN_FLAGS,
        *JUDGE_FLAGS,
    ):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: one line per engine call would drown everything else; alembic a dozen lines
    # of plugin set-up each time the schema version is checked.
    for name in ("httpx", "alembic"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level)
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully: exit 0 (a clean stop), not -15.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return _serve(settings)


def _serve(settings: Settings) -> int:
    import uvicorn

    from gateway.app import build_app, redact_url
    from gateway.store import db

    current, head = db.current_revision(settings.database_url), db.head_revision()
    if current != head:
        print(
            f"error: the database schema is at {current or 'nothing'}, expected {head}: run `clawgate db upgrade` "
            f"(database {redact_url(settings.database_url)})",
            file=sys.stderr,
        )
        return 2

    app = build_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        # SIGTERM: stop accepting, let calls in flight finish (at most this long), then drain the capture writer.
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    return 0


# `clawgate up` on the built-in tiny model, unless --max-tokens says otherwise.
TINY_MODEL_MAX_TOKENS = 4096


def cmd_up(args: argparse.Namespace) -> int:
    """Embedded mode: migrate, build the tiny model if needed, start the trainer (a supervised child process,
    so training never holds the serving process's GIL) and a managed vLLM server when asked, then serve."""
    from gateway.store import db
    from gateway.supervise import ChildProcess

    settings = _settings(args)
    _setup_logging(settings.log_level)
    model_dir = Path(settings.model)
    tiny = model_dir.resolve() == (DEFAULT_DATA_DIR / "tiny-model").resolve()
    if tiny and not model_dir.exists():
        _build_tiny(model_dir)
    if tiny and settings.max_tokens is None:
        # The built-in model writes random text and never ends its turn: without a cap every answer would run to
        # the context window (40,960 tokens). A real model needs no cap.
        settings = settings.model_copy(update={"max_tokens": TINY_MODEL_MAX_TOKENS})
        print(f"the built-in tiny model's answers are capped at {TINY_MODEL_MAX_TOKENS} tokens", file=sys.stderr)
    local_path = settings.model.startswith((".", "/", "~"))
    if not tiny and settings.engine == "local" and not model_dir.exists() and local_path:
        print(f"error: model folder {model_dir} does not exist", file=sys.stderr)
        return 2
    print(f"migrating {settings.database_url} ...", file=sys.stderr)
    db.upgrade(settings.database_url)
    vllm = None
    if settings.engine == "vllm" and "vllm_url" not in settings.model_fields_set:
        vllm = _start_vllm(settings)
        if vllm is None:
            return 2
        settings = settings.model_copy(update={"vllm_url": vllm.url})
    children = []
    if not args.no_train:
        children.append(ChildProcess(settings, "train"))
    if settings.reward_worker_enabled:
        children.append(ChildProcess(settings, "judge"))
    # uvicorn re-raises the SIGTERM it handled once it has shut down; ending with SystemExit instead lets the
    # `finally` below stop the workers and vLLM (a bare re-raised SIGTERM would orphan them).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for child in children:
            child.start()
        return _serve(settings)
    finally:
        for child in children:
            child.stop()
        if vllm is not None:
            vllm.stop()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _start_vllm(settings: Settings) -> Any:
    from gateway.engines.vllm_server import VLLMServer, VLLMServerError, find_vllm_python

    python = find_vllm_python(settings.vllm_python)
    if python is None:
        print(
            "error: --engine vllm without --vllm-url starts a vLLM server, but none is installed: run "
            "`./dev setup-vllm` (CPU) or `pip install 'clawgate[vllm]'` (GPU), set CLAWGATE_VLLM_PYTHON to the "
            "interpreter of a vLLM install, or pass --vllm-url of a running server",
            file=sys.stderr,
        )
        return None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(
        python,
        settings.model,
        served_model_name=settings.vllm_model or settings.model,
        max_lora_rank=max(settings.train_lora_rank, 8),
        max_loras=settings.policy_keep_loaded + 1,
        log_path=settings.data_dir / "vllm.log",
    )
    print(f"starting vLLM ({' '.join(server.command()[1:4])} ...), log in {server.log_path}", file=sys.stderr)
    try:
        server.start(timeout=900)
    except VLLMServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    print(f"vLLM ready on {server.url} after {server.startup_seconds:.0f}s", file=sys.stderr)
    return server


def cmd_db(args: argparse.Namespace) -> int:
    from gateway.store import db

    url = _db_url(args)
    if args.action == "upgrade":
        db.upgrade(url, args.revision or "head")
        print(f"database at {db.current_revision(url)}")
    elif args.action == "downgrade":
        if not args.revision:
            print("error: downgrade needs a revision (e.g. base)", file=sys.stderr)
            return 2
        db.downgrade(url, args.revision)
        print(f"database at {db.current_revision(url) or 'base'}")
    else:
        print(db.current_revision(url) or "base")
    return 0


def _build_tiny(out: Path, seed: int = 0) -> None:
    from gateway.tiny_model import build_tiny_model

    t0 = time.perf_counter()
    print(f"building tiny model in {out} ...", file=sys.stderr)
    build_tiny_model(out, seed=seed, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    print(f"built {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"error: {out} exists and is not empty (use --force to rebuild)", file=sys.stderr)
        return 2
    _build_tiny(out, seed=args.seed)
    return 0


def _db_url(args: argparse.Namespace) -> str:
    return args.database_url or Settings().database_url


def _tree_config(args: argparse.Namespace) -> Any:
    from prefix_tree.filters import TreeConfig

    return TreeConfig(
        drop_dead_leaves=not args.keep_dead_leaves,
        drop_compaction=not args.keep_compaction,
        keep_subagents=args.keep_subagents,
        max_leaves=args.max_leaves if args.max_leaves > 0 else None,
    )


def _tree_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-dead-leaves", action="store_true", help="keep abandoned retries trainable")
    p.add_argument("--keep-compaction", action="store_true", help="keep context-compaction branches")
    p.add_argument("--keep-subagents", action="store_true", help="keep sub-agent calls as separate trajectories")
    p.add_argument("--max-leaves", type=int, default=8, help="drop rollouts with more leaves (0: no limit)")


def cmd_tree(args: argparse.Namespace) -> int:
    import json

    from gateway.store import db
    from gateway.store.training_data import load_rollout

    engine = db.make_engine(_db_url(args))
    try:
        data = load_rollout(engine, args.rollout_id, _tree_config(args))
    finally:
        engine.dispose()
    if data is None:
        print(f"error: rollout {args.rollout_id!r} not found", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rollout_id": args.rollout_id, "reward": data.reward, **data.tree.to_json()}, indent=2))
    else:
        r = data.rollout
        print(f"rollout {r.id}  task={r.task_id}  harness={r.harness}  status={r.status}  reward={data.reward}")
        print(data.tree.render_text(max_lines=args.max_lines))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Rollouts with their calls, rewards and trees as JSON lines."""
    import json

    from gateway import rollouts
    from gateway.store import db
    from gateway.store.training_data import load_rollout, rollout_ids

    engine = db.make_engine(_db_url(args))
    out = open(args.out, "w", encoding="utf-8") if args.out != "-" else sys.stdout  # noqa: SIM115
    try:
        ids = rollout_ids(engine, status=args.status, limit=args.limit)
        for n, rollout_id in enumerate(ids, 1):
            record = rollouts.detail(engine, rollout_id, with_tokens=not args.no_tokens)
            data = load_rollout(engine, rollout_id, _tree_config(args))
            if data is not None:
                record["tree"] = data.tree.to_json(include_tokens=not args.no_tokens)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            if args.out != "-" and (n % 50 == 0 or n == len(ids)):
                print(f"exported {n}/{len(ids)} rollouts", file=sys.stderr)
    finally:
        if out is not sys.stdout:
            out.close()
        engine.dispose()
    return 0


TRAIN_FLAGS = (
    "train_algorithm",
    "train_lr",
    "train_min_rollouts",
    "train_min_groups",
    "train_interval",
    "train_max_rollouts",
    "train_max_staleness",
    "train_group_wait",
    "train_temperature",
    "train_device",
    "train_dtype",
    "train_gradient_checkpointing",
    "train_lora_rank",
    "train_lora_alpha",
    "train_seed",
    "train_advantage",
    "train_min_turns",
    "train_await_judge",
)
JUDGE_FLAGS = (
    "judge_model",
    "judge_api_base",
    "judge_api_key_env",
    "judge_rubric",
    "judge_concurrency",
    "judge_timeout",
    "reward_functions",
)


def _train_flags(p: argparse.ArgumentParser) -> None:
    """Trainer flags, shared by `train` and `up`; each defaults to its CLAWGATE_TRAIN_* setting."""
    g = p.add_argument_group("training")
    g.add_argument("--adapter-dir", help="where policy@vN versions go (CLAWGATE_ADAPTER_DIR)")
    g.add_argument("--algorithm", dest="train_algorithm", choices=["grpo", "ppo"], help="(CLAWGATE_TRAIN_ALGORITHM)")
    g.add_argument("--lr", dest="train_lr", type=float, help="learning rate (CLAWGATE_TRAIN_LR, default 1e-5)")
    g.add_argument(
        "--min-rollouts", dest="train_min_rollouts", type=int, help="ready rollouts a step waits for (default 8)"
    )
    g.add_argument(
        "--min-groups", dest="train_min_groups", type=int, help="groups of 2+ ready rollouts a step waits for"
    )
    g.add_argument("--interval", dest="train_interval", type=float, help="seconds between looks when idle")
    g.add_argument("--max-rollouts", dest="train_max_rollouts", type=int, help="rollouts (and turns) per step at most")
    g.add_argument(
        "--max-staleness", dest="train_max_staleness", type=int, help="skip rollouts served this many versions back"
    )
    g.add_argument(
        "--group-wait", dest="train_group_wait", type=float, help="seconds a lone rollout waits for its group"
    )
    g.add_argument("--temperature", dest="train_temperature", type=float, help="temperature rollouts were sampled at")
    g.add_argument("--device", dest="train_device", help="auto, cpu, cuda, cuda:1 ... (CLAWGATE_TRAIN_DEVICE)")
    g.add_argument("--dtype", dest="train_dtype", choices=["float32", "bfloat16"], help="(CLAWGATE_TRAIN_DTYPE)")
    g.add_argument(
        "--gradient-checkpointing",
        dest="train_gradient_checkpointing",
        action="store_true",
        default=None,
        help="recompute activations in the backward pass (less memory)",
    )
    g.add_argument("--lora-rank", dest="train_lora_rank", type=int, help="(CLAWGATE_TRAIN_LORA_RANK)")
    g.add_argument("--lora-alpha", dest="train_lora_alpha", type=int, help="(CLAWGATE_TRAIN_LORA_ALPHA)")
    g.add_argument("--seed", dest="train_seed", type=int, help="(CLAWGATE_TRAIN_SEED)")
    g.add_argument(
        "--advantage",
        dest="train_advantage",
        choices=["group", "batch", "critic"],
        help="group: GRPO for task runs, a batch baseline for everyday turns (default); batch: a batch baseline "
        "for both; critic: PPO's value head (CLAWGATE_TRAIN_ADVANTAGE)",
    )
    g.add_argument(
        "--min-turns", dest="train_min_turns", type=int, help="ready turns of everyday traffic a step waits for"
    )
    g.add_argument(
        "--await-judge",
        dest="train_await_judge",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turns wait for the judge's verdict (default: when a judge model or reward function is set)",
    )


def _judge_flags(p: argparse.ArgumentParser) -> None:
    """Reward-worker flags, shared by `judge` and `up`; each defaults to its CLAWGATE_JUDGE_* setting."""
    g = p.add_argument_group("rewards for everyday traffic")
    g.add_argument(
        "--judge-model", help="LiteLLM model string of the judge, e.g. openai/gpt-4o-mini (CLAWGATE_JUDGE_MODEL)"
    )
    g.add_argument(
        "--judge-api-base", help="the judge's API base URL, for self-hosted models (CLAWGATE_JUDGE_API_BASE)"
    )
    g.add_argument(
        "--judge-api-key-env", help="name of the env var holding the judge's API key (CLAWGATE_JUDGE_API_KEY_ENV)"
    )
    g.add_argument("--judge-rubric", type=Path, help="a file with the judge's instructions (CLAWGATE_JUDGE_RUBRIC)")
    g.add_argument("--judge-concurrency", type=int, help="judge calls at once (CLAWGATE_JUDGE_CONCURRENCY, default 4)")
    g.add_argument("--judge-timeout", type=float, help="seconds per judge call (CLAWGATE_JUDGE_TIMEOUT, default 60)")
    g.add_argument(
        "--reward-fn",
        dest="reward_functions",
        action="append",
        help="a reward function module:function or file.py:function, called per turn (repeatable; "
        "CLAWGATE_REWARD_FUNCTIONS, comma-separated)",
    )


def _train_settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for name in ("model", "database_url", "adapter_dir", "log_level", *TRAIN_FLAGS, *JUDGE_FLAGS):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def train_config(settings: Settings, *, once: bool = False) -> Any:
    from trainer import lora
    from trainer.config import TrainConfig

    config = TrainConfig(
        model=settings.model,
        database_url=settings.database_url,
        adapter_dir=Path(settings.adapter_dir),
        lr=settings.train_lr,
        lora=lora.LoraSettings(rank=settings.train_lora_rank, alpha=settings.train_lora_alpha),
        temperature=settings.train_temperature,
        max_rollouts=settings.train_max_rollouts,
        # A one-shot run trains on whatever is ready; the daemon waits for its trigger (loop.py).
        min_rollouts=1,
        max_staleness=settings.train_max_staleness,
        group_wait=0.0 if once else settings.train_group_wait,
        dtype=settings.train_dtype,
        seed=settings.train_seed,
        algorithm=settings.train_algorithm,
        device=settings.train_device,
        gradient_checkpointing=settings.train_gradient_checkpointing,
        advantage="critic" if settings.train_algorithm == "ppo" else settings.train_advantage,
        await_judge=settings.awaits_judge,
    )
    return config


def cmd_train(args: argparse.Namespace) -> int:
    import threading

    from gateway.store import db
    from trainer import loop
    from trainer.plan import describe
    from trainer.progress import StepProgress
    from trainer.publish import TrainerBusy, TrainerLock
    from trainer.step import Trainer

    settings = _train_settings(args)
    _setup_logging(settings.log_level)
    config = train_config(settings, once=args.once)
    if args.once and args.train_min_rollouts is not None:
        config.min_rollouts = args.train_min_rollouts
    engine = db.make_engine(settings.database_url)
    lock = TrainerLock(config.adapter_dir)
    try:
        lock.acquire()
    except TrainerBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        engine.dispose()
        return 3
    stop = threading.Event()
    try:
        trainer = Trainer(config, engine)
        trainer.progress = StepProgress()
        print(f"policy@v{trainer.version} loaded from {config.adapter_dir}", file=sys.stderr, flush=True)
        if args.once:
            done = 0
            for i in range(args.steps):
                result = trainer.step()
                if result is None:
                    print(f"[{i + 1}/{args.steps}] no ready rollouts (need {config.min_rollouts})", file=sys.stderr)
                    break
                done += 1
                print(f"[{i + 1}/{args.steps}] {describe(result)}", flush=True)
            return 0 if done or args.allow_empty else 1
        # The daemon: SIGTERM (docker stop, `clawgate up` shutting down) ends it between steps; a kill during a
        # step is safe as well (nothing is recorded until the step commits).
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        cfg = loop.LoopConfig(
            min_rollouts=settings.train_min_rollouts,
            min_groups=settings.train_min_groups,
            min_turns=settings.train_min_turns,
            interval=settings.train_interval,
            group_wait=settings.train_group_wait,
            max_steps=args.max_steps,
        )
        print(
            f"training when {cfg.min_rollouts} rollouts in {cfg.min_groups} groups, or {cfg.min_turns} turns "
            f"of everyday traffic{' (judged)' if config.await_judge else ''}, are ready "
            f"(looking every {cfg.interval:g}s)",
            file=sys.stderr,
            flush=True,
        )
        loop.run(
            trainer,
            cfg,
            stop=stop,
            on_step=lambda r: print(describe(r), flush=True),
            on_wait=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        return 0
    finally:
        lock.release()
        engine.dispose()


def _judge_settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for name in ("model", "database_url", "log_level", *JUDGE_FLAGS):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def cmd_judge(args: argparse.Namespace) -> int:
    """The reward worker: runs until SIGTERM (or, with --once, until nothing judgeable is left)."""
    import asyncio

    from rewards.worker import build_worker

    settings = _judge_settings(args)
    _setup_logging(settings.log_level)
    try:
        worker, engine = build_worker(settings)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = ", ".join(
        ([f"judge {settings.judge_model}"] if settings.judge_model else [])
        + [f"function {spec}" for spec in settings.reward_functions]
    )
    print(f"judging turns of everyday traffic with {what}", file=sys.stderr, flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            if args.once:
                await worker.run_once()
                return
            reporter = asyncio.create_task(_report(worker, stop))
            try:
                await worker.run(stop)
            finally:
                reporter.cancel()
        finally:
            await worker.aclose()

    from rewards.worker import JudgeUnavailable

    try:
        asyncio.run(main())
    except JudgeUnavailable as exc:
        print(f"error: the judge cannot be reached ({exc}); the turns wait for the next run", file=sys.stderr)
        return 1
    finally:
        print(f"judge: {worker.describe()}", file=sys.stderr, flush=True)
        engine.dispose()
    return 0


async def _report(worker: Any, stop: Any, every: float = 30.0) -> None:
    """A progress line whenever verdicts were recorded since the last one (at most every ``every`` seconds)."""
    import asyncio
    import contextlib

    last = -1
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if not stop.is_set() and worker.stats.verdicts != last:
            last = worker.stats.verdicts
            print(f"judge: {worker.describe()}", file=sys.stderr, flush=True)


def cmd_turns(args: argparse.Namespace) -> int:
    import json

    from gateway.store import db
    from rewards.report import turn_rows

    engine = db.make_engine(_db_url(args))
    try:
        rows = turn_rows(engine, rollout_id=args.rollout_id, limit=args.limit)
    finally:
        engine.dispose()
    if args.json:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False))
        return 0
    if not rows:
        print("no turns" + (f" in rollout {args.rollout_id}" if args.rollout_id else ""))
        return 0
    for row in rows:
        rewards = ", ".join(f"{k}={v:+.3g}" for k, v in row["rewards"].items()) or "none"
        print(
            f"{row['call_id']}  rollout {row['rollout_id']}  v{row['policy_version']}  {row['state']}  "
            f"reward {row['reward'] if row['reward'] is None else format(row['reward'], '+.3g')} ({rewards})"
        )
        if row["judge_reason"]:
            print(f"    judge: {row['judge_reason']}")
        if row["judge_error"]:
            print(f"    judge error: {row['judge_error']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawgate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    _serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="embedded mode: gateway + trainer (+ vLLM) with one command")
    _serve_flags(up)
    up.add_argument("--no-train", action="store_true", help="serve only; do not start the trainer")
    _train_flags(up)
    _judge_flags(up)
    up.set_defaults(func=cmd_up)

    dbp = sub.add_parser("db", help="database schema")
    dbp.add_argument("action", choices=["upgrade", "downgrade", "current"])
    dbp.add_argument("revision", nargs="?", help="target revision (default head; `base` to downgrade all)")
    dbp.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    dbp.set_defaults(func=cmd_db)

    tree = sub.add_parser("tree", help="print a rollout's reconstructed prefix tree and what was filtered")
    tree.add_argument("rollout_id")
    tree.add_argument("--json", action="store_true", help="the JSON form (as GET /v1/rollouts/{id}/tree)")
    tree.add_argument("--max-lines", type=int, default=200)
    tree.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    _tree_flags(tree)
    tree.set_defaults(func=cmd_tree)

    export = sub.add_parser("export", help="export rollouts with calls, rewards and trees as JSONL")
    export.add_argument("--out", default="-", help="output file (default: stdout)")
    export.add_argument("--status", help="only rollouts with this status (open, completed, failed, aborted)")
    export.add_argument("--limit", type=int)
    export.add_argument("--no-tokens", action="store_true", help="leave token ids and logprobs out")
    export.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    _tree_flags(export)
    export.set_defaults(func=cmd_export)

    train = sub.add_parser("train", help="the trainer daemon (GRPO/PPO steps as rollouts become ready)")
    train.add_argument("--once", action="store_true", help="run --steps steps over what is ready now and exit")
    train.add_argument("--steps", type=int, default=1, help="with --once: steps to run")
    train.add_argument("--max-steps", type=int, help="daemon: exit after this many steps")
    train.add_argument("--model", help="base model (CLAWGATE_MODEL)")
    train.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    train.add_argument("--allow-empty", action="store_true", help="with --once: exit 0 when nothing was ready")
    train.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    _train_flags(train)
    train.set_defaults(func=cmd_train)

    judge = sub.add_parser("judge", help="the reward worker: judge turns of everyday traffic (LLM judge, functions)")
    judge.add_argument("--once", action="store_true", help="judge what is judgeable now and exit")
    judge.add_argument("--model", help="the served model, whose tokenizer decodes turns (CLAWGATE_MODEL)")
    judge.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    judge.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    _judge_flags(judge)
    judge.set_defaults(func=cmd_judge)

    turns = sub.add_parser("turns", help="turns of everyday traffic: next state, rewards, judge reasons, training")
    turns.add_argument("rollout_id", nargs="?", help="only this rollout's turns")
    turns.add_argument("--limit", type=int, default=20, help="the newest N turns (default 20)")
    turns.add_argument("--json", action="store_true", help="one JSON object per turn")
    turns.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    turns.set_defaults(func=cmd_turns)

    from runner.cli import register as register_rollout

    register_rollout(sub)

    tiny = sub.add_parser("tiny-model", help="build the small local model used by tests and the demo")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    tiny.set_defaults(func=cmd_tiny_model)
    return parser


def settings_errors(error: Any) -> list[str]:
    """A Settings validation error as one line per problem, naming the variable to fix (no values: they may be
    secrets)."""
    lines = []
    for item in error.errors():
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = [str(part) for part in item.get("loc", ())]
        lines.append(f"CLAWGATE_{loc[0].upper()}: {message}" if loc else message)
    return lines


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except ValidationError as exc:
        if exc.title != Settings.__name__:
            raise
        for line in settings_errors(exc):
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
