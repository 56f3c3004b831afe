"""The `clawgate` command: one parser assembled from the subcommands each part of the project registers.

    clawgate serve        run the gateway (engine: local in-process model, or a vLLM server)
    clawgate up           embedded mode: migrate the database, build the tiny model if needed, serve
    clawgate db upgrade   bring the database schema to the newest migration (also: downgrade, current)
    clawgate db prune     delete captured traffic older than a retention window
    clawgate forget       delete rollouts, sessions or calls and everything derived from them
    clawgate tree ID      print a rollout's reconstructed prefix tree
    clawgate export       rollouts with calls, rewards and trees as JSONL
    clawgate train        the trainer daemon: GRPO/PPO steps as rollouts become ready; publishes policy@vN
    clawgate judge        the reward worker: scores turns of everyday traffic with an LLM judge / reward functions
    clawgate turns        turns of everyday traffic with their next state, rewards and judge reasons
    clawgate rollout      run a task set through agent harnesses in sandboxes, verify, post rewards
    clawgate tiny-model   build the small local test model

Every flag has a ``CLAWGATE_*`` environment variable; a flag given on the command line wins.

Each owner registers its own commands (``register(subparsers)``): the gateway (``gateway/cli.py``: serve, db,
tree, export, policy, forget), the trainer (``trainer/cli.py``: train), the reward worker (``rewards/cli.py``:
judge, turns) and the runner (``runner/cli.py``: rollout). `up` (``up.py``), which runs the others together, and
`tiny-model` are this package's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from clawgate import up
from clawgate.malloc import limit_arenas
from clawgate.tiny_model import build_tiny
from gateway import cli as gateway_cli
from gateway.settings import Settings
from rewards import cli as rewards_cli
from runner import cli as runner_cli
from trainer import cli as trainer_cli


def cmd_tiny_model(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"error: {out} exists and is not empty (use --force to rebuild)", file=sys.stderr)
        return 2
    build_tiny(out, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawgate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gateway_cli.register(sub)
    up.register(sub)
    trainer_cli.register(sub)
    rewards_cli.register(sub)
    runner_cli.register(sub)

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
    # Before any thread starts: a long-running gateway's memory levels off with fewer malloc arenas.
    limit_arenas()
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
