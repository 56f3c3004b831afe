"""The gateway's commands, registered into the `clawgate` parser (``clawgate/cli.py``).

    clawgate serve        run the gateway (engine: local in-process model, or a vLLM server)
    clawgate db upgrade   bring the database schema to the newest migration (also: downgrade, current)
    clawgate db prune     delete captured traffic older than a retention window
    clawgate forget       delete rollouts, sessions or calls and everything derived from them
    clawgate tree ID      print a rollout's reconstructed prefix tree
    clawgate export       rollouts with calls, rewards and trees as JSONL
    clawgate policy       list the policy versions; pin, unpin, roll back the served one
    clawgate keys         tenants' API keys: create (shown once), list, revoke

``serve_flags``, ``SERVE_FLAGS`` and ``serve`` are also what `clawgate up` serves with.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import keys_cli, policy_cli, retention_cli
from gateway.logs import setup_logging
from gateway.settings import Settings, environment_of, from_flags

if TYPE_CHECKING:
    from prefix_tree import TreeConfig

# The flags of `serve` (and `up`) that are settings, by their Settings field names.
SERVE_FLAGS = (
    "engine",
    "model",
    "served_model_name",
    "vllm_url",
    "database_url",
    "host",
    "port",
    "max_tokens",
    "log_level",
    "tool_error_reward",
    "counterfactuals",
    "counterfactual_share",
    "workers",
    "promotion",
    "canary_share",
    "canary_min_turns",
    "promotion_margin",
    "canary_max_seconds",
    "secrets",
)


def serve_flags(p: argparse.ArgumentParser) -> None:
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
        "--workers",
        type=int,
        help="gateway processes on this port, sharing the database (CLAWGATE_WORKERS; each loads its own tokenizer, "
        "and with --engine local its own model)",
    )
    p.add_argument(
        "--tool-error-reward",
        type=float,
        help="reward of a turn whose tool results report a failure; 0 turns the rule off (CLAWGATE_TOOL_ERROR_REWARD)",
    )
    p.add_argument(
        "--counterfactuals",
        type=int,
        metavar="K",
        help="extra answers drawn for a served everyday turn's prompt, off the critical path, so it trains in a group; "
        "0: off (CLAWGATE_COUNTERFACTUALS)",
    )
    p.add_argument(
        "--counterfactual-share",
        type=float,
        help="share of served everyday turns that get counterfactual siblings (CLAWGATE_COUNTERFACTUAL_SHARE)",
    )

    p.add_argument(
        "--promotion",
        choices=["guarded", "immediate"],
        help="a newly trained version serves a canary and earns its traffic (guarded), or serves everything at once "
        "(immediate); default: guarded in production, immediate in development (CLAWGATE_PROMOTION)",
    )
    p.add_argument(
        "--canary-share", type=float, help="share of new conversations a candidate serves (CLAWGATE_CANARY_SHARE)"
    )
    p.add_argument(
        "--canary-min-turns",
        type=int,
        help="rewarded samples per arm before a canary is decided (CLAWGATE_CANARY_MIN_TURNS)",
    )
    p.add_argument(
        "--promotion-margin",
        type=float,
        help="how much lower a candidate's mean reward may be and still be promoted (CLAWGATE_PROMOTION_MARGIN)",
    )
    p.add_argument(
        "--canary-max-seconds",
        type=float,
        help="a canary undecided this long gets CLAWGATE_CANARY_TIMEOUT_OUTCOME (CLAWGATE_CANARY_MAX_SECONDS)",
    )
    p.add_argument(
        "--secrets",
        choices=["exclude", "mask", "drop", "off"],
        help="credentials found in answers: keep the answer out of training (exclude, default), only the "
        "credential's tokens (mask); drop: also replace them in what is stored; off: no scan (CLAWGATE_SECRETS)",
    )


def serve_settings(args: argparse.Namespace) -> Settings:
    return from_flags(args, SERVE_FLAGS)


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """A SIGTERM handler that ends the process with SystemExit(0): `finally` blocks run, the exit is a clean one."""
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    setup_logging(settings.log_level)
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully: exit 0 (a clean stop), not -15.
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    return serve(settings)


def serve(settings: Settings) -> int:
    """Serve until stopped; exit code 2 (and nothing served) when the database schema is not the newest."""
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

    target: Any
    if settings.workers > 1:
        # Each worker process builds its own app from the environment: hand it what the flags (or `up`) changed.
        os.environ.update(environment_of(settings, (*SERVE_FLAGS, "vllm_url")))
        target = "gateway.app:app_from_environment"
    else:
        target = build_app(settings)
    uvicorn.run(
        target,
        factory=settings.workers > 1,
        workers=settings.workers,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        # SIGTERM: stop accepting, let calls in flight finish (at most this long), then drain the capture writer.
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from gateway.store import db

    if args.action == "prune":
        return retention_cli.cmd_prune(args)
    if args.older_than is not None or args.keep_trained_summaries:
        print("error: --older-than and --keep-trained-summaries are for `clawgate db prune`", file=sys.stderr)
        return 2
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


def _db_url(args: argparse.Namespace) -> str:
    return args.database_url or Settings().database_url


def _tree_config(args: argparse.Namespace) -> TreeConfig:
    from prefix_tree import TreeConfig

    return TreeConfig(
        drop_dead_leaves=not args.keep_dead_leaves,
        drop_compaction=not args.keep_compaction,
        keep_subagents=args.keep_subagents,
        max_leaves=args.max_leaves if args.max_leaves > 0 else None,
        secrets=Settings().secrets,
    )


def _tree_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-dead-leaves", action="store_true", help="keep abandoned retries trainable")
    p.add_argument("--keep-compaction", action="store_true", help="keep context-compaction branches")
    p.add_argument("--keep-subagents", action="store_true", help="keep sub-agent calls as separate trajectories")
    p.add_argument("--max-leaves", type=int, default=8, help="drop rollouts with more leaves (0: no limit)")
    p.add_argument("--raw", action="store_true", help="exact token ids of credentials (redacted to -1 otherwise)")


def cmd_tree(args: argparse.Namespace) -> int:
    import json

    from gateway.store import db
    from gateway.store.training_data import load_rollout

    database = db.connect(_db_url(args))
    try:
        data = load_rollout(database, args.rollout_id, _tree_config(args), redact=not args.raw)
    finally:
        database.dispose()
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
    """Rollouts with their calls (each with its counterfactual group), rewards and trees as JSON lines."""
    import json

    from gateway.store import db, exports, rollout_lifecycle
    from gateway.store.training_data import load_rollout, rollout_ids

    database = db.connect(_db_url(args))
    out = open(args.out, "w", encoding="utf-8") if args.out != "-" else sys.stdout  # noqa: SIM115
    try:
        ids = rollout_ids(database, status=args.status, limit=args.limit, tenant=args.tenant)
        if args.out != "-":
            # Recorded first: a forget while the file is being written still finds it.
            exports.record(database, Path(args.out), ids)
        for n, rollout_id in enumerate(ids, 1):
            record = rollout_lifecycle.detail(
                database, rollout_id, with_tokens=not args.no_tokens, raw=args.raw, counterfactuals=True
            )
            data = load_rollout(database, rollout_id, _tree_config(args), redact=not args.raw)
            if data is not None:
                record["tree"] = data.tree.to_json(include_tokens=not args.no_tokens)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            if args.out != "-" and (n % 50 == 0 or n == len(ids)):
                print(f"exported {n}/{len(ids)} rollouts", file=sys.stderr)
    finally:
        if out is not sys.stdout:
            out.close()
        database.dispose()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve`, `db`, `tree`, `export`, `policy` and `forget` to the `clawgate` parser."""
    serve = sub.add_parser("serve", help="run the gateway")
    serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    dbp = sub.add_parser("db", help="database schema, and pruning captured traffic past a retention window")
    dbp.add_argument("action", choices=["upgrade", "downgrade", "current", "prune"])
    dbp.add_argument("revision", nargs="?", help="target revision (default head; `base` to downgrade all)")
    dbp.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    retention_cli.register_prune_flags(dbp)
    dbp.set_defaults(func=cmd_db)

    tree = sub.add_parser("tree", help="print a rollout's reconstructed prefix tree and what was filtered")
    tree.add_argument("rollout_id")
    tree.add_argument("--json", action="store_true", help="the JSON form (as GET /v1/rollouts/{id}/tree)")
    tree.add_argument("--max-lines", type=int, default=200)
    tree.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    _tree_flags(tree)
    tree.set_defaults(func=cmd_tree)

    export = sub.add_parser(
        "export", help="export rollouts with calls (each with its counterfactual group), rewards and trees as JSONL"
    )
    export.add_argument("--out", default="-", help="output file (default: stdout)")
    export.add_argument("--status", help="only rollouts with this status (open, completed, failed, aborted)")
    export.add_argument("--limit", type=int)
    export.add_argument("--tenant", metavar="NAME", help="only this tenant's rollouts")
    export.add_argument("--no-tokens", action="store_true", help="leave token ids and logprobs out")
    export.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    _tree_flags(export)
    export.set_defaults(func=cmd_export)

    policy_cli.register(sub)
    retention_cli.register(sub)
    keys_cli.register(sub)


__all__ = [
    "SERVE_FLAGS",
    "cmd_db",
    "cmd_export",
    "cmd_serve",
    "cmd_tree",
    "register",
    "serve",
    "serve_flags",
]
