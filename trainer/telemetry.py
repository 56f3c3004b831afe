"""Training metrics where RL users look: Prometheus, TensorBoard, Weights & Biases.

The daemon reports every published step and every failed one to a ``Telemetry``, which hands them to its sinks:

- **Prometheus** (``--metrics-port``): ``clawgate_trainer_*`` series on the trainer's own ``/metrics`` — steps by
  status, the last step's loss, reward, KL, entropy, grad norm, tokens/s, seconds and staleness, the published
  version, and the ready backlog (rollouts and turns), read from the store at scrape time.
- **TensorBoard** (``--log-to tensorboard``, extra ``clawgate[tensorboard]``): one scalar per metric per step in
  ``<log-dir>/tensorboard``, step = policy version.
- **Weights & Biases** (``--log-to wandb``, extra ``clawgate[wandb]``): ``wandb.log`` per step; ``WANDB_MODE``,
  ``WANDB_PROJECT`` and the API key come from wandb's own environment variables.

A sink that fails (a full disk, W&B unreachable) is logged once and dropped; training never stops for telemetry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from trainer.plan import StepResult

log = logging.getLogger("clawgate.trainer")
SINKS = ("tensorboard", "wandb")


def scalars(result: StepResult) -> dict[str, float]:
    """The step's figures as plain finite floats (what every sink logs)."""
    out = {k: float(v) for k, v in result.metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
    out["step_seconds"] = result.seconds
    out["rollouts_trained"] = float(result.trained_rollouts)
    out["turns_trained"] = float(result.trained_turns)
    tokens = result.metrics.get("tokens_processed")
    if isinstance(tokens, int | float) and result.seconds > 0:
        out["tokens_per_second"] = float(tokens) / result.seconds
    return out


class Sink(Protocol):
    def step(self, version: int, values: dict[str, float]) -> None: ...

    def failure(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


# Step figure -> (Prometheus series, help) of the gauges that hold the newest step's value.
GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("clawgate_trainer_loss", "policy loss of the newest step, per trainable token (trainer/update.py)"),
    "reward_mean": ("clawgate_trainer_reward_mean", "mean rollout reward of the newest step"),
    "turn_reward_mean": ("clawgate_trainer_turn_reward_mean", "mean turn reward of the newest step"),
    "approx_kl": ("clawgate_trainer_kl", "approximate KL to the sampling policy in the newest step"),
    "entropy": ("clawgate_trainer_entropy", "mean entropy of the trained tokens in the newest step"),
    "grad_norm": ("clawgate_trainer_grad_norm", "gradient norm of the newest step"),
    "tokens_per_second": ("clawgate_trainer_tokens_per_second", "tokens processed per second, newest step"),
    "step_seconds": ("clawgate_trainer_step_seconds", "wall seconds of the newest step"),
    "staleness_max": ("clawgate_trainer_staleness", "versions between the data and the policy, newest step"),
}


class PrometheusSink:
    """The trainer's ``/metrics`` (its own registry, so tests and several trainers in one process never clash)."""

    def __init__(
        self,
        port: int | None,
        backlog: Callable[[], tuple[int, int]] | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("clawgate_trainer_steps", "train steps by outcome", ["status"], registry=self.registry)
        self.version = Gauge("clawgate_trainer_version", "the newest published policy version", registry=self.registry)
        self.gauges = {key: Gauge(name, text, registry=self.registry) for key, (name, text) in GAUGES.items()}
        self._backlog = backlog
        self._last_backlog = (0, 0)
        ready = Gauge("clawgate_trainer_ready", "data ready to train on", ["kind"], registry=self.registry)
        ready.labels("rollouts").set_function(lambda: self._read_backlog()[0])
        ready.labels("turns").set_function(lambda: self._read_backlog()[1])
        self.server: Any = None
        if port is not None:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)

    def _read_backlog(self) -> tuple[int, int]:
        if self._backlog is None:
            return self._last_backlog
        try:
            self._last_backlog = self._backlog()
        except Exception as exc:  # the database is down: the last figures stay (the loop reports the outage)
            log.debug("ready backlog unavailable for /metrics: %s", exc)
        return self._last_backlog

    def step(self, version: int, values: dict[str, float]) -> None:
        self.steps.labels("ok").inc()
        self.version.set(version)
        for key, gauge in self.gauges.items():
            if key in values:
                gauge.set(values[key])

    def failure(self, error: BaseException) -> None:
        self.steps.labels("failed").inc()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # the package is an optional extra
            raise RuntimeError(
                "--log-to tensorboard needs the tensorboard package: pip install 'clawgate[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def step(self, version: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"train/{key}", value, global_step=version)
        self.writer.flush()

    def failure(self, error: BaseException) -> None:
        self.writer.add_text("train/failure", f"{type(error).__name__}: {error}")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("--log-to wandb needs the wandb package: pip install 'clawgate[wandb]'") from exc
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(dir=str(log_dir), config=config, job_type="train", reinit="finish_previous")

    def step(self, version: int, values: dict[str, float]) -> None:
        self.run.log({f"train/{k}": v for k, v in values.items()}, step=version)

    def failure(self, error: BaseException) -> None:
        self.run.log({"train/failures": 1})

    def close(self) -> None:
        self.run.finish()


class Telemetry:
    """Fans a step (or a failure) out to every sink; a sink that raises is logged once and dropped."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def _each(self, what: str, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:
                log.warning("%s: %s failed (%s); it is switched off", what, type(sink).__name__, exc)
                self.sinks.remove(sink)

    def step(self, result: StepResult) -> None:
        values = scalars(result)
        self._each("training metrics", lambda s: s.step(result.version, values))

    def failure(self, error: BaseException) -> None:
        self._each("training metrics", lambda s: s.failure(error))

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("closing %s: %s", type(sink).__name__, exc)


def parse_log_to(value: str | None) -> list[str]:
    """``tensorboard,wandb`` -> the sinks named; an unknown name is an error that lists the known ones."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown --log-to {', '.join(unknown)}: choose from {', '.join(SINKS)}")
    return names


def build(
    *,
    metrics_port: int | None,
    log_to: list[str],
    log_dir: Path,
    config: dict[str, Any],
    backlog: Callable[[], tuple[int, int]] | None = None,
) -> Telemetry:
    sinks: list[Sink] = [PrometheusSink(metrics_port, backlog)]
    if "tensorboard" in log_to:
        sinks.append(TensorBoardSink(log_dir / "tensorboard"))
    if "wandb" in log_to:
        sinks.append(WandbSink(log_dir, config))
    return Telemetry(sinks)


__all__ = ["SINKS", "PrometheusSink", "Telemetry", "TensorBoardSink", "WandbSink", "build", "parse_log_to", "scalars"]
