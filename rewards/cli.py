"""The reward worker's commands, registered into the `clawgate` parser (``clawgate/cli.py``).

    clawgate judge        the reward worker: scores turns of everyday traffic with an LLM judge / reward functions
    clawgate turns        turns of everyday traffic with their next state, rewards and judge reasons

``judge_flags`` is also what `clawgate up` starts its reward-worker child with.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.logs import setup_logging
from gateway.settings import Settings, from_flags

if TYPE_CHECKING:
    from rewards.build import WorkerSettings

# The reward worker's flags that are settings, by their Settings field names.
JUDGE_FLAGS = (
    "judge_model",
    "judge_api_base",
    "judge_api_key_env",
    "judge_rubric",
    "judge_concurrency",
    "judge_timeout",
    "reward_functions",
)
# What `clawgate judge` builds its settings from.
JUDGE_SETTINGS = ("model", "database_url", "log_level", *JUDGE_FLAGS)


def judge_flags(p: argparse.ArgumentParser) -> None:
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


def cmd_judge(args: argparse.Namespace) -> int:
    """The reward worker: runs until SIGTERM (or, with --once, until nothing judgeable is left)."""
    import asyncio

    from rewards.build import build_worker

    settings = from_flags(args, JUDGE_SETTINGS)
    setup_logging(settings.log_level)
    try:
        worker, database = build_worker(worker_settings(settings))
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
        database.dispose()
    return 0


def worker_settings(settings: Settings) -> WorkerSettings:
    """The reward worker's part of ``settings``, for ``rewards.build.build_worker``."""
    from rewards.build import WorkerSettings

    return WorkerSettings(
        model=settings.model,
        database_url=settings.database_url,
        judge_model=settings.judge_model,
        judge_api_base=settings.judge_api_base,
        judge_api_key_env=settings.judge_api_key_env,
        judge_rubric=settings.judge_rubric,
        judge_timeout=settings.judge_timeout,
        judge_max_answer_tokens=settings.judge_max_answer_tokens,
        judge_temperature=settings.judge_temperature,
        judge_concurrency=settings.judge_concurrency,
        judge_max_attempts=settings.judge_max_attempts,
        judge_interval=settings.judge_interval,
        judge_context_tokens=settings.judge_context_tokens,
        judge_reply_tokens=settings.judge_reply_tokens,
        judge_next_state_tokens=settings.judge_next_state_tokens,
        reward_functions=tuple(settings.reward_functions),
        max_staleness=settings.train_max_staleness,
    )


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

    database = db.connect(args.database_url or Settings().database_url)
    try:
        rows = turn_rows(database, rollout_id=args.rollout_id, limit=args.limit)
    finally:
        database.dispose()
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
        if row["siblings"]:
            scores = ", ".join("-" if s["reward"] is None else format(s["reward"], "+.3g") for s in row["siblings"])
            served = "-" if row["group_reward"] is None else format(row["group_reward"], "+.3g")
            print(f"    group: served {served} without next state; {len(row['siblings'])} siblings {scores}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `judge` and `turns` to the `clawgate` parser."""
    judge = sub.add_parser("judge", help="the reward worker: judge turns of everyday traffic (LLM judge, functions)")
    judge.add_argument("--once", action="store_true", help="judge what is judgeable now and exit")
    judge.add_argument("--model", help="the served model, whose tokenizer decodes turns (CLAWGATE_MODEL)")
    judge.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    judge.add_argument("--log-level", help="(CLAWGATE_LOG_LEVEL)")
    judge_flags(judge)
    judge.set_defaults(func=cmd_judge)

    turns = sub.add_parser("turns", help="turns of everyday traffic: next state, rewards, judge reasons, training")
    turns.add_argument("rollout_id", nargs="?", help="only this rollout's turns")
    turns.add_argument("--limit", type=int, default=20, help="the newest N turns (default 20)")
    turns.add_argument("--json", action="store_true", help="one JSON object per turn")
    turns.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    turns.set_defaults(func=cmd_turns)


__all__ = ["JUDGE_FLAGS", "cmd_judge", "cmd_turns", "judge_flags", "register", "worker_settings"]
