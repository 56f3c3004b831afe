"""Base classes of the wire models: requests tolerant of unknown fields (and saying which ones they ignored),
responses strict and documented.

Harnesses send fields that no version of this gateway knows (`context_management`, `prompt_cache_key`, vendor
extensions). Rejecting them would break a drop-in replacement; silently swallowing them hides bugs. So unknown
fields are accepted, kept in ``model_extra`` and logged once per (model, field) at INFO.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("clawgate.protocol")


class TolerantModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    _logged_fields: ClassVar[set[tuple[str, str]]] = set()

    @model_validator(mode="after")
    def _log_ignored(self) -> TolerantModel:
        extra = self.model_extra
        if extra:
            cls = type(self).__name__
            for name in extra:
                key = (cls, name)
                if key not in TolerantModel._logged_fields and len(TolerantModel._logged_fields) < 1000:
                    TolerantModel._logged_fields.add(key)
                    log.info("ignoring unknown field %r in %s", name, cls)
        return self


class ModelRequest(TolerantModel):
    """A request that names the model it is for (every serving request)."""

    model: str


class ResponseModel(BaseModel):
    """Base of every response model: serialized with ``model_dump_json`` and documented in the OpenAPI schema.

    Unknown fields are refused: a response is built by the gateway, so an extra key is a bug in the translation.
    """

    model_config = ConfigDict(extra="forbid")


def _is_none(value: Any) -> bool:
    return value is None


def omitted() -> Any:
    """A field left out of the JSON while it is None (the protocols leave some keys out rather than send null)."""
    return Field(default=None, exclude_if=_is_none)


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """The one error shape of the OpenAI-style APIs."""

    error: ErrorDetail
