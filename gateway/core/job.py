"""What a protocol hands the serving core and gets back: a ``ChatJob`` in, ``ChoiceDelta``s and one
``ChoiceResult`` per choice out.

These types are the whole contract between the protocol modules (``gateway/protocols``) and ``ChatService``: they
name no protocol's fields, so a protocol is added without touching the service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from gateway.core.conversation import Message, ToolSpec, message_to_dict
from gateway.core.parsers.base import ParsedOutput, ToolCallDelta
from gateway.core.sessions import PromptPlan
from gateway.engines.base import SamplingParams


@dataclass(slots=True)
class RolloutRef:
    """Who a request belongs to: an explicit rollout id (URL prefix or header) or None for implicit grouping."""

    id: str | None = None
    is_subagent: bool = False
    agent_id: str | None = None
    # explicit: named by the client (URL prefix, X-Rollout-Id); session: a harness's own session header.
    # Session and implicit rollouts are closed by the gateway after an idle timeout; explicit ones by the client.
    kind: str = "explicit"
    # The policy version every call of the rollout is served by (an evaluation); None: routed as any other.
    policy_version: int | None = None
    # The tenant whose key sent the request: its calls join only its own conversations and rollouts.
    tenant: str = "default"
    # The quotas the call counts against (its tokens are charged when it ends); None: no quota applies.
    usage: UsageMeter | None = None


class UsageMeter(Protocol):
    def charge(self, tokens: int) -> None: ...


@dataclass(slots=True, frozen=True)
class ToolUse:
    """What the request's tool choice allows the answer: every protocol's spelling of it maps onto this."""

    parse: bool = True  # tool-call syntax in the answer becomes calls (tool_choice "none": it stays text)
    # A forced call: of any offered function (no name) or of the one named.
    force: bool = False
    name: str | None = None
    # At most one tool call per answer (parallel_tool_calls false, Anthropic disable_parallel_tool_use).
    single: bool = False

    @classmethod
    def openai(cls, choice: str | dict[str, Any] | None, name: str | None, parallel: bool | None) -> ToolUse:
        """The OpenAI APIs' spelling (chat completions and responses): "none", "auto", "required" or a function."""
        forced = choice == "required" or isinstance(choice, dict)
        return cls(parse=choice != "none", force=forced, name=name, single=parallel is False)


@dataclass(slots=True, frozen=True)
class JsonOutput:
    """The answer must be one JSON value matching ``schema`` (None: any JSON object): a structured output format."""

    schema: dict[str, Any] | None = None

    @classmethod
    def of(cls, fmt: dict[str, Any], schema: Any, name: str) -> JsonOutput | None:
        """A protocol's output format (``fmt``'s type: text, json_object or json_schema, whose ``schema`` each
        protocol keeps in its own place) as a JsonOutput (None: plain text); ValueError naming ``name`` else."""
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls()
        if kind != "json_schema":
            raise ValueError(f"{name} of type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'")
        if not isinstance(schema, dict):
            raise ValueError(f"{name} json_schema needs a schema that is a JSON schema object")
        return cls(schema or None)


@dataclass(slots=True)
class ResponseCapture:
    """A Responses-API answer to store with its call, so any gateway process can continue it later.

    ``items`` are the conversation messages the request added after the response it continues; ``answer`` turns
    the parsed output into the answer message as the conversation continues it (with the protocol's call ids).
    """

    previous_id: str | None
    stored: bool
    items: list[Message]
    answer: Callable[[ParsedOutput], Message]
    tenant: str = "default"  # only this tenant's requests may continue it

    def row(self, response_id: str, output: ParsedOutput) -> dict[str, Any]:
        items = [message_to_dict(m) for m in [*self.items, self.answer(output)]] if self.stored else None
        return {
            "id": response_id,
            "previous_id": self.previous_id,
            "stored": self.stored,
            "items": items,
            "tenant": self.tenant,
        }


@dataclass(slots=True)
class ChatJob:
    """One request as the service sees it: the conversation and tools, how to sample, who it belongs to."""

    api: str  # chat | messages | responses
    model: str
    messages: list[Message]
    tools: list[ToolSpec]
    n: int
    params: SamplingParams
    rollout: RolloutRef
    raw_request: dict[str, Any]  # the body as sent: the capture stores it
    # The id of the response this job answers, minted by its protocol (chatcmpl-…, msg_…, resp_…).
    request_id: str
    # The conversation as sent (the request's own message or item dicts): hashed exactly, to find the longest
    # prefix shared with the parent call's request. None for token-level APIs.
    raw_messages: list[Any] | None = None
    tool_use: ToolUse = ToolUse()
    stream: bool = True  # whether the client watches tokens arrive
    # False: the completion is returned as plain text (the completions API), no reasoning/tool parsing.
    parse_output: bool = True
    # Set for token-level APIs (completions): the prompt as given, no chat rendering or splicing.
    prompt_ids: list[int] | None = None
    # Responses API: the answer to store for ``previous_response_id``, committed with the call.
    response: ResponseCapture | None = None
    # A JSON output format (response_format, text.format): the answer is decoded under its grammar.
    json_output: JsonOutput | None = None


@dataclass(slots=True)
class PlannedCall:
    """A job ready to generate: its prompt plan, the ids of its calls, the rollout they join."""

    job: ChatJob
    request_id: str
    rollout_id: str
    prompt: PromptPlan
    params: SamplingParams
    call_ids: list[str]
    started_at: datetime
    t0: float
    render_s: float
    exact_hashes: list[bytes]
    stored_request: dict[str, Any]  # full body; the writer stores it as a delta
    request_prefix_messages: int
    adapter: str | None = None
    policy_version: int | None = None
    # Text appended to the rendered prompt to force a tool call (or to close a reasoning block before a grammar's
    # answer); the output parser reads it first.
    forced_text: str = ""
    # The rendered prompt opened a reasoning block (<think>): the parser starts inside it.
    opened_reasoning: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.prompt_ids


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta (text by kind, and the tokens behind it)."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A finished choice: the whole parsed answer, its tokens and why it stopped."""

    index: int
    call_id: str
    finish_reason: str  # stop | length | tool_calls
    output: ParsedOutput
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did
