"""`clawgate train` as a daemon: its trigger, exactly-once consumption across SIGKILLs, recovery from a crash
between writing a version and recording it, the single-trainer lock, and what a step leaves out (evaluation
rollouts, stale rollouts, lone group members still waiting for company)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from gateway.store.db import connect
from tests.policies import publish
from tests.test_train_step import ADMIN, rollout
from trainer import lora
from trainer.config import TrainConfig
from trainer.publish import ORPHANS, TrainerBusy, TrainerLock, recover
from trainer.step import Trainer

ROOT = Path(__file__).resolve().parent.parent


def train_cmd(model: Path, url: str, adapters: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clawgate.cli",
        "train",
        "--model",
        str(model),
        "--database-url",
        url,
        "--adapter-dir",
        str(adapters),
        "--lr",
        "0.01",
        "--interval",
        "0.2",
        *extra,
    ]


class Daemon:
    """A `clawgate train` child whose stderr lines are collected (and can be waited for)."""

    def __init__(self, cmd: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CLAWGATE_POLICY_FOLLOW": "false"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_line(self, needle: str, timeout: float = 120.0, start: int = 0, poll: float = 0.05) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(start, len(self.lines)):
                if needle in self.lines[i]:
                    return i
            if self.proc.poll() is not None and not any(needle in x for x in self.lines[start:]):
                time.sleep(0.2)
                if not any(needle in x for x in self.lines[start:]):
                    raise AssertionError(f"trainer exited ({self.proc.returncode}) before {needle!r}:\n" + self.output)
            time.sleep(poll)
        raise AssertionError(f"no {needle!r} within {timeout}s:\n{self.output}")

    @property
    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def kill_in_step(self, url: str, delay: float) -> bool:
        """SIGKILL the trainer ``delay`` s after it logged a step's start: True when the kill landed inside the step
        (the step's version, recorded with its commit at the step's end, is not in the database after the kill)."""
        self.wait_line("step from policy@", poll=0.002)
        recorded = len(recorded_versions(url))
        time.sleep(delay)
        self.proc.kill()
        self.proc.wait(30)
        return len(recorded_versions(url)) == recorded

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reader.join(timeout=5)
        return self.proc.wait()


def consumed(url: str) -> list[tuple[str, int]]:
    engine = connect(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT rollout_id, version FROM trained_rollouts ORDER BY version")).all()
    engine.dispose()
    return [(r[0], r[1]) for r in rows]


def recorded_versions(url: str) -> list[int]:
    engine = connect(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT version FROM policy_versions ORDER BY version")).all()
    engine.dispose()
    return [r[0] for r in rows]


def train_until_consumed(model: Path, url: str, adapters: Path, expected: set[str], timeout: float = 180) -> None:
    """Run an undisturbed daemon until every rollout in ``expected`` has been consumed."""
    daemon = Daemon(train_cmd(model, url, adapters, "--min-rollouts", "1", "--group-wait", "0"))
    try:
        deadline = time.monotonic() + timeout
        while {r for r, _ in consumed(url)} != expected:
            assert time.monotonic() < deadline, daemon.output
            time.sleep(0.2)
    finally:
        daemon.stop()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The trainer's Prometheus text, parsed: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_daemon_waits_for_its_trigger_then_trains(gateway_factory, tiny_model_dir, tmp_path, store_url):
    """Also the training metrics where RL users look: the trainer's own /metrics (parsed as Prometheus text) and
    TensorBoard event files, read back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import free_port

    gw = gateway_factory(admin_key="adm", policy_follow=False, database_url=store_url)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    first = [rollout(gw, "A", 1.0), rollout(gw, "A", 0.0)]
    port, runs = free_port(), tmp_path / "runs"
    extra = ("--metrics-port", str(port), "--log-to", "tensorboard", "--log-dir", str(runs))
    daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-rollouts", "4", "--max-steps", "2", *extra))
    try:
        daemon.wait_line("waiting: 2/4 rollouts ready")
        assert recorded_versions(url) == [0], "no step below the trigger"
        waiting = scrape(port)
        assert waiting[("clawgate_trainer_ready", (("kind", "rollouts"),))] == 2
        assert ("clawgate_trainer_steps_total", (("status", "ok"),)) not in waiting
        second = [rollout(gw, "B", 1.0), rollout(gw, "B", 0.0)]
        daemon.wait_line("-> policy@v1")
        stepped = scrape(port)
        assert stepped[("clawgate_trainer_steps_total", (("status", "ok"),))] == 1
        assert stepped[("clawgate_trainer_version", ())] == 1
        assert stepped[("clawgate_trainer_ready", (("kind", "rollouts"),))] == 0, "all four consumed"
        assert stepped[("clawgate_trainer_step_seconds", ())] > 0
        assert stepped[("clawgate_trainer_tokens_per_second", ())] > 0
        assert ("clawgate_trainer_loss", ()) in stepped and ("clawgate_trainer_reward_mean", ()) in stepped
        third = [rollout(gw, "A", 0.0), rollout(gw, "A", 0.5), rollout(gw, "C", 1.0), rollout(gw, "C", 0.0)]
        daemon.wait_line("-> policy@v2")
        assert daemon.proc.wait(60) == 0, "--max-steps 2 ends the daemon"
    finally:
        daemon.stop()
    trained = consumed(url)
    assert sorted(r for r, _ in trained) == sorted(first + second + third), "each ready rollout once"
    assert {r for r, v in trained if v == 1} == set(first + second)
    assert recorded_versions(url) == [0, 1, 2]
    events = EventAccumulator(str(runs / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2], "one point per published version"
    assert [e.step for e in events.Scalars("train/reward_mean")] == [1, 2]
    assert "train/tokens_per_second" in events.Tags()["scalars"]


def test_sigkill_mid_step_loses_nothing_and_trains_nothing_twice(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    made: list[str] = []
    landed: list[bool] = []
    # Later and later inside the step (packing, backward, saving, committing: on three rollouts of ~300 tokens a step
    # takes 0.15-0.2 s on an idle 2-core machine, more on a loaded one); each kill says where it landed.
    for round_, delay in enumerate([0.0, 0.04, 0.08, 0.12]):
        made += [rollout(gw, f"T{round_}", reward, turns=4, max_tokens=64) for reward in (1.0, 0.0, 0.5)]
        daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-rollouts", "3"))
        try:
            landed.append(daemon.kill_in_step(url, delay))
        finally:
            daemon.stop()
    # A last, undisturbed run consumes whatever the killed ones did not commit.
    train_until_consumed(tiny_model_dir, url, adapters, set(made))
    trained = consumed(url)
    assert len(trained) == len(made) == len({r for r, _ in trained}), "every rollout trained exactly once"
    versions = recorded_versions(url)
    assert versions == list(range(len(versions))), "versions are contiguous"
    # Every recorded version has its directory; directories the database never recorded were moved aside.
    assert lora.versions(adapters) == versions
    assert landed[0] and landed.count(True) >= 2, f"kills inside a step: {landed}"


def test_recover_moves_an_unrecorded_version_aside(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    ids = [rollout(gw, "A", 1.0), rollout(gw, "A", 0.0)]
    db = connect(url)
    try:
        config = TrainConfig(model=str(tiny_model_dir), database_url=url, adapter_dir=adapters, lr=0.01)
        trainer = Trainer(config, db)  # publishes v0
        # A crash after writing policy@v1 but before its transaction: the directory exists, the database does not
        # know it, the rollouts are unconsumed.
        lora.save_version(trainer.policy, adapters, lora.Manifest(version=1, base_model=str(tiny_model_dir)))
        assert recover(db, adapters) == 0
        assert lora.versions(adapters) == [0]
        assert [p.name.split("-")[0] for p in (adapters / ORPHANS).iterdir()] == ["policy@v1"]
        resumed = Trainer(config, db)
        assert resumed.version == 0
        result = resumed.step()
        assert result is not None and result.version == 1 and result.trained_rollouts == 2
        assert sorted(r for r, _ in consumed(url)) == sorted(ids)
        # A version the database knows but the disk lost is an error, not a silent fork.
        (adapters / "policy@v1").rename(tmp_path / "lost")
        with pytest.raises(FileNotFoundError, match="policy versions"):
            recover(db, adapters)
    finally:
        db.dispose()


def test_one_trainer_per_adapter_directory(tmp_path, sqlite_url, tiny_model_dir):
    adapters = tmp_path / "adapters"
    with TrainerLock(adapters):
        with pytest.raises(TrainerBusy):
            TrainerLock(adapters).acquire()
        second = subprocess.run(
            train_cmd(tiny_model_dir, sqlite_url, adapters),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert second.returncode == 3 and "another trainer" in second.stderr
    TrainerLock(adapters).acquire()  # released with its holder


def test_step_leaves_out_eval_stale_and_waiting_rollouts(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    evaluation = httpx.post(
        gw.url + "/v1/rollouts", json={"task_id": "A", "harness": "sdk", "eval": True}, headers=ADMIN
    ).json()
    assert evaluation["eval"] is True
    httpx.post(f"{gw.url}/v1/rollouts/{evaluation['id']}/reward", json={"value": 1.0}, headers=ADMIN)
    httpx.post(f"{gw.url}/v1/rollouts/{evaluation['id']}/finish", json={"status": "completed"}, headers=ADMIN)
    pair = [rollout(gw, "A", 1.0), rollout(gw, "A", 0.0)]
    lonely = rollout(gw, "B", 1.0)
    db = connect(url)
    try:
        config = TrainConfig(
            model=str(tiny_model_dir), database_url=url, adapter_dir=adapters, lr=0.01, group_wait=3600
        )
        result = Trainer(config, db).step()
        assert result is not None
        trained = {r for r, _ in consumed(url)}
        assert trained == set(pair), "eval rollouts are never trained; a lone member waits for its group"
        # Versions v1..v4 pass; the rollouts below were served by the base model (v0): 4 versions behind.
        for v in range(2, 5):
            publish(url, adapters, tiny_model_dir, v)
        stale = [rollout(gw, "C", 1.0), rollout(gw, "C", 0.0)]
        config.max_staleness, config.group_wait = 2, 0.0
        result = Trainer(config, db).step()
        assert result is not None and result.version == 5
        # The lone rollout from before waited long enough (group_wait 0 now) but is as stale as the new pair.
        for r in (*stale, lonely):
            assert result.skipped[r] == "stale: served by policy@v0, 4 versions behind"
        assert result.metrics["rollouts_stale"] == 3.0 and result.trained_rollouts == 0
        assert {r for r, _ in consumed(url)} == {*pair, lonely, *stale}, "stale rollouts are consumed, reported"
        assert evaluation["id"] not in {r for r, _ in consumed(url)}
    finally:
        db.dispose()
