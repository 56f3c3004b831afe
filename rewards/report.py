"""What happened to each turn of everyday traffic: its next state, rewards by source, judge verdict, training.

``clawgate turns`` prints it; a judge's reasons are read here (and in ``GET /v1/rollouts/{id}``, with each reward's
details).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from gateway.store import turns


def turn_rows(db: sa.Engine, *, rollout_id: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """The newest turns (of one rollout, or all), newest first, as JSON-ready dicts."""
    return [_row(turn) for turn in turns.turn_history(db, rollout_id=rollout_id, limit=limit)]


def _row(turn: turns.TurnHistory) -> dict[str, Any]:
    call, reward, verdict, consumed = turn.call, turn.reward, turn.verdict, turn.trained
    return {
        "call_id": call.id,
        "rollout_id": call.rollout_id,
        "api": call.api,
        "policy_version": call.policy_version,
        "started_at": call.started_at.isoformat(),
        "next_call_id": call.next_call_id,
        "state": _state(turn),
        "reward": None if reward is None else reward.value,
        "rewards": {} if reward is None else reward.sources,
        "judge_status": None if verdict is None else verdict.status,
        "judge_score": None if verdict is None else verdict.score,
        "judge_reason": None if verdict is None else verdict.reason,
        "judge_error": None if verdict is None or verdict.status == "done" else verdict.error,
        "judge_attempts": None if verdict is None else verdict.attempts,
        "trained_step": None if consumed is None else consumed.step_id,
        "advantage": None if consumed is None else consumed.advantage,
        # Its counterfactual group: the served answer's score on the siblings' terms (no next state), and theirs.
        "group_reward": None if turn.group is None else turn.group.served_reward,
        "siblings": []
        if turn.group is None
        else [
            {"id": s.id, "reward": s.reward, "finish_reason": s.finish_reason, "tokens": len(s.completion_ids)}
            for s in turn.group.siblings
        ],
    }


def _state(turn: turns.TurnHistory) -> str:
    """Its next state, the judge's verdict and its training, in words."""
    call, verdict, consumed = turn.call, turn.verdict, turn.trained
    if call.next_call_id is not None:
        next_state = f"next state in {call.next_call_id}"
    elif turn.rollout_status != "open":
        next_state = "rollout closed without a next state"
    else:
        next_state = "awaiting its next state"
    if consumed is not None:
        training = (
            f"trained in step {consumed.step_id} (advantage {consumed.advantage:+.3g})"
            if consumed.advantage is not None
            else f"consumed without training in step {consumed.step_id}"
        )
    else:
        training = "not trained yet"
    judge = "not judged" if verdict is None else f"judge {verdict.status}"
    if verdict is not None and verdict.score is not None:
        judge += f" {verdict.score:.3g}"
    return "; ".join((next_state, judge, training))


__all__ = ["turn_rows"]
