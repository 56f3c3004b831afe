"""Request models of the policy-control API (``/v1/policy``): pin, roll back, promote, reject."""

from __future__ import annotations

from pydantic import Field

from gateway.protocols.common.wire import TolerantModel

_TENANT = "a tenant's own policy (default: the version's lineage, else the shared policy)"


class VersionChoice(TolerantModel):
    version: int = Field(ge=0, description="a published policy version (policy@vN)")
    tenant: str | None = Field(default=None, description=_TENANT)


class OptionalVersion(TolerantModel):
    version: int | None = Field(default=None, ge=0, description="a candidate's version (default: the undecided one)")
    tenant: str | None = Field(default=None, description=_TENANT)


class LineageChoice(TolerantModel):
    tenant: str | None = Field(default=None, description="a tenant's own policy (default: the shared policy)")
