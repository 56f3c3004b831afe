"""``clawgate policy``: the served policy version from the command line.

    clawgate policy list                  versions, their stage and reward
    clawgate policy status [--json]       guarded promotion: incumbent, candidate, stage, both arms, decisions
    clawgate policy promote|reject [V]    decide a candidate or canary by hand (default: the undecided one)
    clawgate policy pin V | unpin         serve V everywhere until unpinned
    clawgate policy rollback V            serve V now and have the trainer go on from it

``--tenant NAME`` acts on that tenant's own policy (``clawgate keys policy --tenant NAME own``) instead of the
shared one: its pin, rollback and candidates are its own. A VERSION names its lineage by itself.

Everything is written to the database; every gateway acts on it at its next policy poll.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

if TYPE_CHECKING:
    from gateway.settings import Settings

ACTIONS = ["list", "status", "promote", "reject", "pin", "unpin", "rollback"]


def register(sub: Any) -> None:
    policy = sub.add_parser("policy", help="policy versions: list, status, promote, reject, pin, unpin, roll back")
    policy.add_argument("action", choices=ACTIONS)
    policy.add_argument("version", nargs="?", type=int, help="the version to pin, roll back to, promote or reject")
    policy.add_argument("--json", action="store_true", help="`list` and `status` as JSON")
    policy.add_argument(
        "--tenant", metavar="NAME", help="status, pin, unpin, roll back, promote or reject this tenant's own policy"
    )
    policy.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
    policy.set_defaults(func=cmd_policy)


def cmd_policy(args: argparse.Namespace) -> int:
    from gateway.policy import lineage_for
    from gateway.settings import Settings
    from gateway.store import db, policy_control, promotion

    if args.action in ("pin", "rollback") and args.version is None:
        print(f"error: `clawgate policy {args.action}` needs a VERSION", file=sys.stderr)
        return 2
    if args.action in ("unpin", "list", "status") and args.version is not None:
        print(f"error: `clawgate policy {args.action}` takes no VERSION", file=sys.stderr)
        return 2
    if args.tenant is not None and args.action == "list":
        print("error: `clawgate policy list` shows every lineage: --tenant does not apply", file=sys.stderr)
        return 2
    settings = Settings()
    database = db.connect(args.database_url or settings.database_url)
    try:
        lineage = lineage_for(database, args.tenant, args.version)
        if args.action == "pin":
            policy_control.pin(database, args.version, lineage)
            print(f"pinned policy@v{args.version}: every gateway serves it until `clawgate policy unpin`")
        elif args.action == "unpin":
            policy_control.unpin(database, lineage)
            print("unpinned: every gateway serves the incumbent (and a running canary) again")
        elif args.action == "rollback":
            policy_control.request_rollback(database, args.version, lineage)
            print(
                f"rolling back to policy@v{args.version}: served now (pinned); the trainer republishes it as the next "
                "version, releases the pin and trains on from it"
            )
        elif args.action in ("promote", "reject"):
            version = promotion.decide_by_operator(database, args.action, args.version, lineage=lineage)
            done = "promoted: it serves all new conversations" if args.action == "promote" else "rejected"
            print(f"policy@v{version} {done}")
        elif args.action == "status":
            print_status(database, settings, as_json=args.json, lineage=lineage)
        else:
            print_versions(database, as_json=args.json)
    except (policy_control.UnknownVersion, promotion.NotDecidable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        database.dispose()
    return 0


def print_status(database: sa.Engine, settings: Settings, *, as_json: bool, lineage: str = "") -> None:
    from gateway.promotion.promoter import rule_of
    from gateway.promotion.status import status

    out = status(database, rule_of(settings), lineage=lineage)
    if as_json:
        print(json.dumps(out))
        return
    print(f"promotion: {out['mode']}")
    print(
        f"incumbent: {_v(out['incumbent'])}"
        + (f"  (pinned: {_v(out['pinned_version'])})" if out["pinned_version"] is not None else "")
    )
    if out["candidate"] is None:
        print("candidate: none")
    else:
        share = f", {100 * out['canary_share']:.0f}% of new conversations" if out["canary_share"] else ""
        print(f"candidate: {_v(out['candidate'])} ({out['stage']}{share})")
    if out["arms"]:
        for arm in ("candidate", "incumbent"):
            a = out["arms"][arm]
            mean = "-" if a["mean"] is None else f"{a['mean']:.3f}"
            ci = "" if a["interval"] is None else f" [{a['interval'][0]:.3f}, {a['interval'][1]:.3f}]"
            err = "-" if a["error_rate"] is None else f"{a['error_rate']:.3f}"
            print(f"  {arm:<10} reward {mean}{ci}  n={a['n']}  calls={a['calls']}  error rate {err}")
        print(f"  verdict now: {out['verdict']['outcome']}: {out['verdict']['reason']}")
    if out["decisions"]:
        print("decisions (newest first):")
        for d in out["decisions"][:10]:
            print(f"  {d['created_at'][:19]}  {_v(d['version'])} {d['outcome']:<9} {d['reason']}")


def print_versions(database: sa.Engine, *, as_json: bool) -> None:
    from gateway.store import console, policy_control

    control = policy_control.read(database)
    pins = policy_control.pins(database)
    versions = console.versions(database)
    if as_json:
        for v in versions:
            row = {
                "version": v.version,
                "adapter": v.adapter_name,
                "status": v.status,
                "stage": v.stage,
                "current": v.is_current,
                "lineage": v.lineage,
                "pinned": pins.get(v.lineage) == v.version,
                "parent_version": v.parent_version,
                "rolled_back_from": v.rolled_back_from,
                "created_at": v.created_at.isoformat(),
                "turn_reward": v.turn_reward.mean,
                "rollout_reward": v.rollout_reward.mean,
            }
            print(json.dumps(row))
        return
    print(
        f"{'version':<16}{'lineage':<14}{'status':<11}{'stage':<12}{'from':<10}{'turn reward':>12}"
        f"{'rollout reward':>16}  published"
    )
    for v in versions:
        flags = (" current" if v.is_current else "") + (" pinned" if pins.get(v.lineage) == v.version else "")
        origin = (
            f"rb v{v.rolled_back_from}"
            if v.rolled_back_from is not None
            else (f"v{v.parent_version}" if v.parent_version is not None else "-")
        )
        turn = f"{v.turn_reward.mean:.3f}" if v.turn_reward.mean is not None else "-"
        rollout = f"{v.rollout_reward.mean:.3f}" if v.rollout_reward.mean is not None else "-"
        print(
            f"{v.adapter_name:<16}{v.lineage or 'shared':<14}{v.status:<11}{v.stage:<12}{origin:<10}{turn:>12}"
            f"{rollout:>16}  "
            f"{v.created_at:%Y-%m-%d %H:%M:%S}{flags}"
        )
    if control.rollback_to is not None:
        print(f"rollback to policy@v{control.rollback_to} requested: waiting for the trainer")


def _v(version: int | None) -> str:
    return "the base model" if version is None else f"policy@v{version}"


__all__ = ["cmd_policy", "print_status", "print_versions", "register"]
