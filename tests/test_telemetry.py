"""Training metrics sinks: Prometheus counts steps and failures, a broken sink is switched off without stopping
training, Weights & Biases logs each step (offline mode, found in the run file), and only known loggers
are accepted."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import Settings
from tests.conftest import free_port
from trainer import telemetry
from trainer.plan import StepResult


def result(version: int, loss: float) -> StepResult:
    metrics = {"loss": loss, "reward_mean": 0.5, "approx_kl": 0.01, "tokens_processed": 2000.0, "bad": float("nan")}
    return StepResult(version, version, 4, 4, {}, metrics, 2.0)


def test_values_are_finite_and_derived():
    values = telemetry.scalars(result(1, 0.3))
    assert "bad" not in values and values["tokens_per_second"] == 1000.0 and values["step_seconds"] == 2.0


def test_prometheus_counts_steps_and_failures():
    port = free_port()
    sink = telemetry.PrometheusSink(port, backlog=lambda: (3, 7), host="127.0.0.1")
    try:
        metrics = telemetry.Telemetry([sink])
        metrics.step(result(1, 0.4))
        metrics.step(result(2, 0.2))
        metrics.failure(RuntimeError("boom"))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        sink.close()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("clawgate_trainer_steps_total", (("status", "ok"),))] == 2
    assert samples[("clawgate_trainer_steps_total", (("status", "failed"),))] == 1
    assert samples[("clawgate_trainer_version", ())] == 2 and samples[("clawgate_trainer_loss", ())] == 0.2
    assert samples[("clawgate_trainer_kl", ())] == 0.01
    assert samples[("clawgate_trainer_ready", (("kind", "rollouts"),))] == 3
    assert samples[("clawgate_trainer_ready", (("kind", "turns"),))] == 7


def test_a_broken_sink_is_switched_off_and_the_others_go_on(caplog):
    class Broken:
        def step(self, version: int, values: dict[str, float]) -> None:
            raise OSError("disk full")

        def failure(self, error: BaseException) -> None: ...

        def close(self) -> None: ...

    good = telemetry.PrometheusSink(None)
    metrics = telemetry.Telemetry([Broken(), good])
    with caplog.at_level(logging.WARNING):
        metrics.step(result(1, 0.4))
        metrics.step(result(2, 0.3))
    assert metrics.sinks == [good]
    assert sum("disk full" in r.getMessage() for r in caplog.records) == 1, "said once"
    assert good.version._value.get() == 2


def test_wandb_logs_each_step_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = telemetry.WandbSink(tmp_path, {"lr": 1e-5})
    metrics = telemetry.Telemetry([sink])
    metrics.step(result(1, 0.4))
    metrics.step(result(2, 0.25))
    metrics.close()
    # The offline run file holds wandb's protobuf records (no reader ships with wandb): the logged keys and values
    # are in it as JSON text. wandb's service process writes the file and closes it after finish() has returned
    # (on a loaded machine the test once read only its 7-byte header), so the check waits for it a while.
    [run] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    wanted = (b"train/loss", b"0.25", b"train/tokens_per_second")
    deadline = time.monotonic() + 60
    while not all(w in run.read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    data = run.read_bytes()
    assert all(w in data for w in wanted), data[:200]


@pytest.mark.parametrize(("value", "ok"), [("tensorboard", True), ("wandb, tensorboard", True), ("tb", False)])
def test_only_known_loggers_are_accepted(value, ok):
    if ok:
        assert Settings(train_log_to=value).train_log_to
    else:
        with pytest.raises(ValueError, match="unknown logger tb"):
            Settings(train_log_to=value)
