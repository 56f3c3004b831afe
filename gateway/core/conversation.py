"""The one internal request model that every public API (chat completions, Anthropic messages, responses)
translates to, and the normalization used to recognise a harness's echo of an earlier answer.

Rendering, token-in-token-out splicing, parsing, capture and rollout grouping work only on these types, so they
behave the same whichever protocol a harness speaks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text as the model wrote it (or as the harness echoed it)
    id: str | None = None


@dataclass(slots=True)
class Message:
    role: Role
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    # A tool result the harness marked as failed (Anthropic ``is_error``, a failed Responses output). Not part of
    # what the model sees beyond the text the API translation gives it, nor of the echo hashes: it feeds the
    # next-state rules (``next_state.py``).
    is_error: bool = False

    def to_template(self) -> dict[str, Any]:
        """The message in the shape Hugging Face chat templates expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": tc.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": tc.name, "arguments": _arguments_for_template(tc.arguments)},
                }
                for i, tc in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def message_to_dict(message: Message) -> dict[str, Any]:
    """A JSON-ready form of a message, for storage (``message_from_dict`` reads it back equal)."""
    out: dict[str, Any] = {"role": message.role}
    for key in ("content", "reasoning", "tool_call_id", "name"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    if message.tool_calls:
        out["tool_calls"] = [{"name": tc.name, "arguments": tc.arguments, "id": tc.id} for tc in message.tool_calls]
    if message.is_error:
        out["is_error"] = True
    return out


def message_from_dict(data: dict[str, Any]) -> Message:
    return Message(
        role=data["role"],
        content=data.get("content"),
        reasoning=data.get("reasoning"),
        tool_calls=[ToolCall(tc["name"], tc["arguments"], id=tc.get("id")) for tc in data.get("tool_calls", [])],
        tool_call_id=data.get("tool_call_id"),
        name=data.get("name"),
        is_error=bool(data.get("is_error", False)),
    )


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def to_template(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


def _arguments_for_template(arguments: str) -> Any:
    # Templates render a dict with `tojson` and a string verbatim; hand them the parsed object when the text is
    # a JSON object so every template sees the structure it was written for.
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


# --- Echo normalization --------------------------------------------------------------------------------------
# A harness sends our earlier answers back rewritten: tool-call ids renamed (`call_abc` -> `callabc`), reasoning
# dropped, JSON arguments re-serialized, content parts merged or split, whitespace trimmed. Two messages are the
# "same turn" when their normalized forms are equal; the forms ignore exactly those rewrites.


def _norm_text(text: str | None) -> str:
    # All whitespace goes: harnesses trim, re-indent, and join content parts with or without newlines.
    # str.split() drops the same characters as the regex ``\s+`` (both test Py_UNICODE_ISSPACE; checked over every
    # code point in tests/test_conversation.py) at a third of its cost: this runs over a whole 30k-token
    # conversation on every call.
    return "".join(text.split()) if text else ""


def _canonical(value: Any) -> Any:
    """JSON values compared by meaning: 1.0 and 1 are the same number after a re-serialization."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _norm_arguments(arguments: str) -> Any:
    try:
        return _canonical(json.loads(arguments)) if arguments.strip() else {}
    except ValueError:
        return _norm_text(arguments)


def normalized(message: Message) -> str:
    """A canonical text of what a turn *says*, blind to the rewrites harnesses apply to echoed turns."""
    body: list[Any] = [message.role, _norm_text(message.content)]
    if message.tool_calls:
        body.append([[tc.name, _norm_arguments(tc.arguments)] for tc in message.tool_calls])
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def tools_hash(tools: list[ToolSpec]) -> bytes:
    canon = json.dumps([t.to_template() for t in tools], sort_keys=True, ensure_ascii=False)
    return _digest(b"tools\x00", canon.encode())


def _tenant_salt(tenant: str) -> bytes:
    # The default tenant's hashes are unsalted, as they were before tenants: stored calls keep continuing.
    return b"" if tenant == "default" else b"tenant\x00" + tenant.encode() + b"\x00"


def prefix_hashes(messages: list[Message], tools: list[ToolSpec], tenant: str = "default") -> list[bytes]:
    """``out[i]`` identifies the conversation ``messages[: i + 1]`` under ``tools`` (a running hash chain), for
    ``tenant``: the same conversation sent by two tenants hashes differently, so neither can continue the other's
    (in memory or in the database) or learn that it exists."""
    h = tools_hash(tools)
    if tenant != "default":
        h = _digest(h, _tenant_salt(tenant))
    out: list[bytes] = []
    for message in messages:
        h = _digest(h, normalized(message).encode())
        out.append(h)
    return out


def extend_hash(previous: bytes, message: Message) -> bytes:
    return _digest(previous, normalized(message).encode())


def output_hash(message: Message, tenant: str = "default") -> bytes:
    """Identifies an assistant turn by its content alone (to tell "ours, but history differs" from "not ours"), for
    ``tenant``."""
    return _digest(b"out\x00" + _tenant_salt(tenant), normalized(message).encode())


def exact_hash(raw_message: Any) -> bytes:
    """Identifies a message exactly as the client sent it (for storing request bodies as deltas)."""
    return _digest(json.dumps(raw_message, sort_keys=True, ensure_ascii=False).encode())
