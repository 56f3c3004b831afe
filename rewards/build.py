"""Building the reward worker (`clawgate judge`) from its settings: reward functions, the LLM judge with its key
and rubric, the served model's tokenizer, and a database at the current schema.

``WorkerSettings`` holds the values of ``gateway.settings.Settings`` the worker needs: ``rewards`` may not import
the settings module, ``rewards/cli.py`` (a process edge) may, and fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from rewards.judge import Judge
from rewards.turns import Limits
from rewards.worker import RewardWorker, WorkerConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings:
    """The settings ``build_worker`` needs, named as in ``Settings`` (``max_staleness``: ``train_max_staleness``)."""

    model: str  # the served model, whose tokenizer decodes turns
    database_url: str
    judge_model: str | None
    judge_api_base: str | None
    judge_api_key_env: str | None
    judge_rubric: Path | None
    judge_timeout: float
    judge_max_answer_tokens: int
    judge_temperature: float
    judge_concurrency: int
    judge_max_attempts: int
    judge_interval: float
    judge_context_tokens: int
    judge_reply_tokens: int
    judge_next_state_tokens: int
    reward_functions: tuple[str, ...]
    max_staleness: int | None

    @property
    def reward_worker_enabled(self) -> bool:
        """Whether there is anything to judge with (a judge model or reward functions), as in Settings."""
        return self.judge_model is not None or bool(self.reward_functions)


def build_worker(settings: WorkerSettings) -> tuple[RewardWorker, sa.Engine]:
    """The worker ``settings`` describe, with its database engine; raises ValueError on a configuration error."""
    from gateway.store import db
    from rewards.functions import load

    if not settings.reward_worker_enabled:
        raise ValueError(
            "nothing to judge with: set --judge-model (CLAWGATE_JUDGE_MODEL) or --reward-fn (CLAWGATE_REWARD_FUNCTIONS)"
        )
    functions = [load(spec) for spec in settings.reward_functions]
    judge = _build_judge(settings.judge_model, settings) if settings.judge_model else None
    current, head = db.current_revision(settings.database_url), db.head_revision()
    if current != head:
        raise ValueError(f"database schema is at {current or 'nothing'}, expected {head}: run `clawgate db upgrade`")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(settings.model)
    except OSError as error:
        raise ValueError(f"cannot load the tokenizer of {settings.model}: {error}") from error
    config = WorkerConfig(
        concurrency=settings.judge_concurrency,
        max_attempts=settings.judge_max_attempts,
        interval=settings.judge_interval,
        lease=max(300.0, 3 * settings.judge_timeout),
        limits=Limits(settings.judge_context_tokens, settings.judge_reply_tokens, settings.judge_next_state_tokens),
        max_staleness=settings.max_staleness,
    )
    from rewards.turns import tokenizer_decode

    database = db.connect(settings.database_url)
    return RewardWorker(
        database, tokenizer_decode(tokenizer), judge=judge, functions=functions, config=config
    ), database


def _build_judge(model: str, settings: WorkerSettings) -> Judge:
    """The LLM judge ``model``, with the API key and rubric ``settings`` name."""
    import os

    from rewards.judge import load_rubric

    api_key = None
    if settings.judge_api_key_env:
        # The one variable read outside Settings: its *name* is configuration; its value is a secret that must
        # not be copied into settings (they are passed to child processes and may be printed).
        api_key = os.environ.get(settings.judge_api_key_env)
        if api_key is None:
            raise ValueError(
                f"{settings.judge_api_key_env} is not set (CLAWGATE_JUDGE_API_KEY_ENV names it as the judge's key)"
            )
        api_key = api_key or None  # set but empty: a judge that takes no key
    try:
        rubric = load_rubric(settings.judge_rubric)
    except OSError as error:
        raise ValueError(f"cannot read the judge rubric {settings.judge_rubric}: {error}") from error
    return Judge(
        model,
        api_base=settings.judge_api_base,
        api_key=api_key,
        rubric=rubric,
        timeout=settings.judge_timeout,
        max_tokens=settings.judge_max_answer_tokens,
        temperature=settings.judge_temperature,
    )


__all__ = ["WorkerSettings", "build_worker"]
