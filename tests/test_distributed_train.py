"""``clawgate train`` under ``torchrun`` on two CPU processes (gloo): the same step as one process, only rank 0 on the
database, and a rank that dies mid-step publishes nothing.

The data: turns of everyday traffic served by the tiny model through a gateway, rewarded with variance, in one
SQLite database that is copied so that a one-process run and a two-process run start from the same state.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from safetensors.torch import load_file
from sqlalchemy.orm import Session

from gateway.store.db import connect
from gateway.store.models import TrainedTurn, TrainStep
from tests.test_turn_training import feedback, two_turns
from trainer import lora

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.fixture(scope="module")
def ready_db(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A database with 6 ready turns (rewards 0..5), served by the tiny model, and nothing trained yet."""
    from gateway.settings import Settings
    from gateway.store import db
    from tests.conftest import free_port, start_gateway, stop_gateway

    tmp = tmp_path_factory.mktemp("ready")
    url = f"sqlite:///{tmp / 'gw.db'}"
    db.upgrade(url)
    gw = start_gateway(
        Settings(
            model=str(tiny_model_dir),
            served_model_name="tiny",
            database_url=url,
            port=free_port(),
            data_dir=tmp / "data",
            admin_key="adm",
            policy_follow=False,
        )
    )
    try:
        for i in range(6):
            first, _, _ = two_turns(gw, None, i)
            feedback(gw, first, float(i))
        gw.flush()
    finally:
        stop_gateway(gw)
    return tmp / "gw.db"


def copy_of(ready_db: Path, where: Path) -> str:
    where.mkdir(parents=True)
    shutil.copy(ready_db, where / "db.sqlite")
    return f"sqlite:///{where / 'db.sqlite'}"


def train(
    model: Path, url: str, adapters: Path, *, ranks: int, env: dict[str, str] | None = None, algorithm: str = "grpo"
) -> Any:
    flags = ["train", "--once", "--model", str(model), "--database-url", url, "--adapter-dir", str(adapters)]
    flags += ["--lr", "0.01", "--max-tokens-per-bin", "48", "--threads", "1", "--algorithm", algorithm]
    if ranks == 1:
        command = [sys.executable, "-m", "clawgate.cli", *flags]
    else:
        launch = ["--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "0"]
        command = [str(TORCHRUN), *launch, str(ROOT / "tests" / "torchrun_rank.py"), *flags]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def weights(adapters: Path, version: int, name: str = "adapter_model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(lora.version_path(adapters, version) / name))


def trained(url: str) -> tuple[list[str], list[TrainStep]]:
    engine = connect(url)
    try:
        with Session(engine, expire_on_commit=False) as session:
            turns = sorted(session.scalars(sa.select(TrainedTurn.call_id)))
            return turns, list(session.scalars(sa.select(TrainStep)))
    finally:
        engine.dispose()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_ranks_take_the_step_one_process_takes(ready_db, tiny_model_dir, tmp_path, algorithm):
    one = copy_of(ready_db, tmp_path / "one")
    two = copy_of(ready_db, tmp_path / "two")
    alone = train(tiny_model_dir, one, tmp_path / "one" / "adapters", ranks=1, algorithm=algorithm)
    assert alone.returncode == 0, alone.stderr
    pair = train(tiny_model_dir, two, tmp_path / "two" / "adapters", ranks=2, algorithm=algorithm)
    assert pair.returncode == 0, pair.stderr[-4000:]

    # The same data consumed, the same adapter within float tolerance: the ranks add their gradients in another
    # order than one process does, and Adam's first step divides by the gradients' size, so a weight may differ by
    # about 1e-6 where the step moved it by up to lr = 1e-2. Tolerance: 1e-5, a thousandth of the step.
    assert trained(one)[0] == trained(two)[0] and len(trained(one)[0]) == 6
    a, b = weights(tmp_path / "one" / "adapters", 1), weights(tmp_path / "two" / "adapters", 1)
    assert a.keys() == b.keys()
    moved = max(float((a[k] - weights(tmp_path / "one" / "adapters", 0)[k]).abs().max()) for k in a)
    assert moved > 1e-4, "the step changed the adapter"
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    if algorithm == "ppo":  # the value head was trained on both ranks' gradients too
        head = "value_head.safetensors"
        ha, hb = weights(tmp_path / "one" / "adapters", 1, head), weights(tmp_path / "two" / "adapters", 1, head)
        h0 = weights(tmp_path / "one" / "adapters", 0, head)
        # Adam's first step moves the head's weights by about critic_lr (1e-5); tolerance a thousandth of that.
        assert max(float((ha[k] - h0[k]).abs().max()) for k in ha) > 5e-6
        assert max(float((ha[k] - hb[k]).abs().max()) for k in ha) < 1e-8

    # One line per rank; the ranks' tokens add up to the step's trainable tokens.
    lines = re.findall(r"rank (\d)/2: (\d+) tokens", pair.stderr)
    assert sorted(r for r, _ in lines) == ["0", "1"], pair.stderr[-3000:]
    [step] = trained(two)[1]
    assert sum(int(n) for _, n in lines) == int(step.trainable_tokens) > 0
    assert all(int(n) > 0 for _, n in lines), "both ranks trained"
    # Rank 1 had a database URL nothing answers on (tests/torchrun_rank.py): it never opened it.
    assert "rank 1/2: 1 updates" in pair.stderr


def test_a_rank_that_dies_mid_step_publishes_nothing_and_the_restart_trains_each_turn_once(
    ready_db, tiny_model_dir, tmp_path
):
    url = copy_of(ready_db, tmp_path / "run")
    adapters = tmp_path / "run" / "adapters"
    # Rank 1 vanishes without an error code (torchrun leaves rank 0 running): rank 0's next collective fails.
    dead = train(tiny_model_dir, url, adapters, ranks=2, env={"CLAWGATE_TEST_RANK_DIES": "0"})
    assert dead.returncode != 0
    assert "another trainer rank is gone" in dead.stderr and "nothing was published" in dead.stderr, dead.stderr[-3000:]
    assert trained(url) == ([], []), "nothing consumed, no step recorded"
    assert sorted(v for v in lora.versions(adapters)) == [0]
    # The restarted trainer (one process here) trains every turn, once.
    again = train(tiny_model_dir, url, adapters, ranks=1)
    assert again.returncode == 0, again.stderr
    turns, steps = trained(url)
    assert len(turns) == len(set(turns)) == 6 and len(steps) == 1
