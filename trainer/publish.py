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
from sqlalchemy.orm import Session

from gateway.store import policy_control, promotion
from gateway.store.models import PolicyVersion, TrainedRollout, TrainedTurn, TrainStep
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


def published_versions(db: sa.Engine) -> list[int]:
    with Session(db) as session:
        return list(session.scalars(sa.select(PolicyVersion.version).order_by(PolicyVersion.version)))


def recover(db: sa.Engine, adapter_dir: str | Path) -> int | None:
    """The newest version both on disk and in the database; orphan directories moved aside. None: start fresh.

    A version the database names whose directory is missing is an error (the adapter volume was lost or is not
    mounted): training on would fork the policy's history.
    """
    on_disk = set(lora.versions(adapter_dir))
    known = published_versions(db)
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
            "policy@v%d was written but never recorded (a crash while publishing): moved to %s; its rollouts are "
            "still unconsumed and will be trained again from the last recorded version",
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
) -> int:
    """The second half of publishing ``policy@vN`` (written to ``path``): one transaction records the train step
    (``step``: when it started, None for v0), what it consumed with its advantages, and the ``policy_versions``
    row. Returns the step's id (0 for v0)."""
    now = dt.datetime.now(dt.UTC)
    with Session(db) as session, session.begin():
        step_id = 0
        if step is not None:
            row = TrainStep(
                version=manifest.version,
                base_version=manifest.parent_version,
                algorithm=algorithm,
                status="ok",
                n_rollouts=len(consumed) + len(consumed_turns),
                n_paths=0,
                tokens_processed=int(metrics.get("tokens_processed", 0)),
                trainable_tokens=int(metrics.get("trainable_tokens", 0)),
                metrics=metrics,
                started_at=step[0],
                ended_at=now,
            )
            session.add(row)
            session.flush()
            step_id = row.id
            for rollout_id, advantage in consumed.items():
                session.add(
                    TrainedRollout(
                        rollout_id=rollout_id,
                        epoch=epoch,
                        step_id=step_id,
                        version=manifest.version,
                        advantage=advantage,
                        created_at=now,
                    )
                )
            for call_id, (rollout_id, reward, advantage) in consumed_turns.items():
                session.add(
                    TrainedTurn(
                        call_id=call_id,
                        epoch=epoch,
                        rollout_id=rollout_id,
                        step_id=step_id,
                        version=manifest.version,
                        reward=reward,
                        advantage=advantage,
                        created_at=now,
                    )
                )
        # Under guarded promotion a trained version is a candidate that must earn its traffic (gateway/promotion).
        stage = promotion.initial_stage(session, rolled_back_from=manifest.rolled_back_from)
        session.add(
            PolicyVersion(
                version=manifest.version,
                adapter_name=lora.version_name(manifest.version),
                path=str(path),
                base_model=manifest.base_model,
                status="published",
                is_current=False,
                step=step_id or None,
                metrics=metrics or None,
                created_at=now,
                parent_version=manifest.parent_version,
                rolled_back_from=manifest.rolled_back_from,
                stage=stage,
                stage_at=now,
            )
        )
        if manifest.rolled_back_from is not None:
            policy_control.complete_rollback(session, manifest.rolled_back_from)
        if stage == "promoted":
            promotion.record_published(session, manifest.version, rolled_back_from=manifest.rolled_back_from, at=now)
    return step_id


__all__ = ["ORPHANS", "TrainerBusy", "TrainerLock", "published_versions", "record_version", "recover"]
