"""One rollout as the console shows it: each call's prompt suffix and completion decoded, token by token with its
logprob, its rewards, its counterfactual group, and the rollout's prefix tree with what was filtered.

A call's counterfactual siblings (``gateway/store/counterfactuals.py``) are answers drawn for its exact prompt after
it was served; no client received one. They are decoded like the served completion, with credentials hidden: those
the scan found when the sibling was drawn, those a scan of its text as shown finds, and, when the served call's
tokens held a credential, every repeat of one of the prompt's (a sibling may repeat one from the shared prompt where
the detector would not flag the repeated value on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.credentials.detect import scan
from gateway.credentials.redact import Span, decode_redacted, redact_pieces
from gateway.credentials.tokens import Decode, token_span, tokenizer_decode
from gateway.state import AppState
from gateway.store import rollout_lifecycle
from gateway.store.secret_spans import shifted
from gateway.store.training_data import load_rollout

PROMPT_SHOWN = 2000  # a fresh harness prompt can be 30k tokens: its end is what the model answered
MIN_REPEAT = 8  # shorter prompt credentials are not looked for in a sibling (as on capture)


def view(state: AppState, rollout_id: str) -> dict[str, Any]:
    """The page's data; credentials are shown as placeholders (``gateway/credentials/redact.py``)."""
    data = rollout_lifecycle.detail(state.db, rollout_id, with_tokens=True, raw=True, counterfactuals=True)
    decode = tokenizer_decode(state.tokenizer)
    by_id = {c["id"]: c for c in data["calls"]}
    rewards_of: dict[str | None, list[dict[str, Any]]] = {}
    for r in data["rewards"]:
        rewards_of.setdefault(r["call_id"], []).append(r)
    calls = []
    for c in data["calls"]:
        prompt = c["prompt_token_ids"]
        parent = by_id.get(c["parent_call_id"] or "")
        start = 0
        if parent is not None:
            before = parent["prompt_token_ids"] + parent["completion_token_ids"]
            if prompt[: len(before)] == before:
                start = len(before)
        suffix = prompt[start:]
        shown = suffix[-PROMPT_SHOWN:]
        spans = [(s["kind"], s["start"], s["end"]) for s in c["secrets"]]
        shown_from = len(prompt) - len(shown)
        completion = c["completion_token_ids"]
        pieces = redact_pieces([decode([t]) for t in completion], shifted(spans, len(prompt), len(completion)))
        group = c["counterfactual_group"]
        calls.append(
            {
                **{
                    k: v
                    for k, v in c.items()
                    if k not in ("prompt_token_ids", "completion_token_ids", "counterfactual_group")
                },
                "prompt_from": start,
                "prompt_cut": len(suffix) - len(shown),
                "prompt_text": decode_redacted(shown, shifted(spans, shown_from, len(shown)), decode),
                "tokens": list(zip(pieces, c["completion_logprobs"], strict=True)),
                "rewards": rewards_of.get(c["id"], []),
                "group": None if group is None else _group(group, prompt if spans else [], decode),
            }
        )
    tree = load_rollout(state.db, rollout_id)
    return {
        "rollout": data,
        "calls": calls,
        "rollout_rewards": rewards_of.get(None, []),
        "tree_text": tree.tree.render_text(max_lines=400) if tree is not None else "",
        "filtered": tree.tree.to_json()["filtered"] if tree is not None else [],
    }


def _group(group: dict[str, Any], held_prompt: Sequence[int], decode: Decode) -> dict[str, Any]:
    """The group with each sibling's answer as (piece, logprob) pairs; ``held_prompt``: the served call's prompt
    when its tokens held a credential (else empty)."""
    secrets = prompt_secrets(decode(held_prompt)) if held_prompt else []
    siblings = [
        {
            **{k: v for k, v in s.items() if k not in ("completion_token_ids", "completion_logprobs")},
            "tokens": list(zip(sibling_pieces(s, secrets, decode), s["completion_logprobs"], strict=True)),
        }
        for s in group["siblings"]
    ]
    return {**group, "siblings": siblings}


def prompt_secrets(text: str) -> list[tuple[str, str]]:
    """(kind, value) of each credential the detector finds in a prompt's text, long enough to look for a repeat."""
    return [(f.kind, text[f.start : f.end]) for f in scan(text) if f.end - f.start >= MIN_REPEAT]


def sibling_pieces(sibling: dict[str, Any], secrets: Sequence[tuple[str, str]], decode: Decode) -> list[str]:
    """A sibling (``counterfactuals.group_record``, exact ids) token by token, its credentials shown as placeholders:
    those found when it was drawn, every repeat of one of the prompt's ``secrets``, and what a scan of its text
    finds."""
    ids: list[int] = sibling["completion_token_ids"]
    spans: list[Span] = [(f["kind"], f["start"], f["end"]) for f in sibling["secrets"] or ()]
    if secrets:
        text = decode(ids)
        for kind, value in secrets:
            at = text.find(value)
            while at >= 0:
                spans.append((f"Repeated {kind}", *token_span(ids, decode, at, at + len(value))))
                at = text.find(value, at + len(value))
    return redact_pieces([decode([t]) for t in ids], spans)


__all__ = ["prompt_secrets", "sibling_pieces", "view"]
