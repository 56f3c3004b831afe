"""Capture records → table rows, and the statements that write a batch of them.

``prepare`` turns a batch into rows (packing token ids, logprobs and the trimmed request with
``gateway.store.codec``); a record that cannot become a row is set aside with its reason, to be dead-lettered.
``Statements`` holds the batch statements for one dialect: an idempotent rollout upsert that fills still-null
fields, insert-or-ignore for calls (and the Responses-API answers they carry), the parent's ``next_call_id`` link,
and plain inserts for rewards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from gateway.credentials.redact import scrubbed
from gateway.credentials.tokens import COMPLETION, TokenFinding
from gateway.store import codec
from gateway.store.errors import describe_error
from gateway.store.models import Call, Reward, Rollout, SecretFinding, StoredResponse
from gateway.store.records import CallRecord, Record, RewardRecord, RolloutRecord

log = logging.getLogger("clawgate.capture")

# Finds the credentials in a call record (``gateway/credentials/tokens.py``); None: not scanned (``secrets=off``).
Scanner = Callable[[CallRecord], list[TokenFinding]]


@dataclass
class Prepared:
    """A batch as rows, each with the records it came from (rollout rows merge several records)."""

    rollouts: dict[str, tuple[dict[str, Any], list[Record]]] = field(default_factory=dict)
    calls: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    rewards: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    responses: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    findings: list[tuple[dict[str, Any], Record]] = field(default_factory=list)
    dead: list[tuple[Record, str]] = field(default_factory=list)


_ROLLOUT_FILL = ("task_id", "harness", "group_key", "metadata", "api_key_hash", "finished_at")


def _rollout_row(record: RolloutRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "kind": record.kind,
        "task_id": record.task_id,
        "harness": record.harness,
        "group_key": record.group_key,
        "status": record.status,
        "metadata": record.metadata,
        "api_key_hash": record.api_key_hash,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "finished_at": record.finished_at,
        "tenant": record.tenant,
    }


def _merge_rollout(into: dict[str, Any], row: dict[str, Any]) -> None:
    """Two records of one rollout in a batch become one row (an upsert may touch a row once per statement)."""
    for key in _ROLLOUT_FILL:
        if into[key] is None:
            into[key] = row[key]
    into["created_at"] = min(into["created_at"], row["created_at"])
    into["updated_at"] = max(into["updated_at"], row["updated_at"])
    if row["status"] != "open":
        into["status"] = row["status"]


def _call_row(record: CallRecord) -> dict[str, Any]:
    if len(record.completion_logprobs) != len(record.completion_ids):
        raise ValueError(
            f"{len(record.completion_logprobs)} logprobs for {len(record.completion_ids)} completion tokens"
        )
    if record.prompt_prefix_len < 0 or (record.prompt_prefix_len > 0 and record.parent_call_id is None):
        raise ValueError(f"prompt_prefix_len={record.prompt_prefix_len} needs a parent call")
    if record.request_prefix_messages > 0 and record.parent_call_id is None:
        raise ValueError(f"request_prefix_messages={record.request_prefix_messages} needs a parent call")
    return {
        "id": record.id,
        "request_id": record.request_id,
        "choice_index": record.choice_index,
        "rollout_id": record.rollout_id,
        "api": record.api,
        "model": record.model,
        "adapter": record.adapter,
        "policy_version": record.policy_version,
        "engine": record.engine,
        "status": record.status,
        "error": record.error,
        "finish_reason": record.finish_reason,
        "render_mode": record.render_mode,
        "is_subagent": record.is_subagent,
        "agent_id": record.agent_id,
        "constrained": record.constrained,
        "request": codec.pack_request(codec.trim_request(record.request, record.request_prefix_messages)),
        "request_prefix_messages": record.request_prefix_messages,
        "parent_call_id": record.parent_call_id,
        "prompt_prefix_len": record.prompt_prefix_len,
        "prompt_delta": codec.pack_ids(record.prompt_delta),
        "prompt_len": record.prompt_len,
        "completion_ids": codec.pack_ids(record.completion_ids),
        "completion_logprobs": codec.pack_logprobs(record.completion_logprobs),
        "completion_len": record.completion_len,
        "tail_hash": record.tail_hash,
        "output_hash": record.output_hash,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "ttft_ms": record.ttft_ms,
        "engine_ms": record.engine_ms,
        "gateway_ms": record.gateway_ms,
    }


def as_root(record: CallRecord) -> dict[str, Any] | None:
    """The row of a call whose parent is gone (forgotten or pruned while it was being served), stored whole: no
    parent, its full prompt and request. None when the record no longer has its parent's tokens (replayed from a
    spool file, or the session index let them go)."""
    parent_ids = record.parent_ids() if record.parent_ids is not None else None
    if parent_ids is None or record.prompt_prefix_len > len(parent_ids):
        return None
    row = _call_row(record)
    prompt = [*parent_ids[: record.prompt_prefix_len], *record.prompt_delta]
    row.update(
        parent_call_id=None,
        prompt_prefix_len=0,
        prompt_delta=codec.pack_ids(prompt),
        request=codec.pack_request(codec.trim_request(record.request, 0)),
        request_prefix_messages=0,
    )
    return row


def _response_row(record: CallRecord) -> dict[str, Any]:
    response = record.response
    assert response is not None
    items = response.get("items")
    return {
        "id": response["id"],
        "call_id": record.id,
        "previous_id": response.get("previous_id"),
        "stored": bool(response.get("stored")),
        "items": None if items is None else codec.pack_request({"items": items}),
        "created_at": record.ended_at,
        "tenant": response.get("tenant", "default"),
    }


def next_state_link(call_row: dict[str, Any]) -> dict[str, Any]:
    return {"b_parent": call_row["parent_call_id"], "b_child": call_row["id"]}


def _reward_row(record: RewardRecord) -> dict[str, Any]:
    return {
        "rollout_id": record.rollout_id,
        "call_id": record.call_id,
        "value": float(record.value),
        "source": record.source,
        "details": record.details,
        "created_at": record.created_at,
    }


def _finding_rows(record: CallRecord, scanner: Scanner) -> list[dict[str, Any]]:
    try:
        findings = scanner(record)
    except Exception as error:  # the answer is then taken to hold one: excluded from training, never lost
        log.warning("call %s: the credential scan failed (%s); its answer is kept out of training", record.id, error)
        findings = [TokenFinding(COMPLETION, "Scan Failed", 0, len(record.completion_ids))]
    return [
        {
            "call_id": record.id,
            "rollout_id": record.rollout_id,
            "part": f.part,
            "kind": f.kind,
            "start": f.start,
            "end": f.end,
            "created_at": record.ended_at,
        }
        for f in findings
    ]


def prepare(batch: Iterable[Record], scanner: Scanner | None = None) -> Prepared:
    prepared = Prepared()

    def add_rollout(rollout: RolloutRecord, source: Record) -> None:
        row = _rollout_row(rollout)
        existing = prepared.rollouts.get(rollout.id)
        if existing is None:
            prepared.rollouts[rollout.id] = (row, [source])
        else:
            _merge_rollout(existing[0], row)
            existing[1].append(source)

    for record in batch:
        try:
            if isinstance(record, CallRecord):
                # Scanned first: under ``secrets=drop`` the scan changes the record the rows are made of.
                findings = _finding_rows(record, scanner) if scanner is not None else []
                row = _call_row(record)
                if getattr(scanner, "drop", False):
                    # A call without findings of its own can still carry an earlier answer's credential in its
                    # messages: under ``drop`` every stored request and answer is scrubbed by a scan of its text.
                    stored = codec.trim_request(record.request, record.request_prefix_messages)
                    row["request"] = codec.pack_request(scrubbed(stored))
                    if record.response is not None:
                        record.response = scrubbed(record.response)
                if record.rollout is not None:
                    add_rollout(record.rollout, record)
                prepared.calls.append((row, record))
                if record.response is not None:
                    prepared.responses.append((_response_row(record), record))
                prepared.findings.extend((f, record) for f in findings)
            elif isinstance(record, RolloutRecord):
                add_rollout(record, record)
            elif isinstance(record, RewardRecord):
                prepared.rewards.append((_reward_row(record), record))
            else:
                raise TypeError(f"not a capture record: {type(record).__name__}")
        except Exception as error:  # a record that cannot even be turned into a row
            prepared.dead.append((record, describe_error(error)))
    return prepared


def _table(model: type[Rollout | Call | Reward | StoredResponse | SecretFinding]) -> sa.Table:
    table = model.__table__
    assert isinstance(table, sa.Table)
    return table


class Statements:
    """The batch statements for one dialect, built once."""

    def __init__(self, dialect_name: str) -> None:
        rollouts, calls, rewards = _table(Rollout), _table(Call), _table(Reward)
        insert: Any
        greatest: Any
        if dialect_name == "postgresql":
            insert, greatest = postgresql.insert, sa.func.greatest
        elif dialect_name == "sqlite":
            insert, greatest = sqlite.insert, sa.func.max  # SQLite's two-argument max() is scalar
        else:
            raise ValueError(f"the capture writer supports sqlite and postgresql, not {dialect_name}")
        upsert = insert(rollouts)
        excluded = upsert.excluded
        fill = {key: sa.func.coalesce(rollouts.c[key], excluded[key]) for key in _ROLLOUT_FILL}
        self.rollouts = upsert.on_conflict_do_update(
            index_elements=["id"],
            set_={
                **fill,
                "updated_at": greatest(rollouts.c.updated_at, excluded.updated_at),
                "status": sa.case((excluded.status != "open", excluded.status), else_=rollouts.c.status),
            },
        )
        # Insert-or-ignore makes replaying a batch whose commit was in doubt write each call once.
        self.calls = insert(calls).on_conflict_do_nothing(index_elements=["id"])
        # A call that continues another holds that turn's next state; the first such call is recorded on the
        # parent (idempotent: a replay or a later retry of the same request leaves the link as it is).
        self.next_state = (
            sa.update(calls)
            .where(calls.c.id == sa.bindparam("b_parent"), calls.c.next_call_id.is_(None))
            .values(next_call_id=sa.bindparam("b_child"))
        )
        self.rewards = sa.insert(rewards)
        self.responses = insert(_table(StoredResponse)).on_conflict_do_nothing(index_elements=["id"])
        self.findings = insert(_table(SecretFinding)).on_conflict_do_nothing(
            index_elements=["call_id", "part", "start"]
        )
