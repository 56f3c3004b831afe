"""Base class of every request model: tolerant of unknown fields, and says which ones it ignored.

Harnesses send fields that no version of this gateway knows (`context_management`, `prompt_cache_key`, vendor
extensions). Rejecting them would break a drop-in replacement; silently swallowing them hides bugs. So unknown
fields are accepted, kept in ``model_extra`` and logged once per (model, field) at INFO.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

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


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as JSON-ready dict, without fields left unset to None by extensions."""
    return model.model_dump(exclude_none=True)
