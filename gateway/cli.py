"""The `clawgate` command.

    clawgate serve        run the gateway (engine: local in-process model, or a vLLM server)
    clawgate up           embedded mode: migrate the database, build the tiny model if needed, serve
    clawgate db upgrade   bring the database schema to the newest migration (also: downgrade, current)
    clawgate tree ID      print a rollout's reconstructed prefix tree
    clawgate export       rollouts with calls, rewards and trees as JSONL
    clawgate train --once one GRPO step over ready rollouts; writes adapters/policy@vN
    clawgate tiny-model   build the small local test model

Every flag has a ``CLAWGATE_*`` environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
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
    ):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_app

    settings = _settings(args)
    _setup_logging(settings.log_level)
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from gateway.store import db

    settings = _settings(args)
    _setup_logging(settings.log_level)
    model_dir = Path(settings.model)
    if settings.engine == "local" and not model_dir.exists():
        if model_dir.resolve() != (DEFAULT_DATA_DIR / "tiny-model").resolve():
            print(f"error: model folder {model_dir} does not exist", file=sys.stderr)
            return 2
        _build_tiny(model_dir)
    print(f"migrating {settings.database_url} ...", file=sys.stderr)
    db.upgrade(settings.database_url)
    return cmd_serve(args)


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
    from trainer.filters import TreeConfig

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
    from trainer.data import load_rollout

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
    from trainer.data import load_rollout, rollout_ids

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


def cmd_train(args: argparse.Namespace) -> int:
    if not args.once:
        print("error: only one-shot training is available: pass --once (with --steps N for several)", file=sys.stderr)
        return 2
    from gateway.store import db
    from trainer.step import TrainConfig, Trainer, describe

    overrides: dict[str, Any] = {}
    for name in ("model", "database_url", "adapter_dir", "log_level"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    settings = Settings(**overrides)
    _setup_logging(settings.log_level)
    config = TrainConfig(
        model=settings.model,
        database_url=settings.database_url,
        adapter_dir=Path(settings.adapter_dir),
        lr=args.lr,
        temperature=args.temperature,
        max_rollouts=args.max_rollouts,
        min_rollouts=args.min_rollouts,
        seed=args.seed,
    )
    engine = db.make_engine(settings.database_url)
    try:
        trainer = Trainer(config, engine)
        print(f"policy@v{trainer.version} loaded from {config.adapter_dir}", file=sys.stderr)
        done = 0
        for i in range(args.steps):
            result = trainer.step()
            if result is None:
                print(f"[{i + 1}/{args.steps}] no ready rollouts (need {config.min_rollouts})", file=sys.stderr)
                break
            done += 1
            print(f"[{i + 1}/{args.steps}] {describe(result)}", flush=True)
    finally:
        engine.dispose()
    return 0 if done or args.allow_empty else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawgate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    _serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="embedded mode: migrate, build the tiny model if needed, serve")
    _serve_flags(up)
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

    train = sub.add_parser("train", help="train the LoRA policy on ready rollouts (GRPO)")
    train.add_argument("--once", action="store_true", help="run --steps steps and exit")
    train.add_argument("--steps", type=int, default=1)
    train.add_argument("--model", help="base model (CLAWGATE_MODEL)")
    train.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    train.add_argument("--adapter-dir", help="where policy@vN versions go (CLAWGATE_ADAPTER_DIR)")
    train.add_argument("--lr", type=float, default=1e-5)
    train.add_argument("--temperature", type=float, default=1.0, help="temperature the rollouts were sampled at")
    train.add_argument("--max-rollouts", type=int, default=256, help="rollouts per step at most")
    train.add_argument("--min-rollouts", type=int, default=1, help="do nothing with fewer ready rollouts")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--allow-empty", action="store_true", help="exit 0 when nothing was ready")
    train.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    train.set_defaults(func=cmd_train)

    tiny = sub.add_parser("tiny-model", help="build the small local model used by tests and the demo")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    tiny.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
