"""The writer's files: the dead-letter file of rejected records and the pending files of unwritten ones.

Both hold one JSON record a line (``record_to_json``) and are fsync'd before the writer counts their rows as
handled. ``dead-letter.jsonl`` only grows: each line is a record the database rejected, with its error, kept so
it can be fixed and replayed by hand. ``pending-*.jsonl`` files hold what a shutdown could not commit; they are
written whole (temporary file, then rename) and read back by the next writer's ``start``.

Several gateway processes on one host may share a data directory: each writer needs a spool directory of its own
(two writers replaying one pending file would store its rewards twice). ``claim_dir`` hands each process the first
directory that no live process holds — ``spool``, ``spool-1``, ``spool-2``… — through an exclusive lock the
process keeps until it exits, so a restarted process replays what a stopped one left behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

from gateway.store.errors import describe_error
from gateway.store.models import utcnow
from gateway.store.records import Record, record_from_json, record_to_json

log = logging.getLogger("clawgate.capture")

LOCK_FILE = ".lock"
MAX_SLOTS = 256
DEAD_LETTER_FILE = "dead-letter.jsonl"
PENDING_GLOB = "pending-*.jsonl"


def claim_dir(base: Path) -> tuple[Path, IO[bytes]]:
    """The first spool directory (``base``, then ``base-1``, …) no live process holds, and its held lock file
    (close it to let the directory go; the process's exit does so too)."""
    for slot in range(MAX_SLOTS):
        path = base if slot == 0 else base.with_name(f"{base.name}-{slot}")
        path.mkdir(parents=True, exist_ok=True)
        lock = (path / LOCK_FILE).open("ab")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return path, lock
    raise RuntimeError(f"all {MAX_SLOTS} spool directories under {base.parent} are held by running processes")


def dead_letter(spool_dir: Path, dead: list[tuple[Record, str]]) -> None:
    """Append rejected records and their reasons to the dead-letter file (and to the log)."""
    if not dead:
        return
    now = utcnow().isoformat()
    lines = [
        json.dumps({"failed_at": now, "error": reason, "record": record_to_json(record)}) + "\n"
        for record, reason in dead
    ]
    for record, reason in dead:
        log.error("capture record %s dead-lettered: %s", getattr(record, "id", "?"), reason)
    try:
        spool_dir.mkdir(parents=True, exist_ok=True)
        with open(spool_dir / DEAD_LETTER_FILE, "a", encoding="utf-8") as file:
            file.writelines(lines)
            file.flush()
            os.fsync(file.fileno())
    except OSError:
        # The rows are committed-or-rejected already; the log is their last record.
        log.exception("cannot write the dead-letter file; the rejected rows follow:\n%s", "".join(lines))


def spool(spool_dir: Path, records: list[Record]) -> Path | None:
    """Write ``records`` to a new pending file; its path, or None (and the records in the log) if that failed."""
    stamp = utcnow().strftime("%Y%m%dT%H%M%S%fZ")
    path = spool_dir / f"pending-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
    lines = [json.dumps(record_to_json(record)) + "\n" for record in records]
    try:
        spool_dir.mkdir(parents=True, exist_ok=True)
        _write_whole(path, lines)
    except OSError:
        log.exception("cannot spool %d unwritten capture records; they follow:\n%s", len(records), "".join(lines))
        return None
    log.warning("spooled %d unwritten capture records to %s", len(records), path)
    return path


def load_pending(spool_dir: Path) -> tuple[list[tuple[Path, list[Record]]], int]:
    """The pending files, oldest first, each with its records, and how many unreadable lines went to the
    dead-letter file instead."""
    if not spool_dir.is_dir():
        return [], 0
    loaded: list[tuple[Path, list[Record]]] = []
    dead_lettered = 0
    for path in sorted(spool_dir.glob(PENDING_GLOB)):
        records: list[Record] = []
        unreadable: list[str] = []
        with open(path, encoding="utf-8") as file:
            for line in file:
                if not line.strip():
                    continue
                try:
                    records.append(record_from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError) as error:
                    entry = {"failed_at": utcnow().isoformat(), "error": describe_error(error), "line": line}
                    unreadable.append(json.dumps(entry) + "\n")
        if unreadable:
            log.error("%d unreadable lines in %s go to the dead-letter file", len(unreadable), path)
            with open(spool_dir / DEAD_LETTER_FILE, "a", encoding="utf-8") as file:
                file.writelines(unreadable)
            dead_lettered += len(unreadable)
        loaded.append((path, records))
    return loaded, dead_lettered


def _write_whole(path: Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` at once: a temporary file, fsync'd, renamed over it, the directory fsync'd."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        file.writelines(lines)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mentions(entry: dict[str, object], ids: frozenset[str]) -> bool:
    """Whether a dead-letter entry or pending record names one of ``ids`` (as its id, rollout or call)."""
    record = entry.get("record", entry)
    if isinstance(record, dict):
        rollout = record.get("rollout")
        named = {record.get("id"), record.get("rollout_id"), record.get("call_id"), record.get("parent_call_id")}
        if isinstance(rollout, dict):
            named.add(rollout.get("id"))
        if named & ids:
            return True
    line = entry.get("line")
    return isinstance(line, str) and any(i in line for i in ids)


def _older(entry: dict[str, object], cutoff: dt.datetime | None) -> bool:
    if cutoff is None:
        return False
    stamp = entry.get("failed_at")
    try:
        return isinstance(stamp, str) and dt.datetime.fromisoformat(stamp) < cutoff
    except ValueError:
        return False


def _rewrite(path: Path, drop: Callable[[dict[str, object]], bool]) -> int:
    """Rewrite a JSON-lines file without the lines ``drop`` names (temporary file, fsync, rename); lines removed."""
    kept: list[str] = []
    removed = 0
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"line": line}
            if isinstance(entry, dict) and drop(entry):
                removed += 1
            else:
                kept.append(line)
    if removed:
        _write_whole(path, kept)
    return removed


def clean_dir(
    spool_dir: Path, *, cutoff: dt.datetime | None = None, ids: frozenset[str] = frozenset()
) -> tuple[int, int]:
    """Remove from one spool directory what retention or a forget asks for: dead-letter and pending lines older
    than ``cutoff`` or naming one of ``ids``; a pending file left empty is deleted. Only the directory's owner may
    call it (its writer thread, or a process holding its lock). Lines and files removed."""
    lines = files = 0

    def drop(entry: dict[str, object]) -> bool:
        return _older(entry, cutoff) or (bool(ids) and _mentions(entry, ids))

    dead = spool_dir / DEAD_LETTER_FILE
    if dead.is_file():
        lines += _rewrite(dead, drop)
    for path in sorted(spool_dir.glob(PENDING_GLOB)):
        if cutoff is not None and dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC) < cutoff:
            with open(path, encoding="utf-8") as file:
                lines += sum(1 for line in file if line.strip())
            path.unlink()
            files += 1
            continue
        if ids:
            lines += _rewrite(path, lambda entry: _mentions(entry, ids))
            if path.stat().st_size == 0:
                path.unlink()
                files += 1
    return lines, files


def clean_all(
    base: Path, *, cutoff: dt.datetime | None = None, ids: frozenset[str] = frozenset()
) -> tuple[int, int, int]:
    """``clean_dir`` on every spool directory under ``base``'s parent that no running process holds (a running
    gateway cleans its own: ``CallWriter.clean_spool``). Lines and files removed, and directories skipped."""
    lines = files = held = 0
    if not base.parent.is_dir():
        return 0, 0, 0
    for path in sorted(base.parent.glob(f"{base.name}*")):
        if not path.is_dir() or not (path == base or path.name[len(base.name) :].lstrip("-").isdigit()):
            continue
        with open(path / LOCK_FILE, "ab") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1
                continue
            n_lines, n_files = clean_dir(path, cutoff=cutoff, ids=ids)
            lines, files = lines + n_lines, files + n_files
    return lines, files, held
