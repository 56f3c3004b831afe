"""``clawgate db prune`` and ``clawgate forget``: keep captured traffic only as long as needed, forget on request.

    clawgate db prune --older-than 30d [--keep-trained-summaries] [--tenant NAME]
    clawgate forget --rollout ID | --session ID | --call ID | --tenant NAME  (each may be repeated)

Both delete from the database in small transactions beside running gateways (``gateway/store/retention.py``,
``forget.py``), then clean the spool directories no running gateway holds (dead-letter and pending lines; a
running gateway cleans its own on its next retention run, or at once through ``POST /v1/admin/forget``); a forget
also takes the rollouts out of the export files written on this host (``gateway/store/exports.py``). They print
what they deleted, table by table, and the policy versions already trained on it: those cannot be un-trained.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from typing import Any

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "": 86400}


def parse_duration(text: str) -> dt.timedelta:
    """``30d``, ``12h``, ``90m``, ``3600s``, ``2w``; a bare number is days."""
    match = DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (examples: 30d, 12h, 90m)")
    return dt.timedelta(seconds=float(match.group(1)) * UNIT_SECONDS[match.group(2)])


def print_report(report: Any, verb: str, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
        return
    parts = ", ".join(f"{n} {table}" for table, n in report.deleted.items() if n)
    print(f"{verb} {report.rows} rows in {report.seconds:.1f} s: {parts or 'nothing to delete'}")
    if report.spool_lines or report.spool_files:
        print(f"spool: {report.spool_lines} lines and {report.spool_files} pending files removed")
    exported = report.exports
    if exported.get("rewritten"):
        print(f"exports: {exported['lines']} rollouts taken out of {', '.join(exported['rewritten'])}")
    if exported.get("elsewhere"):
        print(f"exports on other hosts, not touched (run forget there too): {', '.join(exported['elsewhere'])}")
    if report.kept_continued:
        print(
            f"kept {report.kept_continued} old rollouts that a newer conversation continues (pruned once it ages out)"
        )
    if report.not_found:
        print(f"not found (already deleted, or never recorded): {', '.join(report.not_found)}")
    if report.trained_versions:
        versions = ", ".join(f"policy@v{v}" for v in sorted(report.trained_versions))
        print(
            f"trained on this data already: {versions}. Their weights cannot be un-trained; roll back to an "
            "earlier version (`clawgate policy rollback V`) if they must not serve"
        )


def _progress(report: Any) -> None:
    print(f"... {report.rows} rows deleted", file=sys.stderr, flush=True)


def cmd_prune(args: argparse.Namespace) -> int:
    from gateway.settings import Settings
    from gateway.store import db, retention, spool

    settings = Settings()
    if args.older_than is None:
        print("error: `clawgate db prune` needs --older-than (for example 30d)", file=sys.stderr)
        return 2
    database = db.connect(args.database_url or settings.database_url)
    try:
        report = retention.prune(
            database,
            older_than=args.older_than,
            keep_trained_summaries=args.keep_trained_summaries,
            progress=_progress,
            tenant=args.tenant,
        )
    finally:
        database.dispose()
    cutoff = retention.utcnow() - args.older_than
    spool_dir = settings.data_dir / "spool"
    if args.tenant is None:
        report.spool_lines, report.spool_files, held = spool.clean_all(spool_dir, cutoff=cutoff)
    else:  # spool lines of the rollouts pruned; other tenants' old lines stay
        report.spool_lines, report.spool_files, held = spool.clean_all(spool_dir, ids=frozenset(report.affected))
    print_report(report, "pruned", as_json=args.json)
    if held:
        print(f"{held} spool directories are held by running gateways: they prune their own", file=sys.stderr)
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from gateway.settings import Settings
    from gateway.store import db, exports, spool
    from gateway.store import forget as forgetting

    settings = Settings()
    if not (args.rollout or args.session or args.call or args.tenant):
        print("error: `clawgate forget` needs --rollout, --session, --call or --tenant", file=sys.stderr)
        return 2
    database = db.connect(args.database_url or settings.database_url)
    try:
        report = forgetting.forget(
            database,
            rollouts=args.rollout,
            sessions=args.session,
            calls=args.call,
            tenants=args.tenant,
            progress=_progress,
        )
        report.exports = asdict(exports.remove_rollouts(database, report.affected))
    finally:
        database.dispose()
    ids = forgetting.named_ids(args.rollout, args.session, args.call) | report.affected
    report.spool_lines, report.spool_files, held = spool.clean_all(settings.data_dir / "spool", ids=ids)
    print_report(report, "forgot", as_json=args.json)
    if held:
        print(
            f"{held} spool directories are held by running gateways: `POST /v1/admin/forget` cleans those too",
            file=sys.stderr,
        )
    return 0


def register_prune_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--older-than",
        type=parse_duration,
        help="prune: delete rollouts with no activity for this long (30d, 12h, 90m; a bare number is days)",
    )
    p.add_argument(
        "--keep-trained-summaries",
        action="store_true",
        help="prune: keep the rollout rows, rollout rewards and training records of trained rollouts (not their calls)",
    )
    p.add_argument("--tenant", metavar="NAME", help="prune: only this tenant's rollouts")
    p.add_argument("--json", action="store_true", help="prune: the report as JSON")


def register(sub: Any) -> None:
    forget = sub.add_parser(
        "forget", help="delete rollouts, harness sessions or calls and everything derived from them"
    )
    forget.add_argument("--rollout", action="append", default=[], metavar="ID", help="a rollout id (repeatable)")
    forget.add_argument(
        "--session",
        action="append",
        default=[],
        metavar="ID",
        help="a harness session id (Claude Code's, Codex's) or a session rollout's id (repeatable)",
    )
    forget.add_argument(
        "--call",
        action="append",
        default=[],
        metavar="ID",
        help="a call id; the calls continuing it go too (repeatable)",
    )
    forget.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="every rollout of this tenant (repeatable; its keys stay: `clawgate keys revoke` them)",
    )
    forget.add_argument("--json", action="store_true", help="the report as JSON")
    forget.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    forget.set_defaults(func=cmd_forget)


__all__ = ["cmd_forget", "cmd_prune", "parse_duration", "print_report", "register", "register_prune_flags"]
