"""Where a trainer resumes, and making sure only one trainer writes versions.

A version is published in two steps: its directory ``policy@vN`` is written (atomically, by rename), then one
database transaction records the step, the rollouts it consumed and the ``policy_versions`` row — the row is what
gateways follow. A crash between the two leaves a directory no row names: an orphan, trained on rollouts that
are still unconsumed in the database. Resuming from it would train those rollouts twice, so ``recover`` resumes
from the newest version the database knows and moves orphans aside (``.orphans/``, kept for inspection) so that
their version numbers are free again.

Two trainers on one adapter directory would race for version numbers; ``TrainerLock`` (an exclusive ``flock`` on
``<adapter_dir>/.trainer.lock``, released by the kernel when the process dies, however it dies) refuses the second.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType

import sqlalchemy as sa

from gateway.store import policy_versions, train_steps
from trainer import lora

log = logging.getLogger("clawgate.trainer")

ORPHANS = ".orphans"


class TrainerBusy(RuntimeError):
    """Another trainer holds the adapter directory."""


class TrainerLock:
    def __init__(self, adapter_dir: str | Path) -> None:
        self.path = Path(adapter_dir) / ".trainer.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TrainerBusy(f"another trainer is using {self.path.parent} (lock {self.path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TrainerLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def recover(db: sa.Engine, adapter_dir: str | Path) -> int | None:
    """The newest version both on disk and in the database; orphan directories moved aside. None: start fresh.

    A version the database names whose directory is missing is an error (the adapter volume was lost or is not
    mounted): training on would fork the policy's history.
    """
    on_disk = set(lora.versions(adapter_dir))
    known = policy_versions.published(db)
    missing = [v for v in known if v not in on_disk]
    if missing:
        raise FileNotFoundError(
            f"the database lists policy versions {missing[:5]} that are not in {Path(adapter_dir).resolve()}: "
            "is the adapter directory the one this database was trained with?"
        )
    orphans = sorted(v for v in on_disk if v not in set(known))
    for version in orphans:
        source = lora.version_path(adapter_dir, version)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%f")
        target = Path(adapter_dir) / ORPHANS / f"{source.name}-{stamp}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(source), str(target))
        log.warning(
            "policy@v%d was written but never recorded (a crash or a failure while publishing): moved to %s; its "
            "rollouts are still unconsumed and will be trained again from the last recorded version",
            version,
            target,
        )
    return known[-1] if known else None


def record_version(
    db: sa.Engine,
    manifest: lora.Manifest,
    path: Path,
    *,
    algorithm: str,
    epoch: int,
    step: tuple[dt.datetime, dict[str, float]] | None,
    consumed: dict[str, float | None],
    consumed_turns: dict[str, tuple[str, float | None, float | None]],
    metrics: dict[str, float],
    gated: bool = False,
) -> int:
    """The second half of publishing ``policy@vN`` (written to ``path``): one transaction (``train_steps.publish``)
    records the train step
    (``step``: when it started, None for v0), what it consumed with its advantages, and the ``policy_versions``
    row. Returns the step's id (0 for v0)."""
    new = policy_versions.NewVersion(
        version=manifest.version,
        adapter_name=lora.version_name(manifest.version),
        path=str(path),
        base_model=manifest.base_model,
        parent_version=manifest.parent_version,
        rolled_back_from=manifest.rolled_back_from,
        lineage=manifest.lineage,
    )
    return train_steps.publish(
        db,
        new,
        algorithm=algorithm,
        epoch=epoch,
        started=step[0] if step is not None else None,
        consumed=consumed,
        consumed_turns=consumed_turns,
        metrics=metrics,
        gated=gated,
    )


__all__ = ["ORPHANS", "TrainerBusy", "TrainerLock", "record_version", "recover"]
