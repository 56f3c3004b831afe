"""Request models of the policy-control API (``/v1/policy``): pin, roll back."""

from __future__ import annotations

from pydantic import Field

from gateway.protocol.base import TolerantModel


class VersionChoice(TolerantModel):
    version: int = Field(ge=0, description="a published policy version (policy@vN)")
