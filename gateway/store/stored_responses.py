"""Reading stored Responses-API answers back (``models.StoredResponse``): the chain behind a ``previous_response_id``.

Each row holds only the items its response added; a conversation is the chain of rows through ``previous_id``.
The caller's cache usually holds a recent ancestor, so the walk stops there instead of reading the whole chain.
Synchronous; the gateway runs it in a worker thread. Rows are written by the capture writer, with their call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import codec
from gateway.store.models import StoredResponse


@dataclass(slots=True)
class Chain:
    status: str  # "ok" | "missing" (this response or an ancestor is not stored) | "unstored" (store: false)
    items: list[dict[str, Any]] = field(default_factory=list)  # the messages added after ``base``, oldest first
    base: str | None = None  # the cached ancestor the walk stopped at (None: the chain's first response)


def chain(db: sa.Engine, response_id: str, cached: Callable[[str], bool], tenant: str = "default") -> Chain:
    """The items of ``response_id`` and its ancestors back to the first one, or to one that ``cached`` holds.
    Another tenant's response is "missing" (its existence is not revealed)."""
    added: list[bytes] = []  # newest first
    current: str | None = response_id
    base: str | None = None
    with Session(db) as session:
        while current is not None:
            if current != response_id and cached(current):
                base = current
                break
            row = session.get(StoredResponse, current)
            if row is None or row.tenant != tenant:
                return Chain("missing")
            if not row.stored or row.items is None:
                return Chain("unstored" if current == response_id else "missing")
            added.append(row.items)
            current = row.previous_id
    items = [item for packed in reversed(added) for item in codec.unpack_request(packed)["items"]]
    return Chain("ok", items, base)
