"""Where a call's tokens hold credentials, as positions in its whole sequence (full prompt + completion).

A finding is recorded once, on the call whose new tokens hold it (``secret_findings``: its prompt delta or its
answer). Every later call of the conversation repeats those tokens in its prompt, so a call's spans are its own
findings plus its ancestors' that fall inside the prefix it shares with its parent. The rollout API, exports, the
console and the judge's input redact by these spans; the trainer reads answer findings directly
(``training_data.answer_findings``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.credentials.tokens import COMPLETION
from gateway.store.models import Call, SecretFinding

# (kind, start, end): tokens [start, end) of a call's prompt + completion.
Span = tuple[str, int, int]
CHUNK = 500


def _own(session: Session, calls: Sequence[Call]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {c.id: [] for c in calls}
    prompt_len = {c.id: c.prompt_len for c in calls}
    ids = list(out)
    for lo in range(0, len(ids), CHUNK):
        rows = session.execute(
            sa.select(
                SecretFinding.call_id, SecretFinding.part, SecretFinding.kind, SecretFinding.start, SecretFinding.end
            ).where(SecretFinding.call_id.in_(ids[lo : lo + CHUNK]))
        )
        for call_id, part, kind, start, end in rows:
            shift = prompt_len[call_id] if part == COMPLETION else 0
            out[call_id].append((kind, start + shift, end + shift))
    return out


def sequence_spans(session: Session, calls: Iterable[Call]) -> dict[str, list[Span]]:
    """Each call's credential spans over its prompt + completion, inherited ones included, sorted."""
    calls = list(calls)
    known: dict[str, Call] = {c.id: c for c in calls}
    # Ancestors outside the given calls (a conversation continued from another rollout), fetched level by level.
    missing = {c.parent_call_id for c in known.values() if c.parent_call_id and c.parent_call_id not in known}
    while missing:
        found = list(session.scalars(sa.select(Call).where(Call.id.in_(sorted(missing)))))
        known.update((c.id, c) for c in found)
        missing = {c.parent_call_id for c in found if c.parent_call_id and c.parent_call_id not in known}
    own = _own(session, list(known.values()))
    spans: dict[str, list[Span]] = {}

    def of(call: Call) -> list[Span]:
        chain = [call]
        while chain[-1].id not in spans and chain[-1].parent_call_id in known:
            chain.append(known[chain[-1].parent_call_id])
        for c in reversed(chain):
            if c.id in spans:
                continue
            parent = known.get(c.parent_call_id or "")
            inherited = [
                (kind, start, min(end, c.prompt_prefix_len))
                for kind, start, end in (spans.get(parent.id, []) if parent is not None else [])
                if start < c.prompt_prefix_len
            ]
            spans[c.id] = sorted(inherited + own.get(c.id, []), key=lambda s: s[1])
        return spans[call.id]

    return {c.id: of(c) for c in calls}


def redact_ids(ids: Sequence[int], spans: Sequence[Span], offset: int = 0) -> list[int]:
    """``ids`` (positions ``offset`` on of a sequence) with every token inside a span replaced by -1."""
    out = list(ids)
    for _, start, end in spans:
        for i in range(max(start - offset, 0), min(end - offset, len(out))):
            out[i] = -1
    return out


def shifted(spans: Sequence[Span], offset: int, length: int) -> list[Span]:
    """The spans within positions ``[offset, offset + length)``, relative to ``offset``."""
    return [
        (kind, max(start - offset, 0), min(end - offset, length))
        for kind, start, end in spans
        if start < offset + length and end > offset
    ]
