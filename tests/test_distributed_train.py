"""``clawgate train`` under ``torchrun`` on two CPU processes (gloo): the same step as one process, only rank 0 on the
database, and a rank that dies mid-step publishes nothing.

The data: turns of everyday traffic served by the tiny model through a gateway, rewarded with variance, in one
SQLite database that is copied so that a one-process run and a two-process run start from the same state. Each
two-rank case runs with the base whole on both ranks and sharded over them (``--shard``, FSDP2).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
import yaml
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
    """A copy through SQLite's backup API: the database runs in WAL mode, so a copy of the main file alone can miss
    the last commits while a connection to it still lingers."""
    where.mkdir(parents=True)
    source, target = sqlite3.connect(ready_db), sqlite3.connect(where / "db.sqlite")
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()
    return f"sqlite:///{where / 'db.sqlite'}"


def train(
    model: Path,
    url: str,
    adapters: Path,
    *,
    ranks: int,
    env: dict[str, str] | None = None,
    algorithm: str = "grpo",
    extra: tuple[str, ...] = (),
) -> Any:
    flags = ["train", "--once", "--model", str(model), "--database-url", url, "--adapter-dir", str(adapters)]
    flags += ["--lr", "0.01", "--max-tokens-per-rank", "48", "--threads", "1", "--algorithm", algorithm, *extra]
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


@pytest.mark.parametrize(
    ("algorithm", "shard"), [("grpo", False), ("ppo", False), ("grpo", True), ("ppo", True)], ids=str
)
def test_two_ranks_take_the_step_one_process_takes(ready_db, tiny_model_dir, tmp_path, algorithm, shard):
    """Data-parallel, with the base whole on each rank or sharded over the two (``--shard``, FSDP2)."""
    one = copy_of(ready_db, tmp_path / "one")
    two = copy_of(ready_db, tmp_path / "two")
    alone = train(tiny_model_dir, one, tmp_path / "one" / "adapters", ranks=1, algorithm=algorithm)
    assert alone.returncode == 0, alone.stderr
    extra = ("--shard",) if shard else ()
    pair = train(tiny_model_dir, two, tmp_path / "two" / "adapters", ranks=2, algorithm=algorithm, extra=extra)
    assert pair.returncode == 0, pair.stderr[-4000:]

    # The same data consumed, the same adapter within float tolerance: the ranks add their gradients in another
    # order than one process does, and Adam's first step is lr * g / (|g| + eps), so a weight whose gradient is
    # within a few eps of zero can move by a visible share of lr = 1e-2 on that order alone (typically 1e-6, once
    # 1.05e-5). Tolerance: 1e-4, a hundredth of the step; a micro-batch lost or counted twice moves weights by a
    # good part of lr.
    assert trained(one)[0] == trained(two)[0] and len(trained(one)[0]) == 6
    a, b = weights(tmp_path / "one" / "adapters", 1), weights(tmp_path / "two" / "adapters", 1)
    assert a.keys() == b.keys()
    moved = max(float((a[k] - weights(tmp_path / "one" / "adapters", 0)[k]).abs().max()) for k in a)
    assert moved > 1e-4, "the step changed the adapter"
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
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
    if shard:  # each rank held half of the base's weights
        held = re.findall(r"rank (\d)/2: holds (\d+) of the base's (\d+) weights", pair.stderr)
        assert sorted(r for r, _, _ in held) == ["0", "1"], pair.stderr[-3000:]
        assert sum(int(h) for _, h, _ in held) == int(held[0][2]) and all(2 * int(h) < int(t) + 64 for _, h, t in held)


def test_a_sharded_step_in_bfloat16_with_activation_checkpointing_moves_the_adapter_the_same_way(
    ready_db, tiny_model_dir, tmp_path
):
    """``--shard --mixed-precision bf16 --activation-checkpointing``: the base computes in bfloat16, so the step is
    not the float32 one to 1e-4, but it goes the same way."""
    one = copy_of(ready_db, tmp_path / "one")
    two = copy_of(ready_db, tmp_path / "two")
    assert train(tiny_model_dir, one, tmp_path / "one" / "adapters", ranks=1).returncode == 0
    extra = ("--shard", "--mixed-precision", "bf16", "--activation-checkpointing")
    pair = train(tiny_model_dir, two, tmp_path / "two" / "adapters", ranks=2, extra=extra)
    assert pair.returncode == 0, pair.stderr[-4000:]
    assert trained(one)[0] == trained(two)[0] and len(trained(one)[0]) == 6
    start = weights(tmp_path / "one" / "adapters", 0)
    a, b = weights(tmp_path / "one" / "adapters", 1), weights(tmp_path / "two" / "adapters", 1)
    da = torch.cat([(a[k] - start[k]).flatten() for k in sorted(a)])
    db = torch.cat([(b[k] - start[k]).flatten() for k in sorted(a)])
    # Adam's first step is about lr·sign(g) per weight: a weight whose gradient is near 0 may go the other way in
    # bfloat16; the update as a whole points the same way (cosine 0.9: measured 0.99).
    assert float(da.norm()) > 1e-2 and float(db.norm()) > 1e-2
    assert float(torch.nn.functional.cosine_similarity(da, db, dim=0)) > 0.9


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


def learning_curves(model: Path, workdir: Path, runs: list[tuple[float, int]]) -> list[list[float]]:
    """bench/learning_check.py's loop (8 prompts x 8 samples, 24 tokens, 50 target tokens, seed 0) with its trainer
    as rank 0 of two, the base sharded over them: the reward per step of each (learning rate, steps) run."""
    launch = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    script = [str(ROOT / "tests" / "torchrun_rank.py"), "learning", str(model), str(workdir)]
    script += [f"{lr}:{steps}" for lr, steps in runs]
    run = subprocess.run(
        [str(TORCHRUN), *launch, *script, "--shard"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"rank 1/2: {sum(steps for _, steps in runs)} updates" in run.stderr, "rank 1 shared every step"
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-len(runs) :]]


@pytest.mark.slow
def test_the_learning_check_rises_with_two_ranks_and_its_lr_0_control_stays_flat(tiny_model_dir, tmp_path):
    # Measured (lr 1e-2, seed 0, 2 ranks, --shard): 0.03 0.03 0.05 0.11 0.61 0.92, as on one process.
    curve, control = learning_curves(tiny_model_dir, tmp_path, [(1e-2, 6), (0.0, 2)])
    assert max(curve[:2]) < 0.1 and min(curve[-2:]) > 0.4, curve
    assert abs(control[1] - control[0]) < 0.05 and max(control) < 0.1, control


@pytest.mark.parametrize("given", ["flag", "env"])
def test_mixed_precision_without_shard_is_refused(tmp_path, given):
    """Given by the flag or by its variable (CLAWGATE_TRAIN_MIXED_PRECISION), with sharding off
    (CLAWGATE_TRAIN_SHARD=false)."""
    url = f"sqlite:///{tmp_path / 'none.db'}"
    command = [sys.executable, "-m", "clawgate.cli", "train", "--once", "--database-url", url]
    env = {**os.environ, "CLAWGATE_TRAIN_SHARD": "false"}
    if given == "flag":
        command += ["--mixed-precision", "bf16"]
    else:
        env["CLAWGATE_TRAIN_MIXED_PRECISION"] = "bf16"
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "add --shard" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "none.db").exists(), "refused before anything was opened"


def test_the_kubernetes_example_launches_what_it_says():
    """deploy/trainer-k8s.yaml: torchrun's own parser and clawgate's read its command line; as many nodes as pods, as
    many processes per node as GPUs, every setting a real one."""
    from torch.distributed.run import get_args_parser

    from clawgate.cli import build_parser
    from gateway.settings import Settings

    service, stateful_set = yaml.safe_load_all((ROOT / "deploy" / "trainer-k8s.yaml").read_text())
    [container] = stateful_set["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    launch = get_args_parser().parse_args(container["args"])
    assert launch.nnodes == str(stateful_set["spec"]["replicas"])
    assert int(launch.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"]
    host, port = launch.rdzv_endpoint.split(":")
    assert host == f"{stateful_set['metadata']['name']}-0.{service['metadata']['name']}"
    assert stateful_set["spec"]["serviceName"] == service["metadata"]["name"]
    assert int(port) == service["spec"]["ports"][0]["port"] and service["spec"]["clusterIP"] == "None"
    assert launch.module and launch.training_script == "clawgate.cli"
    train = build_parser().parse_args(launch.training_script_args)
    assert train.func.__name__ == "cmd_train" and train.train_shard and train.train_max_tokens_per_bin == 8192
    settings = [e["name"] for e in container["env"] if e["name"].startswith("CLAWGATE_")]
    assert {"CLAWGATE_DATABASE_URL", "CLAWGATE_MODEL", "CLAWGATE_ADAPTER_DIR"} <= set(settings)
    assert all(name.removeprefix("CLAWGATE_").lower() in Settings.model_fields for name in settings)
