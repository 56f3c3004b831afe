"""Export files `clawgate export` wrote, and taking forgotten rollouts out of them.

An export records its absolute path, the host it was written on and the rollout ids it holds (one JSON line each).
Forgetting rollouts (``forget.forget``: those deleted, and those that lost calls to it) rewrites each export on
this host that holds one, without those lines: written beside it and moved over it, so a reader sees the old file
or the new one. An export left with no line is deleted. An export on another host, or one moved or deleted since,
is reported, not touched: its rows stay for a forget run on its host (a missing file's rows go).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store.models import Export, ExportRollout

CHUNK = 1000


def this_host() -> str:
    return socket.gethostname()


def record(db: sa.Engine, path: Path, rollout_ids: Sequence[str]) -> int:
    """Remember that ``path`` (absolute) holds ``rollout_ids``; the export's id."""
    with Session(db) as session, session.begin():
        export = Export(path=str(path.resolve()), host=this_host())
        session.add(export)
        session.flush()
        ids = list(dict.fromkeys(rollout_ids))
        for start in range(0, len(ids), CHUNK):
            session.execute(
                sa.insert(ExportRollout),
                [{"export_id": export.id, "rollout_id": r} for r in ids[start : start + CHUNK]],
            )
        return export.id


@dataclass
class Cleanup:
    """What taking rollouts out of export files did."""

    rewritten: list[str] = field(default_factory=list)  # paths rewritten without them (or deleted: left empty)
    lines: int = 0  # lines removed
    elsewhere: list[str] = field(default_factory=list)  # "host:path" of exports on another host, not touched
    missing: list[str] = field(default_factory=list)  # paths no longer there (their rows are dropped)


def _holding(session: Session, rollout_ids: Sequence[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for start in range(0, len(rollout_ids), CHUNK):
        rows = session.execute(
            sa.select(ExportRollout.export_id, ExportRollout.rollout_id).where(
                ExportRollout.rollout_id.in_(rollout_ids[start : start + CHUNK])
            )
        )
        for export_id, rollout_id in rows:
            out.setdefault(export_id, set()).add(rollout_id)
    return out


def _rewrite(path: Path, drop: set[str]) -> tuple[int, int]:
    """``path`` without the lines whose ``id`` is in ``drop``: (lines removed, lines kept). Only a regular file
    (never through a symbolic link) is rewritten."""
    if path.is_symlink() or not path.is_file():
        raise FileNotFoundError(path)
    removed = kept = 0
    temporary = path.with_name(f".{path.name}.forget-{os.getpid()}")
    try:
        with path.open("rb") as source, temporary.open("wb") as target:
            for line in source:
                try:
                    rollout_id = orjson.loads(line).get("id") if line.strip() else None
                except orjson.JSONDecodeError:
                    rollout_id = None
                if rollout_id in drop:
                    removed += 1
                    continue
                target.write(line)
                kept += line.strip() != b""
            target.flush()
            os.fsync(target.fileno())
        if removed:
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    if removed and not kept:
        path.unlink()
    return removed, kept


def remove_rollouts(db: sa.Engine, rollout_ids: Iterable[str]) -> Cleanup:
    """Take ``rollout_ids`` out of every export on this host that holds them."""
    ids = sorted(set(rollout_ids))
    cleanup = Cleanup()
    if not ids:
        return cleanup
    host = this_host()
    with Session(db) as session:
        holding = _holding(session, ids)
        exports = {e.id: e for e in session.scalars(sa.select(Export).where(Export.id.in_(sorted(holding))))}
    for export_id, drop in sorted(holding.items()):
        export = exports[export_id]
        if export.host != host:
            cleanup.elsewhere.append(f"{export.host}:{export.path}")
            continue
        try:
            removed, kept = _rewrite(Path(export.path), drop)
        except FileNotFoundError:
            cleanup.missing.append(export.path)
            removed, kept = 0, 0
        else:
            cleanup.lines += removed
            if removed:
                cleanup.rewritten.append(export.path)
        with Session(db) as session, session.begin():
            held = sa.delete(ExportRollout).where(ExportRollout.export_id == export_id)
            if kept:
                session.execute(held.where(ExportRollout.rollout_id.in_(sorted(drop))))
            else:  # the file is gone, or left empty and deleted
                session.execute(held)
                session.execute(sa.delete(Export).where(Export.id == export_id))
    return cleanup
