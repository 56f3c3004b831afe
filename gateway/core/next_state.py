"""A turn's next state, and the rules that read a reward from it without a model.

A turn is one call's completion. When the harness sends the next request of the same conversation, the messages
after its echo of that completion are the environment's answer to it: tool results, the user's next message
(OpenClaw-RL's "next state"). The gateway finds the echo when it splices the raw tokens of the earlier answer
(``sessions.plan_prompt`` sets ``PromptPlan.splice_at``), so the next state costs nothing extra to find. In the
store it is the span of the continuing call's prompt after the earlier call's prompt + completion
(``Call.next_call_id`` points there; ``rewards/turns.py`` decodes it for the judge).

Rules: a tool result that the harness marks as failed is evidence from the environment, not a judgement of style,
so it gives the turn that called the tool a reward of its own (``Settings.tool_error_reward``, negative) with
source ``rule:tool_error``. Marked as failed means: Anthropic ``tool_result.is_error``, a Responses tool output
whose ``status`` is ``incomplete``/``failed``, or a tool result that reports a non-zero exit status in the form
harness shells print (Codex: "Process exited with code 2"; "Exit code: 2"). A user who repeats or rejects the
request is left to the judge: telling a correction from a follow-up takes a model.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.core.conversation import Message

RULE_SOURCE = "rule:tool_error"
# A shell tool's exit status as harnesses print it, on a line of its own.
_EXIT_STATUS = re.compile(r"^\s*(?:Process exited with code|Exit code:?)\s*(-?\d+)\s*$", re.MULTILINE | re.IGNORECASE)
_EXCERPT = 200
_SCAN = 4096


@dataclass(frozen=True, slots=True)
class ToolError:
    tool_call_id: str | None
    name: str | None
    why: str  # "marked as an error" | "exit code N"
    excerpt: str  # the start of the result's text

    def as_dict(self) -> dict[str, str | None]:
        return {"tool_call_id": self.tool_call_id, "name": self.name, "why": self.why, "excerpt": self.excerpt}


def next_state(messages: list[Message], splice_at: int) -> list[Message]:
    """The messages after the echoed answer at ``splice_at`` (none when nothing was spliced)."""
    if splice_at < 0:
        return []
    return messages[splice_at + 1 :]


def tool_errors(messages: list[Message]) -> list[ToolError]:
    """The tool results among ``messages`` that report a failure (see the module docstring)."""
    out: list[ToolError] = []
    for m in messages:
        if m.role != "tool":
            continue
        text = m.content or ""
        why: str | None = "marked as an error" if m.is_error else None
        if why is None:
            # Shells print the status at the start (Codex) or the end of a result: a huge output costs no more.
            status = _EXIT_STATUS.search(text[:_SCAN]) or _EXIT_STATUS.search(text[-_SCAN:])
            if status is not None and int(status.group(1)) != 0:
                why = f"exit code {int(status.group(1))}"
        if why is not None:
            out.append(ToolError(m.tool_call_id, m.name, why, text[:_EXCERPT]))
    return out
