"""Structured outputs: the grammar an answer must match, for a JSON output format or a forced tool call.

The grammar is llguidance's Lark dialect (gateway/engines/grammar.py): literal text, token references
(``<[id]>``) and ``%json`` schemas. JSON is written compactly with ``", "`` and ``": "`` separators, as chat
templates write tool calls, and without free whitespace (a model could otherwise fill its budget with it).

- ``response_format`` json_schema / json_object (Responses: ``text.format``): the answer is one JSON value of the
  schema (json_object: any object). When the request offers tools and lets the model choose (``auto``), a tool
  call is the other thing the answer may be.
- A forced call (``required``, a named function): its opening is appended to the prompt (gateway/core/
  tool_choice.py) and the grammar holds the rest: the arguments of the named function, or ``{"name": ...,
  "arguments": ...}`` of one offered function, then the closing tag; more calls follow only when parallel calls
  are allowed. Each function's arguments are their own ``%json`` root, so a schema's ``$ref`` pointers keep
  their meaning.

Reasoning is not possible under a grammar: the answer starts with what the grammar allows.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from gateway.core.job import ChatJob
from gateway.core.parsers.base import OutputParser
from gateway.core.tokens import single_token_id
from gateway.engines.base import Constraint
from gateway.engines.grammar import Grammars
from gateway.errors import BadRequest
from gateway.metrics import Metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# llguidance's JSON options: no free whitespace, the separators chat templates use.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: dict[str, Any] | bool) -> str:
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise BadRequest("a JSON schema must be an object", param="response_format")
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of an answer that is one JSON value of ``schema`` (None: any object), nothing else."""
    return f"start: answer\nanswer: {_json_rule(schema or _ANY_OBJECT)}"


class Structured:
    """Builds and checks the constraint of a job (see the module docstring)."""

    def __init__(
        self, parser_cls: type[OutputParser], tokenizer: PreTrainedTokenizerBase, metrics: Metrics | None = None
    ) -> None:
        self.parser_cls = parser_cls
        self.metrics = metrics
        self.grammars = Grammars(tokenizer)
        self._open = self._token(tokenizer, parser_cls.tool_call_open)
        self._close = self._token(tokenizer, parser_cls.tool_call_close)

    @staticmethod
    def _token(tokenizer: PreTrainedTokenizerBase, text: str | None) -> str | None:
        if text is None:
            return None
        token = single_token_id(tokenizer, text)
        return _literal(text) if token is None else f"<[{token}]>"

    def constraint(self, job: ChatJob, forced_text: str) -> Constraint | None:
        """The grammar of ``job``'s answer, or None when nothing constrains it."""
        if forced_text:
            return Constraint("tool_call", self._forced_call(job))
        if job.json_output is None:
            return None
        rules = [f"answer: {_json_rule(job.json_output.schema or _ANY_OBJECT)}"]
        start = "answer"
        if job.tools and job.parse_output and job.tool_use.parse and self._open and self._close:
            start = "answer | calls"
            rules += self._call_rules(job, with_open=True)
        return Constraint("json", "\n".join([f"start: {start}", *rules]))

    async def check(self, constraint: Constraint, param: str) -> None:
        """Refuse (BadRequest naming ``param``) a constraint the grammar library cannot compile."""
        if self.grammars.cached(constraint.grammar):
            if self.metrics is not None:
                self.metrics.grammar_hits.inc()
            return
        t0 = time.perf_counter()
        await asyncio.to_thread(self.grammars.check, constraint.grammar, param)
        if self.metrics is not None:
            self.metrics.grammar_compile.observe(time.perf_counter() - t0)

    def _forced_call(self, job: ChatJob) -> str:
        if self._close is None:
            raise BadRequest(
                f"tool_choice cannot force a call with the {self.parser_cls.name!r} tool-call format",
                param="tool_choice",
            )
        if job.tool_use.name is not None:
            # The prompt ends inside the call, after '"arguments": ': the arguments, then the call's end.
            tool = next(t for t in job.tools if t.name == job.tool_use.name)
            return "\n".join([f'start: args "}}\\n" {self._close}', f"args: {_json_rule(tool.parameters or {})}"])
        # The prompt ends after the opening tag: one call, then (parallel calls allowed) more.
        return "\n".join(["start: call_body", *self._call_rules(job, with_open=False)])

    def _call_rules(self, job: ChatJob, *, with_open: bool) -> list[str]:
        """Rules ``calls`` (whole calls, opening tags included) or ``call_body`` (the first call after its opening
        tag, then any further whole calls); a function's arguments are matched by its own schema."""
        close, opening = self._close, f'{self._open} "\\n"'
        single = job.tool_use.single or self._open is None
        more = "" if single else f' ("\\n" {opening} call "\\n" {close})*'
        first = f'calls: {opening} call "\\n" {close}' if with_open else f'call_body: call "\\n" {close}'
        rules = [first + more, "call: " + " | ".join(f"call_{i}" for i in range(len(job.tools)))]
        for i, tool in enumerate(job.tools):
            head = _literal('{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
            rules.append(f'call_{i}: {head} args_{i} "}}"')
            rules.append(f"args_{i}: {_json_rule(tool.parameters or {})}")
        return rules
