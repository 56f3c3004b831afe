"""The prefix tree on a real harness conversation: OpenClaw's chat-completions request, tokenized by the tiny model.

The captured request (system prompt with OpenClaw's tool catalogue, a user task, an ``exec`` tool call, its
result and OpenClaw's appended internal-context user turn) is continued for a few more tool turns of the same
shape and ends with the answer the capture server gave ("done"). One call is built per assistant turn the way
the gateway records it (token-in-token-out): the prompt is the previous prompt, the raw generated tokens of the
previous turn and the harness-inserted text after them; the completion is the assistant turn's tokens up to
``<|im_end|>``. A retry with another answer, abandoned for the original, is injected before one turn.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefix_tree import CallView, build_tree

FIXTURE = Path(__file__).parent / "fixtures/harness-requests/openclaw/01-chat-completions-after-tool-result.json"
END = "<|im_end|>"


def tool_turn(call_id: str, command: str, output: str, internal_context: Any) -> list[dict[str, Any]]:
    """An assistant ``exec`` call, its result, and the user turn OpenClaw appends after every tool result."""
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "exec", "arguments": json.dumps({"command": command})},
                }
            ],
        },
        {"role": "tool", "content": output, "tool_call_id": call_id},
        copy.deepcopy(internal_context),
    ]


def conversation() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The captured messages continued by three more tool turns and the final answer; and the tools."""
    capture = json.loads(FIXTURE.read_text())
    body = capture["body"]
    messages = list(body["messages"])
    internal_context = messages[-1]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    messages += tool_turn("callls1", "ls -la", "total 8\n-rw-r--r-- 1 root root 12 notes.txt\n", internal_context)
    messages += tool_turn("callwc2", "wc -l notes.txt", "1 notes.txt", internal_context)
    messages += tool_turn("callcat3", "cat notes.txt", "hello world", internal_context)
    messages.append({"role": "assistant", "content": capture["_response"]["text"]})
    return messages, body["tools"]


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert isinstance(text, str)
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def calls_from_conversation(tokenizer: Any) -> tuple[list[CallView], str]:
    """One call per assistant turn, spliced like the gateway does; and the whole conversation's text."""
    messages, tools = conversation()
    calls: list[CallView] = []
    prompt: list[int] = []
    rendered = ""  # the text that ``prompt`` (plus the last completion) stands for
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt_text = render(tokenizer, messages[:k], tools, gen=True)
        assert prompt_text.startswith(rendered)  # the template renders a prefix the same whatever follows
        prompt = prompt + encode(tokenizer, prompt_text[len(rendered) :])
        turn_text = render(tokenizer, messages[: k + 1], tools, gen=False)[len(prompt_text) :]
        completion_text = turn_text[: turn_text.index(END) + len(END)]
        completion = encode(tokenizer, completion_text)
        logprobs = [-0.5 - 0.01 * j - k for j in range(len(completion))]
        calls.append(CallView(f"turn{k}", prompt, completion, logprobs, float(k), "ok", policy_version=2))
        prompt = prompt + completion
        rendered = prompt_text + completion_text
    return calls, render(tokenizer, messages, tools, gen=False)


@pytest.fixture(scope="module")
def openclaw_calls(tiny_tokenizer: Any) -> tuple[list[CallView], str]:
    return calls_from_conversation(tiny_tokenizer)


def test_openclaw_conversation_reconstructs_one_trajectory_with_a_dead_retry(
    tiny_tokenizer: Any, openclaw_calls: tuple[list[CallView], str]
) -> None:
    calls, full_text = openclaw_calls
    assert len(calls) == 5
    # The harness re-sent the third turn's request (e.g. after its ~82 s abort); that first answer was dropped
    # on the floor and the conversation went on from the second one.
    original = calls[2]
    other = encode(
        tiny_tokenizer, '<tool_call>\n{"name": "exec", "arguments": {"command": "find . -maxdepth 1"}}\n</tool_call>'
    ) + encode(tiny_tokenizer, END)
    assert other != list(original.completion_ids)
    retry = CallView(
        "retry", original.prompt_ids, other, [-2.0] * len(other), original.started_at - 0.5, "ok", policy_version=2
    )
    tree = build_tree([*calls, retry])
    report = tree.report

    assert tree.calls["retry"].fate == "dead_leaf"
    assert all(tree.calls[c.id].fate == "kept" for c in calls)
    dead_id = tree.calls["retry"].end_node
    assert dead_id is not None
    dead = tree.nodes[dead_id]
    assert not dead.kept and not dead.trainable.any() and "retry" in dead.calls_ending
    assert report.dead_leaves == 1 and report.dead_leaf_tokens > 0

    (path,) = tree.paths()
    last = calls[-1]
    assert path.tokens.tolist() == list(last.prompt_ids) + list(last.completion_ids)
    # Raw tokens decode to exactly what the template renders for the whole conversation (TITO holds).
    assert tiny_tokenizer.decode(path.tokens.tolist(), skip_special_tokens=False) == full_text.removesuffix("\n")

    # Trainable exactly on the assistant turns, with the logprobs each turn was sampled with.
    expected = np.zeros(len(path.tokens), dtype=bool)
    for c in calls:
        start = len(c.prompt_ids)
        expected[start : start + len(c.completion_ids)] = True
        np.testing.assert_array_equal(path.logprobs[start : start + len(c.completion_ids)], c.completion_logprobs)
    np.testing.assert_array_equal(path.trainable, expected)
    assert report.trainable_tokens == sum(len(c.completion_ids) for c in calls) == int(expected.sum())
    assert np.isnan(path.logprobs[~expected]).all()
    assert (path.versions[expected] == 2).all() and (path.versions[~expected] == -1).all()

    # Storage: each prefix once, against every kept call holding its whole history.
    assert report.tree_tokens == len(path.tokens)
    assert report.naive_tokens == sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    assert report.tree_tokens_all == report.tree_tokens + len(other) - _shared_head(other, original)
    assert report.saving >= 3.0, f"saving {report.saving:.2f}x"
    text = tree.render_text()
    assert "dead leaf: retry abandoned for turn" in text and f"{report.saving:.2f}x" in text


def _shared_head(a: list[int], call: CallView) -> int:
    n = 0
    for x, y in zip(a, call.completion_ids, strict=False):
        if x != y:
            break
        n += 1
    return n
