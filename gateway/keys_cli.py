"""``clawgate keys``: tenants' API keys from the command line (the same as ``/v1/admin/keys``).

    clawgate keys create --tenant NAME [--role user|admin] [--expires 30d|ISO] [--name TEXT] [--json]
    clawgate keys list [--tenant NAME] [--revoked] [--json]
    clawgate keys revoke ID
    clawgate keys limit (--tenant NAME | --key ID) [--rpm N|off] [--tpm N|off]

A key is printed once, when it is created; the database keeps only its keyed hash (``CLAWGATE_KEY_SECRET``: the
gateways must run with the same secret). A tenant exists from its first key.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import TYPE_CHECKING, Any

from gateway.retention_cli import parse_duration

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa


def _expiry(text: str) -> dt.datetime:
    """``30d`` (from now) or an ISO 8601 time (UTC unless it names a zone)."""
    try:
        return dt.datetime.now(dt.UTC) + parse_duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration or an ISO time: {text!r} (examples: 30d, 2027-01-31, 2027-01-31T12:00:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def _limit_value(text: str) -> int | str:
    if text == "off":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer or 'off': {text!r}")
    return value


def register(sub: Any) -> None:
    keys = sub.add_parser("keys", help="tenants' API keys: create (shown once), list, revoke")
    actions = keys.add_subparsers(dest="keys_action", required=True)
    create = actions.add_parser("create", help="a new key for a tenant (the tenant is created with its first key)")
    create.add_argument("--tenant", required=True, metavar="NAME", help="the key's tenant (a-z, 0-9, _ . -)")
    create.add_argument(
        "--role",
        choices=["user", "admin"],
        default="user",
        help="user: serving; admin: the tenant's rollouts, feedback, keys (default: user)",
    )
    create.add_argument("--expires", type=_expiry, metavar="WHEN", help="30d, 12h, or an ISO time; default: never")
    create.add_argument("--name", help="a label to tell keys apart in `keys list`")
    create.add_argument("--json", action="store_true", help="the key and its record as JSON")
    listing = actions.add_parser("list", help="keys, newest first (never the keys themselves)")
    listing.add_argument("--tenant", metavar="NAME", help="only this tenant's keys")
    listing.add_argument("--revoked", action="store_true", help="include revoked keys")
    listing.add_argument("--json", action="store_true", help="as JSON")
    revoke = actions.add_parser("revoke", help="refuse a key from now on (every gateway within 1 s)")
    revoke.add_argument("id", help="the key's id (the 12 hex digits after `cgk-`)")
    revoke.add_argument("--json", action="store_true", help="the revoked key's record as JSON")
    limit = actions.add_parser(
        "limit", help="requests and tokens per minute of a tenant (all its keys together) or of one key"
    )
    whose = limit.add_mutually_exclusive_group(required=True)
    whose.add_argument("--tenant", metavar="NAME", help="the tenant's quota (`default`: the environment's keys)")
    whose.add_argument("--key", metavar="ID", help="one key's quota")
    limit.add_argument("--rpm", type=_limit_value, metavar="N|off", help="requests per minute (off: no limit)")
    limit.add_argument(
        "--tpm", type=_limit_value, metavar="N|off", help="prompt + completion tokens per minute (off: none)"
    )
    create.add_argument("--rpm", type=_limit_value, metavar="N", help="the key's requests per minute")
    create.add_argument("--tpm", type=_limit_value, metavar="N", help="the key's tokens per minute")
    policy = actions.add_parser(
        "policy",
        help="give a tenant a policy of its own (trained on its traffic, served to its keys) or the shared one",
    )
    policy.add_argument("--tenant", required=True, metavar="NAME", help="the tenant")
    policy.add_argument("which", choices=("own", "shared"), help="own: a lineage of its own; shared: the shared policy")
    for p in (create, listing, revoke, limit, policy):
        p.add_argument("--database-url", help="SQLAlchemy URL (CLAWGATE_DATABASE_URL)")
        p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.settings import Settings
    from gateway.store import db
    from gateway.store.errors import InvalidInput, RecordNotFound

    settings = Settings()
    database = db.connect(args.database_url or settings.database_url)
    actions: dict[str, Callable[[argparse.Namespace, sa.Engine, bytes | None], None]] = {
        "create": _create,
        "list": _list,
        "limit": _limit,
        "policy": _policy,
        "revoke": _revoke,
    }
    try:
        actions[args.keys_action](args, database, settings.key_secret_bytes)
    except (InvalidInput, RecordNotFound) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        database.dispose()
    return 0


def _create(args: argparse.Namespace, database: sa.Engine, secret: bytes | None) -> None:
    from gateway.store import api_keys

    info, key = api_keys.create(
        database,
        args.tenant,
        role=args.role,
        name=args.name,
        expires_at=args.expires,
        secret=secret,
        requests_per_minute=args.rpm if args.rpm != "off" else None,
        tokens_per_minute=args.tpm if args.tpm != "off" else None,
    )
    if args.json:
        print(json.dumps({**info.as_dict(), "key": key}, indent=2))
        return
    print(key)
    expires = f", expires {info.expires_at.isoformat()}" if info.expires_at else ""
    print(
        f"key {info.id}: tenant {info.tenant}, role {info.role}{expires}. It is shown this once; only its hash is "
        "stored.",
        file=sys.stderr,
    )


def _list(args: argparse.Namespace, database: sa.Engine, secret: bytes | None) -> None:
    from gateway.store import api_keys

    found = api_keys.list_keys(database, args.tenant, revoked=args.revoked)
    if args.json:
        print(json.dumps([k.as_dict() for k in found], indent=2))
        return
    head = ("id", "tenant", "role", "created", "expires", "revoked", "rpm", "tpm")
    print(
        f"{head[0]:<12}  {head[1]:<20}  {head[2]:<5}  {head[3]:<19}  {head[4]:<19}  {head[5]:<19}  "
        f"{head[6]:>6}  {head[7]:>9}  name"
    )
    for k in found:
        rpm, tpm = k.requests_per_minute or "-", k.tokens_per_minute or "-"
        print(
            f"{k.id:<12}  {k.tenant:<20}  {k.role:<5}  {_when(k.created_at)}  {_when(k.expires_at)}  "
            f"{_when(k.revoked_at)}  {rpm:>6}  {tpm:>9}  {k.name or ''}"
        )


def _limit(args: argparse.Namespace, database: sa.Engine, secret: bytes | None) -> None:
    from gateway.store import quotas

    given = {
        name: (None if value == "off" else value)
        for name, value in (("requests_per_minute", args.rpm), ("tokens_per_minute", args.tpm))
        if value is not None
    }
    target = {"tenant": args.tenant} if args.tenant else {"key_id": args.key}
    limits = quotas.set_limits(database, **target, **given)
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    print(
        f"{'tenant ' + args.tenant if args.tenant else 'key ' + args.key}: "
        f"{rpm if rpm is not None else 'no limit of'} requests and "
        f"{tpm if tpm is not None else 'no limit of'} tokens per minute (every gateway applies it within a second)"
    )


def _policy(args: argparse.Namespace, database: sa.Engine, secret: bytes | None) -> None:
    from gateway.store import lineages
    from gateway.store.api_keys import check_tenant_name
    from gateway.store.errors import InvalidInput

    try:
        tenant = check_tenant_name(args.tenant)
    except ValueError as exc:
        raise InvalidInput(str(exc), param="tenant") from None
    own = args.which == "own"
    before = lineages.set_own_policy(database, tenant, own)
    if own and not before:
        print(
            f"tenant {tenant} has a policy of its own: the trainer starts it from the shared policy's weights and "
            "trains it on this tenant's traffic only; its keys are served it once its first version is published"
        )
    elif own:
        print(f"tenant {tenant} already has a policy of its own")
    else:
        print(f"tenant {tenant} is served the shared policy{' again' if before else ''}; its traffic trains it")


def _revoke(args: argparse.Namespace, database: sa.Engine, secret: bytes | None) -> None:
    from gateway.store import api_keys

    info = api_keys.revoke(database, args.id)
    if args.json:
        print(json.dumps(info.as_dict(), indent=2))
    else:
        print(f"revoked key {info.id} of tenant {info.tenant} (at {_when(info.revoked_at).strip()})")


def _when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else f"{'-':<19}"


__all__ = ["cmd_keys", "register"]
