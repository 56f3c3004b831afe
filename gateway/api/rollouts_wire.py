"""Request models of the rollout, reward and feedback API."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.protocols.common.wire import TolerantModel


class CreateRollout(TolerantModel):
    task_id: str | None = Field(default=None, max_length=256)
    harness: str | None = Field(default=None, max_length=64)
    group: str | None = Field(default=None, max_length=512)
    metadata: dict[str, Any] | None = None
    # An evaluation rollout: recorded and rewarded like any other, never trained on.
    eval: bool = False
    # Serve every call of the rollout by this policy version (evaluating a version before it serves traffic).
    policy_version: int | None = Field(default=None, ge=0)
    # The tenant it belongs to (the global admin's choice; a tenant admin's rollouts are its tenant's).
    tenant: str | None = Field(default=None, max_length=64)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("value must be a finite number")
    return value


class PostReward(TolerantModel):
    value: float
    source: str | None = Field(default=None, max_length=128)
    details: dict[str, Any] | None = None

    _check = field_validator("value")(classmethod(lambda cls, v: _finite(v)))


class FinishRollout(TolerantModel):
    status: Literal["completed", "failed", "aborted"] = "completed"
    reason: str | None = Field(default=None, max_length=2000)


class PostFeedback(TolerantModel):
    """Per-call feedback in plain serving: name the call, or the API response id (chatcmpl-…, msg_…, resp_…)."""

    call_id: str | None = None
    response_id: str | None = None
    value: float
    source: str | None = Field(default=None, max_length=128)
    details: dict[str, Any] | None = None

    _check = field_validator("value")(classmethod(lambda cls, v: _finite(v)))

    @model_validator(mode="after")
    def _one_target(self) -> PostFeedback:
        if (self.call_id is None) == (self.response_id is None):
            raise ValueError("give exactly one of call_id or response_id")
        return self
