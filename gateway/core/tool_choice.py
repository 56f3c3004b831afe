"""How a request's tool choice is honoured with this model family's tool-call format.

A forced call (``tool_choice`` required, or a named function) is the opening of a call appended to the prompt, so
the model continues inside it; one call per answer (``parallel_tool_calls`` false) is a stop at the token that
closes a call. A constraint the format cannot express is refused with a 400 rather than ignored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.core.job import ChatJob
from gateway.core.parsers.base import OutputParser
from gateway.core.tokens import single_token_id
from gateway.engines.base import SamplingParams
from gateway.errors import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ToolChoice:
    def __init__(self, parser_cls: type[OutputParser], tokenizer: PreTrainedTokenizerBase) -> None:
        self.parser_cls = parser_cls
        # The token that closes a tool call, when the tokenizer has it as one token: the stop for one call per turn.
        self.tool_close_id = single_token_id(tokenizer, parser_cls.tool_call_close)

    def apply(self, job: ChatJob) -> tuple[str, SamplingParams]:
        """The text that forces a call (appended to the prompt; empty when none is forced), and the sampling
        parameters (a stop at the end of the first call)."""
        params = job.params
        if not job.parse_output or not job.tool_use.parse:
            return "", params
        forced = ""
        if job.tool_use.force:
            if not job.tools:
                raise BadRequest("tool_choice forces a tool call, but the request offers no tools", param="tool_choice")
            prefix = self.parser_cls.forced_call_prefix(job.tool_use.name)
            if prefix is None:
                raise BadRequest(
                    f"tool_choice cannot force a call with the {self.parser_cls.name!r} tool-call format",
                    param="tool_choice",
                )
            forced = prefix
        if job.tool_use.single and job.tools:
            if self.tool_close_id is None:
                raise BadRequest(
                    f"parallel_tool_calls=false cannot be honoured with the {self.parser_cls.name!r} tool-call "
                    "format of this model's tokenizer",
                    param="parallel_tool_calls",
                )
            params = replace(params, stop_token_ids=(*params.stop_token_ids, self.tool_close_id))
        return forced, params
