"""Capture records: what the gateway hands the writer (a rollout, a call, a reward), and their JSON form.

Records are plain dataclasses built on the serving path without I/O; ``gateway.store.rows`` turns them into
table rows. The JSON form (``record_to_json`` / ``record_from_json``) is what the spool and dead-letter files
hold, so a record that could not be committed can be replayed as it was.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from gateway.store.models import utcnow


@dataclass(slots=True)
class RolloutRecord:
    """A rollout to create, or to touch: an existing row gets ``updated_at`` and its still-null fields filled.

    ``status`` other than "open" overrides the stored status (that is how a rollout is finished through the
    writer, in order after its calls); "open" never reopens a finished rollout.
    """

    id: str
    kind: str = "implicit"
    task_id: str | None = None
    harness: str | None = None
    group_key: str | None = None
    status: str = "open"
    metadata: dict[str, Any] | None = None
    api_key_hash: str | None = None
    created_at: dt.datetime = field(default_factory=utcnow)
    updated_at: dt.datetime = field(default_factory=utcnow)
    finished_at: dt.datetime | None = None
    tenant: str = "default"  # kept from the first record of the rollout (an upsert never changes it)


@dataclass(slots=True)
class CallRecord:
    """One call as the gateway saw it. Fields mirror ``models.Call``; the writer packs them.

    ``request`` is the body as received, full message list included; the writer stores it without its first
    ``request_prefix_messages`` messages, which must equal the first messages of the parent call's full list.
    ``prompt_delta`` is the prompt after its first ``prompt_prefix_len`` tokens, which must equal the first
    tokens of the parent call's full prompt + completion. ``rollout``, when given, is upserted before the
    call.
    """

    id: str
    request_id: str
    rollout_id: str
    api: str
    model: str
    engine: str
    render_mode: str
    request: dict[str, Any]
    started_at: dt.datetime
    ended_at: dt.datetime
    choice_index: int = 0
    status: str = "ok"
    adapter: str | None = None
    policy_version: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    is_subagent: bool = False
    agent_id: str | None = None
    # The completion was sampled under a grammar (structured output, forced tool call): its logprobs are the
    # masked distribution's, so the trainer keeps its tokens as context and never trains on them.
    constrained: bool = False
    request_prefix_messages: int = 0
    parent_call_id: str | None = None
    prompt_prefix_len: int = 0
    prompt_delta: Sequence[int] = field(default_factory=list)
    completion_ids: Sequence[int] = field(default_factory=list)
    completion_logprobs: Sequence[float] = field(default_factory=list)
    tail_hash: str | None = None
    output_hash: str | None = None
    ttft_ms: float | None = None
    engine_ms: float | None = None
    gateway_ms: float | None = None
    rollout: RolloutRecord | None = None
    # The credentials the capture writer found in it (``TokenFinding`` fields but the text), once it has scanned it:
    # spooled with the record, so a replay neither scans again nor misses what ``secrets=drop`` already removed.
    secret_findings: list[dict[str, Any]] | None = None
    # A Responses-API answer to store with the call (``models.StoredResponse``): its id, ``previous_id``,
    # ``stored`` and ``items`` (the conversation messages it added, as dicts; None when not stored).
    response: dict[str, Any] | None = None
    # The parent call's prompt + completion, by weak reference to the session index's array (a queue of records
    # waiting out a database outage must not keep every conversation's tokens alive): if the parent was deleted
    # (forgotten, pruned) before this call was committed, the writer stores the call whole, as the first of its
    # conversation (``rows.as_root``). Not written to spool files: a replayed record goes without it.
    parent_ids: Callable[[], Sequence[int] | None] | None = field(default=None, metadata={"spool": False})

    @property
    def prompt_len(self) -> int:
        return self.prompt_prefix_len + len(self.prompt_delta)

    @property
    def completion_len(self) -> int:
        return len(self.completion_ids)


@dataclass(slots=True)
class RewardRecord:
    rollout_id: str
    value: float
    call_id: str | None = None
    source: str | None = None
    details: dict[str, Any] | None = None
    created_at: dt.datetime = field(default_factory=utcnow)


Record: TypeAlias = RolloutRecord | CallRecord | RewardRecord

_RECORD_TYPES: dict[str, type[RolloutRecord] | type[CallRecord] | type[RewardRecord]] = {
    "rollout": RolloutRecord,
    "call": CallRecord,
    "reward": RewardRecord,
}
_TYPE_NAMES = {cls: name for name, cls in _RECORD_TYPES.items()}
_DATETIME_FIELDS = {"created_at", "updated_at", "finished_at", "started_at", "ended_at"}


def _json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, RolloutRecord):
        return record_to_json(value)
    if hasattr(value, "tolist"):  # numpy arrays of ids or logprobs
        return value.tolist()
    return value


def record_to_json(record: Record) -> dict[str, Any]:
    """A JSON-ready dict of a record (datetimes as ISO strings, bytes as base64), tagged with its type."""
    out: dict[str, Any] = {"type": _TYPE_NAMES[type(record)]}
    for f in dataclasses.fields(record):
        if f.metadata.get("spool", True) is False:
            continue
        value = getattr(record, f.name)
        out[f.name] = _json_value(list(value) if isinstance(value, tuple) else value)
    return out


def record_from_json(data: dict[str, Any]) -> Record:
    data = dict(data)
    cls = _RECORD_TYPES[data.pop("type")]
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in names:
            raise ValueError(f"unknown {cls.__name__} field {name!r}")
        if name in _DATETIME_FIELDS and isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        elif name == "rollout" and isinstance(value, dict):
            value = record_from_json(value)
        elif isinstance(value, dict) and set(value) == {"base64"}:
            value = base64.b64decode(value["base64"])
        kwargs[name] = value
    return cls(**kwargs)
