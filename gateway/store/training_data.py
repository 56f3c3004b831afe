"""From the store to the prefix tree's pure types: a rollout's calls as ``CallView``s, its tree, its reward; turns.

Where the trainer's data leaves the database (the gateway's ``/tree`` route and `clawgate tree` read trees through it
too); everything after it (filters, advantages, packing) is a pure function of what it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.credentials.tokens import COMPLETION
from gateway.store import codec, repo
from gateway.store.counterfactuals import Group, Sibling, groups_of
from gateway.store.models import Call, Reward, Rollout, SecretFinding
from gateway.store.secret_spans import Span, sequence_spans
from gateway.store.turns import TurnReward, turn_rewards
from prefix_tree import CallView, RolloutTree, TreeConfig, build_tree


def answer_findings(session: Session, rollout_id: str) -> dict[str, list[tuple[int, int]]]:
    """The completion spans of credentials found in the rollout's answers, by call."""
    out: dict[str, list[tuple[int, int]]] = {}
    rows = session.execute(
        sa.select(SecretFinding.call_id, SecretFinding.start, SecretFinding.end).where(
            SecretFinding.rollout_id == rollout_id, SecretFinding.part == COMPLETION
        )
    )
    for call_id, start, end in rows:
        out.setdefault(call_id, []).append((start, end))
    return out


def _untrained(spans: list[tuple[int, int]] | None, length: int, secrets: str) -> tuple[tuple[int, int], ...]:
    if not spans or secrets == "off":
        return ()
    return tuple(sorted(spans)) if secrets == "mask" else ((0, length),)


def _redacted(ids: npt.NDArray[np.uint32], spans: list[Span], offset: int) -> npt.NDArray[np.int64]:
    out = ids.astype(np.int64)
    for _, start, end in spans:
        out[max(start - offset, 0) : max(end - offset, 0)] = -1
    return out


def call_views(
    session: Session,
    rollout_id: str,
    only: set[str] | None = None,
    secrets: str = "exclude",
    *,
    redact: bool = False,
) -> list[CallView]:
    """The rollout's calls as the tree needs them (``only``: just these calls); an answer holding a credential is
    kept out of the loss as ``secrets`` says (``TreeConfig.secrets``). ``redact``: for showing, not training, the
    credentials' token ids read -1."""
    cache = repo.CallCache.for_rollout(session, rollout_id)
    calls = repo.calls_for_rollout(session, rollout_id)
    if only is not None:
        calls = [c for c in calls if c.id in only]
    findings = answer_findings(session, rollout_id) if secrets != "off" else {}
    spans = sequence_spans(session, calls) if redact or secrets == "drop" else {}
    if secrets == "drop":
        # Stored tokens were replaced wherever a call's prompt or answer held a credential: its logprobs were
        # sampled from another context than the one stored, so no such call trains.
        findings = {c.id: [(0, c.completion_len)] for c in calls if spans.get(c.id)}

    def ids(c: Call) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        prompt, completion = repo.full_prompt_array(cache, c), codec.ids_array(c.completion_ids)
        if not redact or not spans.get(c.id):
            return prompt, completion
        return _redacted(prompt, spans[c.id], 0), _redacted(completion, spans[c.id], c.prompt_len)

    views = []
    for c in calls:
        prompt_ids, completion_ids = ids(c)
        views.append(
            CallView(
                id=c.id,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                completion_logprobs=codec.logprobs_array(c.completion_logprobs),
                started_at=c.started_at.timestamp(),
                status=c.status,
                policy_version=c.policy_version,
                is_subagent=c.is_subagent,
                agent_id=c.agent_id,
                finish_reason=c.finish_reason,
                constrained=c.constrained,
                untrained=_untrained(findings.get(c.id), c.completion_len, secrets),
            )
        )
    return views


def rollout_reward(session: Session, rollout_id: str) -> float | None:
    """The latest rollout-level reward (per-call feedback rows have a call id and do not count here)."""
    return session.scalar(
        sa.select(Reward.value)
        .where(Reward.rollout_id == rollout_id, Reward.call_id.is_(None))
        .order_by(Reward.id.desc())
        .limit(1)
    )


@dataclass(slots=True)
class RolloutData:
    rollout: Rollout
    tree: RolloutTree
    reward: float | None
    # The policy version of each served call (None: the base model), for the trainer's staleness bound.
    served_versions: list[int | None] = field(default_factory=list)


def load_rollout(
    db: sa.Engine, rollout_id: str, config: TreeConfig | None = None, *, redact: bool = False
) -> RolloutData | None:
    """The rollout's tree; ``redact``: credentials' token ids read -1 (to show it, never to train on it)."""
    with Session(db, expire_on_commit=False) as session:
        rollout = session.get(Rollout, rollout_id)
        if rollout is None:
            return None
        views = call_views(session, rollout_id, secrets=(config or TreeConfig()).secrets, redact=redact)
        tree = build_tree(views, config)
        served = [v.policy_version for v in views if v.status == "ok"]
        return RolloutData(rollout, tree, rollout_reward(session, rollout_id), served)


# A tree of turns keeps every call it is given: each was rewarded on its own, from its own next state, so none of
# the rules that guard a rollout-level reward's credit (retries, compaction, sub-agents, branching) applies.
TURN_TREE = TreeConfig(drop_dead_leaves=False, drop_compaction=False, keep_subagents=True, max_leaves=None)


@dataclass(slots=True)
class TurnData:
    """A ready turn (one call of a rollout without a group) and its reward."""

    call_id: str
    rollout_id: str
    api: str
    harness: str | None
    policy_version: int | None
    reward: TurnReward | None
    length: int = 0  # prompt + completion tokens: the longest path its tree can hold
    # Its counterfactual group (``counterfactuals.py``), when siblings were drawn for it.
    group: Group | None = None

    @property
    def baseline_key(self) -> str:
        """The batch baseline's key: the harness, else the API it spoke (harnesses differ in reward scale)."""
        return self.harness or f"api:{self.api}"


def load_turns(db: sa.Engine, call_ids: list[str]) -> list[TurnData]:
    if not call_ids:
        return []
    with Session(db) as session:
        rows = session.execute(
            sa.select(
                Call.id,
                Call.rollout_id,
                Call.api,
                Rollout.harness,
                Call.policy_version,
                Call.prompt_len,
                Call.completion_len,
            )
            .join(Rollout, Rollout.id == Call.rollout_id)
            .where(Call.id.in_(call_ids))
        ).all()
        rewards = turn_rewards(session, call_ids)
        groups = groups_of(session, call_ids)

    def length(prompt_len: int, completion_len: int, group: Group | None) -> int:
        # Its siblings share its prompt: the longest of their paths is what a forward pass must hold.
        answers = [completion_len, *(len(s.completion_ids) for s in (group.scored if group else []))]
        return prompt_len + max(answers)

    return [
        TurnData(
            r[0], r[1], r[2], r[3], r[4], rewards.get(r[0]), length(r[5], r[6], groups.get(r[0])), groups.get(r[0])
        )
        for r in rows
    ]


def turn_trees(
    db: sa.Engine, calls: list[TurnData], secrets: str = "exclude", *, siblings: bool = False
) -> list[tuple[str, RolloutTree]]:
    """One tree per rollout holding just the given turns (shared prefixes once; other calls are context);
    ``siblings``: with the scored counterfactual siblings of turns whose group has a baseline, as branches beside
    their turn's answer (one shared prompt)."""
    by_rollout: dict[str, set[str]] = {}
    for t in calls:
        by_rollout.setdefault(t.rollout_id, set()).add(t.call_id)
    groups = {t.call_id: t.group for t in calls if siblings and t.group is not None and t.group.has_baseline}
    out: list[tuple[str, RolloutTree]] = []
    with Session(db) as session:
        for rollout_id, only in sorted(by_rollout.items()):
            views = call_views(session, rollout_id, only, secrets)
            if groups:
                held = _with_findings(session, [v.id for v in views if v.id in groups]) if secrets != "off" else set()
                views += [
                    v
                    for view in views
                    if view.id in groups
                    for v in sibling_views(view, groups[view.id], secrets, held=view.id in held)
                ]
            out.append((rollout_id, build_tree(views, dataclasses.replace(TURN_TREE, secrets=secrets))))
    return out


def _with_findings(session: Session, call_ids: list[str]) -> set[str]:
    """Those of the calls with a credential found in their new prompt tokens or their answer."""
    if not call_ids:
        return set()
    return set(session.scalars(sa.select(SecretFinding.call_id).where(SecretFinding.call_id.in_(call_ids))))


def sibling_views(served: CallView, group: Group, secrets: str = "exclude", *, held: bool = False) -> list[CallView]:
    """The scored siblings of ``served`` as calls of the same prompt. A sibling's own credentials (found when it was
    drawn) stay out of the loss as a call's do (``secrets``); when the served call held one (``held``: it may sit in
    the shared prompt, and a sibling may repeat it without the scan of the sibling alone seeing it), the siblings'
    answers stay out of the loss whole."""

    def untrained(s: Sibling) -> tuple[tuple[int, int], ...]:
        if held and secrets != "off":
            return ((0, len(s.completion_ids)),)
        return _untrained([(a, b) for _, a, b in s.secret_spans or ()], len(s.completion_ids), secrets)

    return [
        CallView(
            id=s.id,
            prompt_ids=served.prompt_ids,
            completion_ids=s.completion_ids,
            completion_logprobs=s.completion_logprobs,
            started_at=served.started_at + 1e-6 * (i + 1),
            status="ok",
            policy_version=s.policy_version,
            finish_reason=s.finish_reason,
            untrained=untrained(s),
        )
        for i, s in enumerate(group.scored)
    ]


def rollout_ids(
    db: sa.Engine, *, status: str | None = None, limit: int | None = None, tenant: str | None = None
) -> list[str]:
    query = sa.select(Rollout.id).order_by(Rollout.created_at, Rollout.id)
    if status is not None:
        query = query.where(Rollout.status == status)
    if tenant is not None:
        query = query.where(Rollout.tenant == tenant)
    if limit is not None:
        query = query.limit(limit)
    with Session(db) as session:
        return list(session.scalars(query))


__all__ = [
    "TURN_TREE",
    "RolloutData",
    "TurnData",
    "call_views",
    "load_rollout",
    "load_turns",
    "rollout_ids",
    "rollout_reward",
    "sibling_views",
    "turn_trees",
]
