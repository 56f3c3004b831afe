"""`clawgate rollout`: run a task set through agent harnesses in sandboxes against a gateway, verify, reward.

    clawgate rollout --tasks tasks.jsonl --harness builtin,claude-code --n 8 --concurrency 4 \\
        --gateway http://127.0.0.1:8080          # admin key from CLAWGATE_ADMIN_KEY
    clawgate rollout --eval --tasks held-out.jsonl --harness builtin   # pass rates per policy version
    clawgate rollout --list-harnesses            # which harnesses are installed here, with install hints

Progress goes to stderr; the per task × harness reward table (and, with ``--eval``, the pass rates) to stdout.
Exit status: 0 when every rollout was run and judged, 1 when some hit infrastructure or verifier failures,
2 for unusable input (task file, harness not installed, sandbox refused).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from gateway.settings import Settings
from runner.client import DEFAULT_GATEWAY


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout",
        help="run tasks through agent harnesses in sandboxes, verify, post rewards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", default="suite", help="task file (JSONL); default: the bundled suite")
    p.add_argument("--harness", default="builtin", help="comma-separated: builtin, claude-code, codex, openclaw")
    p.add_argument("--n", type=int, default=1, help="rollouts per task and harness (the GRPO group size)")
    p.add_argument("--concurrency", type=int, default=2, help="rollouts running at once")
    p.add_argument("--gateway", default=None, help=f"gateway URL (CLAWGATE_GATEWAY_URL, default {DEFAULT_GATEWAY})")
    p.add_argument("--model", help="model name harnesses send (default: the gateway's first listed model)")
    p.add_argument("--eval", action="store_true", help="evaluation rollouts: never trained on; pass rates per version")
    p.add_argument(
        "--policy-version",
        type=int,
        metavar="V",
        help="serve every rollout by policy@vV (published, not rejected), e.g. a version being evaluated",
    )
    p.add_argument("--tag", action="append", help="only tasks with this tag (repeatable)")
    p.add_argument("--max-turns", type=int, default=8, help="turn limit passed to harnesses that have one")
    p.add_argument("--retries", type=int, default=2, help="retries per rollout of infrastructure failures")
    p.add_argument("--pass-threshold", type=float, default=1.0, help="a reward at least this much is a pass")
    p.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "none"],
        default="auto",
        help="auto: bubblewrap if usable, else plain directories with a warning; bwrap: require it",
    )
    p.add_argument("--work-dir", help="where sandbox directories are created (default: the system temp dir)")
    p.add_argument("--harness-bin", action="append", default=[], metavar="NAME=PATH", help="a harness executable")
    p.add_argument("--json-out", help="write one JSON line per rollout result to this file")
    p.add_argument("--list-harnesses", action="store_true", help="show which harnesses are available and exit")
    p.set_defaults(func=cmd_rollout)


def _executables(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--harness-bin wants NAME=PATH, not {pair!r}")
        out[name.strip()] = path.strip()
    return out


def cmd_rollout(args: argparse.Namespace) -> int:
    from runner.client import RunAborted
    from runner.harnesses import detect_all, make_harness
    from runner.run import RunConfig, Runner
    from runner.sandbox import SandboxError, SandboxFactory
    from runner.tasks import TaskFileError, load_tasks, select

    try:
        executables = _executables(args.harness_bin)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list_harnesses:
        for detection in detect_all(executables):
            print(detection.describe())
        return 0
    if args.n < 1 or args.concurrency < 1 or args.retries < 0 or args.max_turns < 1:
        print("error: --n, --concurrency and --max-turns must be >= 1, --retries >= 0", file=sys.stderr)
        return 2
    try:
        tasks = select(load_tasks(args.tasks), args.tag)
    except TaskFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not tasks:
        print(f"error: no task has any of the tags {args.tag}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.harness.split(",") if n.strip()]
    try:
        harnesses = [make_harness(n, executables.get(n)) for n in dict.fromkeys(names)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = [d for d in (h.detect() for h in harnesses) if not d.available]
    if missing:
        for d in missing:
            print(f"error: harness {d.describe()}", file=sys.stderr)
        return 2
    try:
        sandboxes = SandboxFactory(args.sandbox, base_dir=args.work_dir)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Settings (CLAWGATE_* variables) are read here, at the process's edge, and passed down.
    settings = Settings()
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key is not None else None
    config = RunConfig(
        gateway_url=args.gateway or settings.gateway_url or DEFAULT_GATEWAY,
        admin_key=admin_key or None,
        n=args.n,
        concurrency=args.concurrency,
        eval=args.eval,
        model=args.model,
        retries=args.retries,
        max_turns=args.max_turns,
        pass_threshold=args.pass_threshold,
        policy_version=args.policy_version,
    )
    total = len(tasks) * len(harnesses) * args.n
    print(
        f"{total} rollouts: {len(tasks)} tasks × {', '.join(h.name for h in harnesses)} × {args.n}"
        f"{' (eval)' if args.eval else ''} against {config.base}",
        file=sys.stderr,
    )
    try:
        report = asyncio.run(Runner(config, tasks, harnesses, sandboxes).run())
    except RunAborted as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        sandboxes.close()
    print(report.table())
    if args.eval:
        print()
        print(report.eval_table())
    print(report.summary(), file=sys.stderr)
    if args.json_out:
        with Path(args.json_out).open("w", encoding="utf-8") as f:
            for row in report.to_json():
                f.write(json.dumps(row) + "\n")
    return report.exit_code
